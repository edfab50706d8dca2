"""Resolve modes and startup outcomes (DESIGN §8), and publish-after-load.

A worker resolves its identity once at start:

=========  ===========================  ===========================  ==================================
mode       hit                          miss / unusable / no daemon  identity or configuration error
=========  ===========================  ===========================  ==================================
disabled   (never touches HWR: CANONICAL_FALLBACK, no connect, no identity check, no root)
preferred  LOCAL_HIT with a lease       CANONICAL_FALLBACK + reason  FAILED
required   LOCAL_HIT with a lease       FAILED + how to populate     FAILED
=========  ===========================  ===========================  ==================================

"Unusable" is an artifact that is quarantined, damaged, fails the
lease-time verification, or was published by someone this worker does not
trust (docs/trust.md: its own uid, root, the daemon's uid and the
daemon's ``trusted_publishers``; the daemon refuses the others and names
the publisher, which the FAILED error and the fallback reason repeat). A daemon that cannot take this worker now
(RESOURCE_EXHAUSTED: its stream, session or lease caps are full) is a miss
too: preferred falls back canonically with the reason logged, required
fails; it is not a broken identity. A non-retryable failure (InvalidArgument,
PermissionDenied, an internal error) is FAILED in both modes: preferred never
turns a broken identity or configuration into a silent miss.

After a preferred-mode miss the worker loads canonically, serves, and calls
:func:`publish_after_load` so the next start is a hit. It never raises into
the serving path: every failure becomes a report.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import logging
import time
from typing import Any, Callable, Mapping, Sequence

from hwr_client.channel import DEFAULT_TIMEOUT_S
from hwr_client.core.errors import (FailedPrecondition, HwrError, InvalidArgument, NotFound, ResourceExhausted,
                                    Unavailable, UntrustedPublisher)
from hwr_client.core.identity import Identity

log = logging.getLogger(__name__)


class Mode(str, enum.Enum):
    """How a worker uses HWR. Strings with these values are accepted too."""

    DISABLED = "disabled"
    PREFERRED = "preferred"
    REQUIRED = "required"


class Outcome(str, enum.Enum):
    """Startup outcome; compares equal to its name (``"LOCAL_HIT"``).

    :func:`resolve` answers LOCAL_HIT, CANONICAL_FALLBACK or FAILED (a
    disabled mode resolves to CANONICAL_FALLBACK: the caller loads
    canonically either way). DISABLED is what a worker start reports when
    it never touched HWR (:class:`dlo_runtime.StartupTransaction`), so a
    report tells "HWR off" apart from "HWR missed". CHECKPOINT_MMAP is a
    start served from the checkpoint's own mapping because its runtime
    layout is the checkpoint's (``from_pretrained(host_plan="auto")``): no
    daemon call, nothing leased or published.
    """

    LOCAL_HIT = "LOCAL_HIT"
    CANONICAL_FALLBACK = "CANONICAL_FALLBACK"
    DISABLED = "DISABLED"
    FAILED = "FAILED"
    CHECKPOINT_MMAP = "CHECKPOINT_MMAP"

    def __str__(self) -> str:
        return self.value


LOCAL_HIT = Outcome.LOCAL_HIT
CANONICAL_FALLBACK = Outcome.CANONICAL_FALLBACK
FAILED = Outcome.FAILED


@dataclasses.dataclass(frozen=True)
class Resolution:
    """What :func:`resolve` decided.

    Attributes:
        outcome: LOCAL_HIT, CANONICAL_FALLBACK or FAILED.
        mode: the mode it was resolved in.
        lease: the open Lease on LOCAL_HIT (the caller owns and closes it),
            else None.
        key: identity key ("" when disabled, the identity is invalid, or
            it is still being completed: see ``deferred``).
        reason: one line for logs: why this outcome.
        error: the HwrError behind a FAILED or a fallback, else None. On
            FAILED, raise it (its message says what to do).
        publisher: on LOCAL_HIT, who published the artifact as the daemon
            recorded it (e.g. ``uid 0 (pid 4242, python3)``, or ``the
            daemon (pulled from …, signed by SHA256:…)``).
        identity: the resolved identity when known (:func:`hwr_client.start.resolve_start`).
        deferred: a CANONICAL_FALLBACK that is certainly a miss while its
            sources are still being hashed: the future of the identity,
            completed while the caller loads canonically
            (:meth:`identity_now` waits for it).
        notes: what the user should know about this start (why the worker
            hashed sources itself, and what would make it fast).
    """

    outcome: Outcome
    mode: Mode
    lease: Any = None
    key: str = ""
    reason: str = ""
    error: HwrError | None = None
    publisher: str = ""
    identity: Identity | None = None
    deferred: concurrent.futures.Future[Identity] | None = dataclasses.field(default=None, compare=False)
    notes: tuple[str, ...] = ()

    @property
    def hit(self) -> bool:
        """True on LOCAL_HIT (``lease`` is then open)."""
        return self.outcome is Outcome.LOCAL_HIT

    def identity_now(self, timeout: float | None = None) -> Identity | None:
        """The identity, waiting for a deferred one (None when there is
        none: disabled, or an identity that failed to build).

        Raises:
            HwrError: completing the deferred identity failed (a source
                changed, went missing, became unreadable).
            TimeoutError: not done within ``timeout`` seconds.
        """
        if self.identity is not None or self.deferred is None:
            return self.identity
        return self.deferred.result(timeout)


def parse_mode(mode: Mode | str) -> Mode:
    """``Mode`` from an enum member or its string value.

    Raises:
        InvalidArgument: anything else.
    """
    try:
        return Mode(mode.value if isinstance(mode, Mode) else mode)
    except (ValueError, AttributeError):
        raise InvalidArgument(
            f"HWR mode {mode!r}: expected one of {', '.join(m.value for m in Mode)}"
        ) from None


def _populate_hint(key: str) -> str:
    return (f"populate the store first: run the worker once with mode=preferred (it publishes after the "
            f"canonical load), or `hwr prewarm ...` for this identity (key {key})")


def missed(mode: Mode, key: str, reason: str, error: HwrError) -> Resolution:
    """The Resolution of a miss, an unusable artifact or an unreachable
    daemon in ``mode``: CANONICAL_FALLBACK (preferred) or FAILED saying how
    to populate the store (required)."""
    if mode is Mode.PREFERRED:
        log.info("HWR resolve %s: %s; falling back to the canonical load", key[:12], reason)
        return Resolution(Outcome.CANONICAL_FALLBACK, mode, key=key, reason=reason, error=error)
    if isinstance(error, NotFound):
        error = NotFound(f"HWR required: artifact {key[:12]} is not in the store; {_populate_hint(key)}")
    elif isinstance(error, Unavailable):
        error = Unavailable(f"HWR required: {reason}; start the daemon (`hwr serve`) or use mode=preferred")
    elif isinstance(error, ResourceExhausted):
        error = ResourceExhausted(f"HWR required: {reason}; retry when the daemon has room, or use mode=preferred")
    elif isinstance(error, UntrustedPublisher):
        error = UntrustedPublisher(f"HWR required: {error}")
    else:
        error = FailedPrecondition(f"HWR required: artifact {key[:12]} is unusable ({error}); "
                                   f"{_populate_hint(key)} after `hwr verify {key}`")
    log.error("HWR resolve %s failed: %s", key[:12], error)
    return Resolution(Outcome.FAILED, mode, key=key, reason=reason, error=error)


def resolve(client: Any, identity: Identity | Mapping | str, *, mode: Mode | str = Mode.PREFERRED,
            verify: str = "none") -> Resolution:
    """Resolves ``identity`` to a lease or a fallback decision.

    Args:
        client: a :class:`hwr_client.Client` (may be None when disabled).
        identity: Identity, its dict document or JSON text.
        mode: ``"disabled"``, ``"preferred"`` or ``"required"`` (or Mode).
        verify: lease-time verification: ``"none"``, ``"fast"``, ``"full"``.

    Returns:
        A Resolution; see the module table. Never raises for a miss, an
        unusable artifact or an unreachable daemon.

    Raises:
        InvalidArgument: ``mode`` is not a mode (a caller bug, not an
            outcome).

    Example:
        >>> res = client.resolve(identity, mode="preferred")   # doctest: +SKIP
        >>> if res.outcome == "LOCAL_HIT":                      # doctest: +SKIP
        ...     weights = res.lease.tensors()
    """
    mode = parse_mode(mode)
    if mode is Mode.DISABLED:
        # Zero HWR interaction: no identity work, no connection, no root.
        return Resolution(Outcome.CANONICAL_FALLBACK, mode, reason="HWR disabled")
    try:
        key = Identity.coerce(identity).key
    except HwrError as exc:
        return failed(mode, "", f"invalid identity: {exc}", exc)
    return lease_or_miss(client, key, mode=mode, verify=verify)


def lease_or_miss(client: Any, key: str, *, mode: Mode, verify: str = "none",
                  known_miss: NotFound | None = None) -> Resolution:
    """Leases ``key`` in ``mode`` (not disabled), pulling it from the
    daemon's registry on a miss: the part of :func:`resolve` after the key.
    ``known_miss``: the daemon already said the key is not in the store
    (ResolveLease), so the pull is asked for at once.

    Returns:
        A Resolution (see the module table); never raises for a miss.
    """
    from hwr_client.lease import acquire

    pulled = ""
    try:
        try:
            if known_miss is not None:
                raise known_miss
            lease = acquire(client, key, verify=verify)
        except NotFound as exc:
            # Pull on a miss: the daemon asks its [remote] registry (when one
            # is configured with pull_on_miss) before the worker loads
            # canonically; an exact identity pulled is a LOCAL_HIT, also in
            # required mode (it is not a canonical load).
            outcome = _pull_on_miss(client, key, mode, exc)
            if isinstance(outcome, Resolution):
                return outcome
            pulled = outcome
            lease = acquire(client, key, verify=verify)
    except NotFound as exc:
        return missed(mode, key, f"artifact {key[:12]} not in the store", exc)
    except UntrustedPublisher as exc:
        return missed(mode, key, str(exc), exc)
    except FailedPrecondition as exc:
        return missed(mode, key, f"artifact {key[:12]} unusable: {exc}", exc)
    except Unavailable as exc:
        return missed(mode, key, f"HWR daemon unreachable: {exc}", exc)
    except ResourceExhausted as exc:
        # Decided here, not by making ResourceExhausted retryable in
        # general: for a worker at start a full daemon is a miss.
        return missed(mode, key, f"HWR daemon cannot take this worker now: {exc}", exc)
    except HwrError as exc:
        # InvalidArgument, PermissionDenied, Internal...: not a miss.
        return failed(mode, key, f"{type(exc).__name__}: {exc}", exc)
    log.info("HWR resolve %s: LOCAL_HIT (lease %s…, published by %s)%s", key[:12], lease.lease_id[:8],
             lease.publisher or "?", pulled and f" {pulled}")
    return Resolution(Outcome.LOCAL_HIT, mode, lease=lease, key=key,
                      reason=f"exact artifact in the store ({pulled})" if pulled else "exact artifact in the store",
                      publisher=lease.publisher)


#: Pull on a miss: seconds the worker waits without progress from the daemon
#: before it gives up on the pull. The deadline rule of every unary call
#: (``DEFAULT_TIMEOUT_S``: no answer for that long is a failure) applied to
#: each progress event rather than to the whole pull, which legitimately
#: takes minutes for a large artifact while its bytes flow. Past it the
#: miss is handled like an unreachable registry below; the daemon's pull
#: goes on and serves the next miss.
PULL_STALL_S = DEFAULT_TIMEOUT_S


def _pull_on_miss(client: Any, key: str, mode: Mode, miss: NotFound) -> Resolution | str:
    """Asks the daemon to pull ``key`` from its remote (PullOnMiss), waiting
    as long as progress comes at least every :data:`PULL_STALL_S` seconds.

    Returns:
        A one-line note when it was pulled (the caller acquires again), or
        the Resolution of the miss: the registry lacks it (or no remote is
        configured: an ordinary miss), or the registry failed (unreachable,
        refused, corrupt: a miss logged as such in preferred mode, FAILED in
        required mode, where the pull was the only way to a hit).
    """
    last = [time.monotonic()]

    def progress(p: Any) -> None:
        # The worker waits while the layers flow; a line every few seconds says how far.
        if time.monotonic() - last[0] >= 5.0:
            last[0] = time.monotonic()
            log.info("HWR resolve %s: pulling from the registry, %.0f of %.0f MiB (%d of %d layers)", key[:12],
                     p.bytes_done / 2**20, p.bytes_total / 2**20, p.layers_done, p.layers_total)

    try:
        done = client.pull_on_miss(key, progress=progress, stall_s=PULL_STALL_S)
    except NotFound as exc:
        return missed(mode, key, f"artifact {key[:12]} not in the store ({exc})", miss)
    except HwrError as exc:
        reason = f"artifact {key[:12]} not in the store and the pull from the registry failed: " \
                 f"{type(exc).__name__}: {exc}"
        if mode is Mode.PREFERRED:
            log.warning("HWR resolve %s: %s; falling back to the canonical load", key[:12], reason)
            return Resolution(Outcome.CANONICAL_FALLBACK, mode, key=key, reason=reason, error=exc)
        log.error("HWR resolve %s failed: %s", key[:12], reason)
        return Resolution(Outcome.FAILED, mode, key=key, reason=reason, error=exc)
    return f"pulled from {done.reference}: {done.bytes_transferred} bytes in {done.seconds:.2f} s"


def failed(mode: Mode, key: str, reason: str, error: HwrError) -> Resolution:
    """The Resolution of a failure that is not a miss (FAILED in every mode)."""
    log.error("HWR resolve %s failed (%s mode, not retryable): %s", key[:12] or "-", mode.value, reason)
    return Resolution(Outcome.FAILED, mode, key=key, reason=reason, error=error)


# -- publish after load ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PublishAfterLoadReport:
    """What :func:`publish_after_load` did; it never raises.

    Attributes:
        ok: the artifact is in the store now (published or already there).
        key: identity key ("" if the identity was invalid).
        seconds: wall time of the attempt.
        bytes_written: payload bytes the daemon wrote (0 if already there).
        already_published: another worker published it first.
        error: ``"<ErrorClass>: <message>"`` when not ok, else "".
    """

    ok: bool
    key: str
    seconds: float
    bytes_written: int = 0
    already_published: bool = False
    error: str = ""


def publish_after_load(client: Any, identity: Identity | Mapping | str, tensors: Mapping[str, Any], *,
                       blocks: Sequence[Sequence[str]] | None = None,
                       progress: Callable[[int, int], None] | None = None) -> PublishAfterLoadReport:
    """Publishes the runtime tensors after a preferred-mode canonical load.

    Never raises into the caller: any failure (daemon gone, capacity,
    conflict, a bug, even a failing ``progress`` callback) is logged and
    returned in the report. The serving path must not depend on it.

    Args:
        client: a :class:`hwr_client.Client`.
        identity: the same identity that missed.
        tensors: name -> CPU tensor (final layout, as served).
        blocks: name groups in execution order; None derives them.
        progress: called with (bytes sent, total bytes) as the payload flows.

    Returns:
        A PublishAfterLoadReport.

    Example:
        >>> rep = client.publish_after_load(identity, model.state_dict())  # doctest: +SKIP
        >>> rep.ok, rep.seconds                                             # doctest: +SKIP
    """
    t0 = time.monotonic()
    key = ""
    try:
        key = Identity.coerce(identity).key
        from hwr_client.publish import publish

        report = publish(client, identity, tensors, blocks=blocks, progress=_guarded(progress, key))
        seconds = time.monotonic() - t0
        log.info("HWR publish-after-load %s: %s in %.2f s", key[:12],
                 "already published" if report.already_published else f"{report.bytes_written} bytes", seconds)
        return PublishAfterLoadReport(True, report.key, seconds, report.bytes_written, report.already_published)
    except BaseException as exc:  # noqa: BLE001 - by contract this never raises into serving
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        seconds = time.monotonic() - t0
        log.warning("HWR publish-after-load %s failed after %.2f s (the current process keeps serving): %s: %s",
                    key[:12] or "-", seconds, type(exc).__name__, exc, exc_info=not isinstance(exc, HwrError))
        return PublishAfterLoadReport(False, key, seconds, error=f"{type(exc).__name__}: {exc}")


def _guarded(progress: Callable[[int, int], None] | None, key: str) -> Callable[[int, int], None] | None:
    """A progress callback whose exceptions are logged once, not raised."""
    if progress is None:
        return None
    failed = [False]

    def call(sent: int, total: int) -> None:
        if failed[0]:
            return
        try:
            progress(sent, total)
        except Exception:  # noqa: BLE001 - a bad callback must not fail the publication
            failed[0] = True
            log.warning("HWR publish-after-load %s: progress callback raised; ignoring it", key[:12], exc_info=True)

    return call
