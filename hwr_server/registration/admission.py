"""Registration admission (DESIGN §16): the daemon owns the node's budget of
host memory pinned for the device (CUDA host registration).

Why the daemon: every worker on a node pins its own mappings with a
synchronous ``cudaHostRegister``; pinning faults every page under the mmap
lock and takes driver-global locks that stall other processes' CUDA calls, so
uncoordinated workers can starve a node or never finish. Workers
therefore ask first (``AdmitRegistration``), and the daemon enforces:

* a node-wide **budget** of registered bytes
  (``registration_budget_bytes``; 0 = ``registration_budget_fraction`` of
  ``MemTotal``, default 50 %), counting each (file, byte) once: workers that
  register the same blob pin the same page-cache pages
  (:mod:`hwr_server.registration.accounting`);
* at most ``max_registrations_in_flight`` registrations **in flight** (default
  1, because pinning serializes on driver locks anyway); a request waits for a
  slot at most ``min(wait_ms, registration_max_wait_s)``, then is refused
  "busy";
* **chunks** of at most ``registration_chunk_bytes`` (default 1 GiB), each
  reported (``ReportRegistrationChunk``): a progress log line and metrics
  (bytes, seconds, GB/s);
* a **watchdog**: a chunk running longer than ``registration_chunk_timeout_s``
  is reported (log, ``hwr_registration_watchdog_stalled``, ``hwr stats``) and,
  until it completes or its registration is released, every new request is
  refused "watchdog" at once.

A refusal is a reply, never an error: the worker takes the staging path.
Admitted bytes return to the budget on ``ReleaseRegistration``, and when the
session ends (:meth:`RegistrationAdmission.end_session`, called by the lease
manager for every end: close, crash, SIGKILL, missed keepalives).

The chunk clock: chunk 0 starts at admission, chunk k+1 when chunk k is
reported. The daemon cannot see the worker's call, so "the chunk in flight"
is whatever the worker has not yet reported.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from typing import Callable

from hwr_client.core.errors import InvalidArgument
from hwr_server.config import ServerConfig
from hwr_server.registration.accounting import PinnedRange, check_ranges, union_bytes

log = logging.getLogger(__name__)

_GIB = 1024 ** 3

#: Refusal reasons (AdmitRegistrationReply.reason).
BUDGET, WATCHDOG, BUSY, SESSION, EMPTY = "budget", "watchdog", "busy", "session", "empty"
REASONS = (BUDGET, WATCHDOG, BUSY, SESSION, EMPTY)


def mem_total_bytes(path: str = "/proc/meminfo") -> int:
    """MemTotal of this node in bytes; 0 when it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclasses.dataclass(frozen=True)
class Admission:
    """The answer to one request: admitted (with an id) or refused with a
    reason and its explanation."""

    admitted: bool
    registration_id: str = ""
    chunk_bytes: int = 0
    reason: str = ""
    detail: str = ""


@dataclasses.dataclass
class _Registration:
    rid: str
    session_id: str
    pid: int
    client_name: str
    label: str
    nbytes: int
    done_bytes: int = 0
    chunks: int = 0
    in_flight: bool = True
    #: monotonic start of the chunk not yet reported.
    chunk_started: float = 0.0
    stalled: bool = False
    #: The pages it pins (empty: ``nbytes`` counted on their own).
    ranges: tuple[PinnedRange, ...] = ()


class RegistrationAdmission:
    """The node's registration budget, in-flight cap and watchdog.

    Thread-safe: one lock guards every figure (each method holds it only for
    arithmetic, never across a wait that is not the condition's own).

    Args:
        config: reads the ``registration_*`` fields and
            ``max_registrations_in_flight``.
        session_open: ``session_id -> bool``, True while the lease manager
            has that session open (checked before and after admitting: see
            :meth:`admit`).
        mem_total: node memory in bytes (default: ``/proc/meminfo``); used
            when ``registration_budget_bytes`` is 0.
        clock: monotonic seconds (tests pass a fake).

    Raises:
        InvalidArgument: a non-positive chunk size, in-flight cap or
            watchdog limit, or a budget fraction outside (0, 1].
    """

    def __init__(self, config: ServerConfig, session_open: Callable[[str], bool], *,
                 mem_total: Callable[[], int] = mem_total_bytes, clock: Callable[[], float] = time.monotonic):
        frac = float(config.registration_budget_fraction)
        if not 0 < frac <= 1:
            raise InvalidArgument(f"config: registration_budget_fraction ({frac}) must be in (0, 1]")
        for name in ("registration_chunk_bytes", "max_registrations_in_flight", "registration_chunk_timeout_s"):
            if getattr(config, name) <= 0:
                raise InvalidArgument(f"config: {name} ({getattr(config, name)}) must be positive")
        self.budget = int(config.registration_budget_bytes) or int(mem_total() * frac)
        self.chunk_bytes = int(config.registration_chunk_bytes)
        self.max_in_flight = int(config.max_registrations_in_flight)
        self.chunk_timeout_s = float(config.registration_chunk_timeout_s)
        self.max_wait_s = float(config.registration_max_wait_s)
        self._session_open = session_open
        self._clock = clock
        # Guards every field below; the condition wakes waiters for an
        # in-flight slot when one frees or the watchdog trips.
        self._cond = threading.Condition(threading.Lock())
        self._regs: dict[str, _Registration] = {}
        self._in_flight = 0
        self._outcomes = {o: 0 for o in ("admitted", *REASONS)}
        self._chunks = 0
        self._chunk_bytes_total = 0
        self._chunk_seconds_total = 0.0
        self._last_gbps = 0.0
        self._stalls = 0
        self._released = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        log.info("registration admission: budget %.2f GiB%s, %d in flight, chunks of %.2f GiB, watchdog %.1f s",
                 self.budget / _GIB, "" if config.registration_budget_bytes else f" ({frac:.0%} of MemTotal)",
                 self.max_in_flight, self.chunk_bytes / _GIB, self.chunk_timeout_s)

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Starts the watchdog thread."""
        self._thread = threading.Thread(target=self._watch_loop, name="hwr-reg-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the watchdog thread and refuses every waiting request, so
        no rpc thread sits in a wait that would hold the daemon's exit (the
        pool's threads are joined at interpreter exit)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch_loop(self) -> None:
        period = min(1.0, self.chunk_timeout_s / 4)
        while not self._stop.wait(period):
            self.check_watchdog()

    # -- the watchdog ----------------------------------------------------------------

    def check_watchdog(self, now: float | None = None) -> int:
        """Flags every in-flight chunk older than the limit; returns how many
        are stalled now. Called by the watchdog thread and at each admit."""
        now = self._clock() if now is None else now
        newly: list[_Registration] = []
        with self._cond:
            for r in self._regs.values():
                if r.in_flight and not r.stalled and now - r.chunk_started > self.chunk_timeout_s:
                    r.stalled = True
                    self._stalls += 1
                    newly.append(r)
            stalled = sum(1 for r in self._regs.values() if r.stalled)
            if newly:
                # Waiters for a slot must learn at once that they are refused.
                self._cond.notify_all()
        for r in newly:
            log.warning("registration %s… (pid %d, %s): chunk %d has run for more than %.1f s "
                        "(registration_chunk_timeout_s); admitting no new registrations until it completes",
                        r.rid[:6], r.pid, r.label or "unlabelled", r.chunks, self.chunk_timeout_s)
        return stalled

    def _stalled_locked(self) -> _Registration | None:
        return next((r for r in self._regs.values() if r.stalled), None)

    # -- requests ------------------------------------------------------------------

    def admit(self, session_id: str, nbytes: int, *, pid: int, client_name: str = "", label: str = "",
              wait_s: float = 0.0, ranges: tuple[PinnedRange, ...] = ()) -> Admission:
        """Admits ``nbytes`` for the session, or refuses with a reason.

        Order of the checks: session, empty, watchdog, budget, in-flight slot
        (the only one that waits, at most ``min(wait_s, registration_max_wait_s)``;
        the watchdog and the budget are re-checked after every wake-up).
        The budget counts the node's pinned bytes with ``ranges`` added,
        each (file, byte) once (:func:`_pinned_locked`).

        Raises:
            InvalidArgument: ``ranges`` that do not describe ``nbytes``.
        """
        check_ranges("AdmitRegistration", nbytes, ranges)
        if not self._session_open(session_id):
            return self._refuse(SESSION, "the session is not open (it ended or the daemon restarted); open a new one")
        if nbytes <= 0:
            return self._refuse(EMPTY, f"nbytes {nbytes}: expected a positive byte count")
        self.check_watchdog()
        deadline = self._clock() + max(0.0, min(wait_s, self.max_wait_s))
        with self._cond:
            while True:
                stalled = self._stalled_locked()
                if stalled is not None:
                    return self._refuse_locked(WATCHDOG, (
                        f"registration {stalled.rid[:6]}… (pid {stalled.pid}) has a chunk running past "
                        f"registration_chunk_timeout_s ({self.chunk_timeout_s:g} s); stage instead"))
                pinned, after = self._pinned_locked(), self._pinned_locked((nbytes, ranges))
                if after > self.budget:
                    return self._refuse_locked(BUDGET, (
                        f"{nbytes} bytes asked ({after - pinned} not pinned yet), {pinned} of {self.budget} "
                        f"admitted on this node (registration_budget_bytes / registration_budget_fraction); "
                        f"stage instead"))
                if self._in_flight < self.max_in_flight:
                    break
                if self._stop.is_set():
                    return self._refuse_locked(BUSY, "the daemon is stopping; stage instead")
                left = deadline - self._clock()
                if left <= 0:
                    return self._refuse_locked(BUSY, (
                        f"{self._in_flight} registration(s) in flight, the limit is {self.max_in_flight} "
                        f"(max_registrations_in_flight); waited {min(wait_s, self.max_wait_s):g} s"))
                # Woken by a freed slot or a tripped watchdog; bounded so a
                # missed notify costs at most the remaining wait.
                self._cond.wait(timeout=left)
            reg = _Registration(secrets.token_urlsafe(18), session_id, pid, client_name, label, nbytes,
                                chunk_started=self._clock(), ranges=tuple(ranges))
            self._regs[reg.rid] = reg
            self._in_flight += 1
            self._outcomes["admitted"] += 1
            node_admitted = after
        # The session may have ended between the first check and the record:
        # its end hook ran before our record existed and freed nothing, so
        # free it here (the same re-check AcquireLease does for deletes).
        if not self._session_open(session_id):
            self.release(session_id, reg.rid, reason="session ended during admission")
            return self._refuse(SESSION, "the session ended during admission; open a new one")
        log.info("registration %s… admitted: pid %d (%s) %s, %.2f GiB in chunks of %.2f GiB; %.2f of %.2f GiB "
                 "admitted on the node", reg.rid[:6], pid, client_name, label or "unlabelled", nbytes / _GIB,
                 self.chunk_bytes / _GIB, node_admitted / _GIB, self.budget / _GIB)
        return Admission(True, reg.rid, self.chunk_bytes)

    def _refuse(self, reason: str, detail: str) -> Admission:
        with self._cond:
            return self._refuse_locked(reason, detail)

    def _refuse_locked(self, reason: str, detail: str) -> Admission:
        self._outcomes[reason] += 1
        log.info("registration refused (%s): %s", reason, detail)
        return Admission(False, "", self.chunk_bytes, reason, detail)

    def report_chunk(self, session_id: str, rid: str, nbytes: int, seconds: float) -> tuple[bool, bool]:
        """Records one registered chunk; returns (known, complete).

        Raises:
            InvalidArgument: a chunk larger than ``registration_chunk_bytes``
                or a negative duration.
        """
        if nbytes > self.chunk_bytes or seconds < 0:
            raise InvalidArgument(f"registration {rid[:6]}…: chunk of {nbytes} bytes in {seconds} s; expected at "
                                  f"most {self.chunk_bytes} bytes (registration_chunk_bytes) and seconds >= 0")
        with self._cond:
            r = self._regs.get(rid)
            if r is None or r.session_id != session_id:
                return False, False
            was_stalled = r.stalled
            r.done_bytes += nbytes
            r.chunks += 1
            r.stalled = False
            r.chunk_started = self._clock()
            self._chunks += 1
            self._chunk_bytes_total += nbytes
            self._chunk_seconds_total += seconds
            gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            self._last_gbps = gbps
            complete = r.done_bytes >= r.nbytes
            if complete and r.in_flight:
                r.in_flight = False
                self._in_flight -= 1
            if complete or was_stalled:
                self._cond.notify_all()  # a slot freed, or admissions resume
        log.info("registration %s… (pid %d): chunk %d, %.3f GiB in %.3f s (%.2f GB/s), %.2f of %.2f GiB%s",
                 rid[:6], r.pid, r.chunks - 1, nbytes / _GIB, seconds, gbps, r.done_bytes / _GIB, r.nbytes / _GIB,
                 "; done" if complete else "")
        if was_stalled:
            log.warning("registration %s… (pid %d): the stalled chunk completed after %.1f s; admitting again",
                        rid[:6], r.pid, seconds)
        return True, complete

    def release(self, session_id: str, rid: str, *, reason: str = "released") -> bool:
        """Returns a registration's bytes to the budget; False if the session
        does not hold it."""
        with self._cond:
            r = self._regs.get(rid)
            if r is None or r.session_id != session_id:
                return False
            self._drop_locked(r)
            left = self._pinned_locked()
        log.info("registration %s… (pid %d) released (%s): %.2f GiB back, %.2f of %.2f GiB admitted", rid[:6],
                 r.pid, reason, r.nbytes / _GIB, left / _GIB, self.budget / _GIB)
        return True

    def _pinned_locked(self, extra: tuple[int, tuple[PinnedRange, ...]] | None = None) -> int:
        """The node's pinned bytes (each file byte once), with ``extra``
        (a request's ``(nbytes, ranges)``) added when given. Holds the lock."""
        regs = [(r.nbytes, r.ranges) for r in self._regs.values()]
        return union_bytes(regs + ([extra] if extra is not None else []))

    def _drop_locked(self, r: _Registration) -> None:
        del self._regs[r.rid]
        if r.in_flight:
            self._in_flight -= 1
        self._released += 1
        self._cond.notify_all()  # bytes, a slot, or a stalled chunk freed

    def end_session(self, session_id: str) -> int:
        """Releases every registration of the session (it ended: close,
        crash, SIGKILL, timeout); returns how many."""
        with self._cond:
            gone = [r for r in self._regs.values() if r.session_id == session_id]
            for r in gone:
                self._drop_locked(r)
        if gone:
            log.info("session %s… ended: %d registration(s), %.2f GiB back to the budget", session_id[:6], len(gone),
                     sum(r.nbytes for r in gone) / _GIB)
        return len(gone)

    # -- figures ----------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Budget, admitted bytes per worker, in-flight count, chunk and
        watchdog figures (GetStats / Prometheus names)."""
        now = self._clock()
        with self._cond:
            out: dict[str, float] = {
                "hwr_registration_budget_bytes": float(self.budget),
                # Pinned on the node, each file byte once; "requested" sums
                # every registration's bytes (what per-worker figures add to).
                "hwr_registration_admitted_bytes": float(self._pinned_locked()),
                "hwr_registration_requested_bytes": float(sum(r.nbytes for r in self._regs.values())),
                "hwr_registrations_in_flight": float(self._in_flight),
                "hwr_registration_chunks_total": float(self._chunks),
                "hwr_registration_chunk_bytes_total": float(self._chunk_bytes_total),
                "hwr_registration_chunk_seconds_total": float(self._chunk_seconds_total),
                "hwr_registration_last_chunk_gbps": self._last_gbps,
                "hwr_registration_watchdog_stalls_total": float(self._stalls),
                "hwr_registration_watchdog_stalled": float(sum(1 for r in self._regs.values() if r.stalled)),
                "hwr_registration_watchdog_stalled_seconds": max(
                    [now - r.chunk_started for r in self._regs.values() if r.stalled], default=0.0),
                "hwr_registrations_released_total": float(self._released),
            }
            out.update({f'hwr_registration_admissions_total{{outcome="{o}"}}': float(n)
                        for o, n in self._outcomes.items()})
            per: dict[tuple[str, int, str], float] = {}
            for r in self._regs.values():
                k = (r.session_id[:6], r.pid, r.client_name)
                per[k] = per.get(k, 0.0) + r.nbytes
        for (sid, pid, name), n in per.items():
            safe = name.replace("\\", "\\\\").replace('"', '\\"')
            out[f'hwr_registration_worker_bytes{{session="{sid}",pid="{pid}",client="{safe}"}}'] = n
        return out
