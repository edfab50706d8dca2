"""Publication after a cold start, off the worker's critical path (DESIGN §17).

A preferred miss loads canonically and serves; :class:`BackgroundPublication`
then publishes the runtime tensors for the next start on a thread of its own,
over a connection of its own, while the first output is computed. It never
raises into the serving path: its outcome is a state and a report.

**Immutable from finalization on, proven.** The tensors it reads are the
model's own (no copy). Their data pointers and an xxh3 of their bytes are
taken when it starts, on the caller's thread (the warm path's snapshot,
:func:`dlo_runtime.restore.snapshot_tensors`: about 0.04 s per GiB), and
again once every byte is written, before the commit is sent. Any change (a
pointer moved, a byte changed) aborts the publication: the commit is never
sent, nothing becomes visible, the daemon removes the staging, and a WARNING
names the tensor. So what a later start maps is exactly what this one served.

**Ending it.** :meth:`BackgroundPublication.close` with ``wait_s`` waits at
most that long for it to finish, then abandons it: the call is cancelled and
its connection closed, so the daemon removes the staging at once (nothing
visible); a process that dies mid-publication (SIGKILL) breaks the connection
with the same effect; a process that hangs (SIGSTOP) is ended by the
daemon's ``publication_idle_s``. The default of ``from_pretrained``'s
:meth:`~dlo_runtime.pretrained.LoadedModel.close` is to let it finish in the
background (it holds its own connection and the tensors it reads); at
interpreter exit every publication still running gets at most
:data:`EXIT_WAIT_S` seconds (one deadline for all), then is abandoned. The
next start of an abandoned model misses again and publishes again.

States: ``running`` → ``published`` | ``already_published`` (ok) |
``aborted`` (a tensor changed) | ``failed`` (the daemon refused, or it is
gone) | ``abandoned`` (closed or exited first).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch

from dlo_runtime.restore import compare_snapshots, snapshot_tensors
from hwr_client.core.errors import HwrError
from hwr_client.core.identity import Identity

log = logging.getLogger(__name__)

#: Seconds interpreter exit waits, in all, for publications still running
#: before abandoning them. A module attribute: set it before exit to change it.
EXIT_WAIT_S = 30.0
#: Seconds a publication held for the model's first output waits for it at
#: most (a worker that does not serve soon still publishes). A module
#: attribute, as EXIT_WAIT_S.
FIRST_OUTPUT_WAIT_S = 30.0
#: Seconds an abandoned publication's thread gets to wind down (its call is
#: cancelled and its connection closed, so this is not expected to expire).
ABANDON_JOIN_S = 10.0
#: Nice increment of the publishing thread (Linux: per thread): the serving
#: threads of the same process come first on a busy node.
NICE = 10

RUNNING, PUBLISHED, ALREADY_PUBLISHED = "running", "published", "already_published"
ABORTED, FAILED, ABANDONED = "aborted", "failed", "abandoned"
_OK = (PUBLISHED, ALREADY_PUBLISHED)


class TensorsChanged(Exception):
    """A tensor being published changed after finalization."""


class IdentityIncomplete(Exception):
    """The pending identity failed (a source changed, went missing, became
    unreadable): there is nothing to publish under."""


class BackgroundPublication:
    """Publishes ``tensors`` on a thread of its own; see the module docstring.

    Args:
        socket: the daemon's runtime socket (its own connection is opened on
            the thread, so the caller may close its client at any time).
        identity: the identity that missed.
        tensors: name -> CPU tensor, final layout, as served; read in place.
        blocks: name groups in execution order (None derives them).
        progress: called with (bytes written, total) from the thread.
        on_done: called with the final report (a dict) from the thread,
            before :meth:`wait_published` returns it.

    Example:
        >>> pub = BackgroundPublication(sock, identity, tensors)  # doctest: +SKIP
        >>> pub.wait_published(60)["state"]                        # doctest: +SKIP
        'published'
    """

    def __init__(self, socket: str,
                 identity: Identity | Mapping[str, Any] | str | concurrent.futures.Future[Identity],
                 tensors: Mapping[str, torch.Tensor], *, blocks: Sequence[Sequence[str]] | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 on_done: Callable[[dict[str, Any]], None] | None = None,
                 start_after: threading.Event | None = None):
        # A future: the identity of a certain miss whose sources are still
        # being hashed; the thread waits for it, the caller does not. The
        # key is "" until then (identity_key() waits for it).
        self._pending = identity if isinstance(identity, concurrent.futures.Future) else None
        self.key = "" if self._pending is not None else Identity.coerce(identity).key
        self._identity: Any = identity
        self._socket, self._blocks, self._progress = socket, blocks, progress
        # Set by the model's first output (see publish_in_background), by a
        # caller that waits for the publication, or never (then it starts
        # FIRST_OUTPUT_WAIT_S after the start): until then nothing is written.
        self._go = start_after
        self._on_done = on_done
        self._tensors: Mapping[str, torch.Tensor] | None = tensors
        # On the caller's thread, before it returns to serving: what is
        # proven unchanged at the commit is what the model holds right now.
        self._before = snapshot_tensors(tensors)
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._client: Any = None
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.report: dict[str, Any] = {"state": RUNNING, "ok": False, "key": self.key}
        self._thread = threading.Thread(target=self._run, name=f"hwr-publish-{self.key[:8] or 'pending'}",
                                        daemon=True)
        _running.add(self)
        self._thread.start()

    # -- state -------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``running``, ``published``, ``already_published``, ``aborted``,
        ``failed`` or ``abandoned``."""
        return str(self.report["state"])

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def identity_key(self, timeout: float | None = None) -> str:
        """The key being published, waiting at most ``timeout`` seconds for
        a pending identity; "" when it could not be completed (or in time)."""
        if self._pending is not None and not self.key:
            try:
                return Identity.coerce(self._pending.result(timeout)).key
            except Exception:  # noqa: BLE001 - the publication's own report says why
                return ""
        return self.key

    def start_now(self) -> None:
        """Lets a publication held for the first output begin now."""
        if self._go is not None:
            self._go.set()

    def wait_published(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Waits until the publication ends (at most ``timeout`` seconds;
        None: no bound).

        Returns:
            The final report (``state``, ``ok``, ``key``, ``seconds``,
            ``bytes_written``, ``already_published``, ``transport``,
            ``error``), or None if it is still running.
        """
        self.start_now()  # whoever waits for it wants it now, served or not
        return dict(self.report) if self._done.wait(timeout) else None

    def close(self, *, wait_s: float | None = 0.0) -> dict[str, Any]:
        """Waits at most ``wait_s`` seconds (None: no bound) for the
        publication to end, then abandons it (nothing published, the staging
        removed by the daemon). Idempotent; returns the final report."""
        if wait_s is None or wait_s > 0:
            self.start_now()  # held for a first output that may never come
        if not self._done.wait(wait_s):
            self._abandon()
        return dict(self.report)

    def _abandon(self) -> None:
        self._cancel.set()
        self.start_now()  # wakes a thread held for the first output, which then sees the cancel
        with self._lock:
            client = self._client
        if client is not None:
            # Cancels the call wherever it waits (a slot, the daemon's answer,
            # a descriptor); the daemon sees the stream end and drops the staging.
            client.close()
        if not self._done.wait(ABANDON_JOIN_S):
            log.warning("HWR publish-after-load %s: still winding down %.0f s after it was abandoned",
                        self.key[:12], ABANDON_JOIN_S)

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        import hwr_client

        _lower_priority()
        state, fields = FAILED, {}
        try:
            if self._pending is not None:
                self._identity = self._complete_identity()
            self._wait_for_first_output()
            with self._lock:
                if self._cancel.is_set():
                    raise _Abandoned()
                self._client = hwr_client.connect(self._socket)
            assert self._tensors is not None
            rep = self._client.publish(self._identity, self._tensors, blocks=self._blocks, progress=self._progress,
                                       before_commit=self._prove, cancel=self._cancel)
            state = ALREADY_PUBLISHED if rep.already_published else PUBLISHED
            fields = {"bytes_written": rep.bytes_written, "already_published": rep.already_published,
                      "transport": rep.transport}
        except TensorsChanged as exc:
            state, fields = ABORTED, {"error": str(exc)}
        except IdentityIncomplete as exc:
            state, fields = FAILED, {"error": str(exc)}
            log.warning("HWR publish-after-load: %s", exc)
        except BaseException as exc:  # noqa: BLE001 - the serving path never sees it
            if self._cancel.is_set():
                state, fields = ABANDONED, {"error": "abandoned before it finished; nothing was published"}
            else:
                fields = {"error": f"{type(exc).__name__}: {exc}"}
                log.warning("HWR publish-after-load %s failed (the current process keeps serving): %s",
                            self.key[:12], fields["error"], exc_info=not isinstance(exc, HwrError))
        finally:
            self._finish(state, fields)

    def _wait_for_first_output(self) -> None:
        """Holds the writing until the model's first output (or
        FIRST_OUTPUT_WAIT_S): on a node whose cores the worker's first
        forward needs, the publication's hashing and page-cache writes
        would otherwise share them with it. Cancellable."""
        if self._go is not None:
            self._go.wait(FIRST_OUTPUT_WAIT_S)  # _abandon sets it too; _run checks the cancel next

    def _complete_identity(self) -> Identity:
        """Waits for the pending identity (the daemon or this process hashing
        the sources), cancellable; sets the key."""
        assert self._pending is not None
        while True:
            try:
                identity = Identity.coerce(self._pending.result(timeout=0.5))
                break
            except concurrent.futures.TimeoutError:
                if self._cancel.is_set():
                    raise _Abandoned() from None
            except Exception as exc:  # noqa: BLE001 - the report names it; nothing was sent
                raise IdentityIncomplete(f"source identity could not be completed ({type(exc).__name__}: {exc}); "
                                         "nothing published") from exc
        self.key = identity.key
        self.report["key"] = self.key
        return identity

    def _prove(self) -> None:
        """Before the commit: every tensor where it was and as it was."""
        assert self._tensors is not None
        changed = compare_snapshots(self._before, snapshot_tensors(self._tensors))
        if changed:
            first = changed[0].split(":", 1)[0]
            log.warning("HWR publish-after-load %s: tensor %r changed after finalization (%s); the publication "
                        "is aborted and nothing is published (tensors are immutable from finalization on: "
                        "byte-changing work belongs before it)", self.key[:12], first, "; ".join(changed[:5]))
            raise TensorsChanged(f"tensor {first!r} changed after finalization: {'; '.join(changed[:5])}")

    def _finish(self, state: str, fields: dict[str, Any]) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
        self._tensors = None  # the model's memory is no longer held by the publication
        seconds = round(time.monotonic() - self.started, 6)
        self.report = {"state": state, "ok": state in _OK, "key": self.key, "seconds": seconds,
                       "bytes_written": 0, "already_published": False, "transport": "", "error": "", **fields}
        if state in _OK:
            log.info("HWR publish-after-load %s: %s in %.2f s (in the background)", self.key[:12], state, seconds)
        # Before the waiters wake: whoever wait_published() returns to sees
        # what the callback recorded (a start's report, its trail).
        if self._on_done is not None:
            try:
                self._on_done(dict(self.report))
            except Exception:  # noqa: BLE001 - a callback must not break the thread's end
                log.warning("HWR publish-after-load %s: on_done callback raised", self.key[:12], exc_info=True)
        self._done.set()
        _running.discard(self)


class _Abandoned(Exception):
    pass


def _lower_priority() -> None:
    """Best effort: nice applies per thread on Linux (PRIO_PROCESS with a tid)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICE)
    except (OSError, AttributeError):
        pass


_running: "weakref.WeakSet[BackgroundPublication]" = weakref.WeakSet()


def running() -> list[BackgroundPublication]:
    """The publications of this process still running."""
    return [p for p in list(_running) if not p.done]


def wait_for_key(key: str, timeout: float | None = None, *,
                 among: Sequence[BackgroundPublication] | None = None) -> dict[str, Any] | None:
    """Waits for this process's running publication of ``key``, if any (a
    start of the same model would otherwise load canonically again and find
    the key being published); returns its report, or None when none runs.
    ``among``: the publications to look at (default: those running now); a
    caller that took :func:`running` before asking the daemon passes it, so
    one that ended in between still counts."""
    for pub in running() if among is None else among:
        if pub.identity_key(timeout) == key:
            log.info("HWR %s: waiting for this process's own background publication of it", key[:12])
            return pub.wait_published(timeout)
    return None


@atexit.register
def _at_exit() -> None:
    """Interpreter exit: every running publication gets what is left of
    :data:`EXIT_WAIT_S` (one deadline for all), then is abandoned."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for pub in running():
        pub.close(wait_s=max(0.0, deadline - time.monotonic()))


__all__ = ["ABANDONED", "ABORTED", "ALREADY_PUBLISHED", "BackgroundPublication", "EXIT_WAIT_S", "FAILED",
           "PUBLISHED", "RUNNING", "TensorsChanged", "running", "wait_for_key"]
