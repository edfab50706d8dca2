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
* a **per-uid share** of it: the registrations of one uid together hold at
  most ``registration_uid_share`` of the budget (default 50 %; root and the
  daemon's own uid are not capped), so one user reporting fake chunks
  cannot pin the whole budget;
* at most ``max_registrations_in_flight`` registrations **in flight** (default
  1, because pinning serializes on driver locks anyway). A request that must
  wait is **queued, never parked on a thread**: it is answered at once
  (reason "queued", a ticket, ``retry_after_ms``) and asks again with its
  ticket; the queue is FIFO, a ticket not presented again within
  :data:`TICKET_TTL_S` is dropped, a request leaves it after
  ``min(wait_ms, registration_max_wait_s)`` ("busy"), and one uid has at
  most ``max_registration_waiters_per_uid`` tickets (more: "busy" at once;
  root and the daemon's uid are not capped: their tickets cost memory only).
  So no rpc holds a daemon thread while it waits: a process that sent 64
  long waits parked 64 of the 64 gRPC threads before, and every other
  runtime call starved;
* **chunks** of at most ``registration_chunk_bytes`` (default 1 GiB), each
  reported (``ReportRegistrationChunk``): a progress log line and metrics
  (bytes, seconds, GB/s);
* a **watchdog**: a chunk running longer than ``registration_chunk_timeout_s``
  is reported (log, ``hwr_registration_watchdog_stalled``, ``hwr stats``);
  its registration leaves the in-flight set (the slot goes to the next
  request) and, until the chunk completes or the registration is released,
  new requests of the SAME session are refused "watchdog" at once. Other
  workers are not: a client that admits 4 KiB and never reports must not
  make the node refuse everyone. (A driver that is really stuck stalls the
  next registration too; each is flagged in turn.)

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
from hwr_server.logtext import untrusted
from hwr_server.registration.accounting import PinnedRange, check_ranges, union_bytes

log = logging.getLogger(__name__)

_GIB = 1024 ** 3

#: Refusal reasons (AdmitRegistrationReply.reason); QUEUED is not a
#: refusal yet: ask again with the ticket.
BUDGET, WATCHDOG, BUSY, SESSION, EMPTY, QUEUED = "budget", "watchdog", "busy", "session", "empty", "queued"
REASONS = (BUDGET, WATCHDOG, BUSY, SESSION, EMPTY, QUEUED)
#: A queued request asks again after this long. Milliseconds.
RETRY_AFTER_MS = 200
#: A ticket not presented again within this long leaves the queue (its
#: worker gave up or died). Seconds.
TICKET_TTL_S = 5.0
#: Refusals are logged at most once per this period. Seconds.
REFUSAL_LOG_PERIOD_S = 1.0


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
    #: With reason "queued": the ticket, when to ask again, requests ahead.
    ticket: str = ""
    retry_after_ms: int = 0
    position: int = 0


@dataclasses.dataclass
class _Waiter:
    """A queued request: its place is its position in the queue dict."""

    ticket: str
    session_id: str
    uid_key: str
    #: monotonic: when it leaves the queue ("busy"), when it last asked.
    deadline: float
    last_seen: float


@dataclasses.dataclass
class _Registration:
    rid: str
    session_id: str
    pid: int
    uid_key: str
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
    arithmetic; no method waits).

    Args:
        config: reads the ``registration_*`` fields,
            ``max_registrations_in_flight`` and
            ``max_registration_waiters_per_uid``.
        session_open: ``session_id -> bool``, True while the lease manager
            has that session open (checked before and after admitting: see
            :meth:`admit`).
        mem_total: node memory in bytes (default: ``/proc/meminfo``); used
            when ``registration_budget_bytes`` is 0.
        clock: monotonic seconds (tests pass a fake).

    Raises:
        InvalidArgument: a non-positive chunk size, in-flight cap, waiter cap
            or watchdog limit, or a budget fraction or uid share outside (0, 1].
    """

    def __init__(self, config: ServerConfig, session_open: Callable[[str], bool], *,
                 mem_total: Callable[[], int] = mem_total_bytes, clock: Callable[[], float] = time.monotonic):
        frac, share = float(config.registration_budget_fraction), float(config.registration_uid_share)
        for name, value in (("registration_budget_fraction", frac), ("registration_uid_share", share)):
            if not 0 < value <= 1:
                raise InvalidArgument(f"config: {name} ({value}) must be in (0, 1]")
        for name in ("registration_chunk_bytes", "max_registrations_in_flight", "registration_chunk_timeout_s",
                     "max_registration_waiters_per_uid"):
            if getattr(config, name) <= 0:
                raise InvalidArgument(f"config: {name} ({getattr(config, name)}) must be positive")
        self.budget = int(config.registration_budget_bytes) or int(mem_total() * frac)
        self.uid_share = share
        self.uid_cap = int(self.budget * share)
        self.max_waiters_per_uid = int(config.max_registration_waiters_per_uid)
        self.chunk_bytes = int(config.registration_chunk_bytes)
        self.max_in_flight = int(config.max_registrations_in_flight)
        self.chunk_timeout_s = float(config.registration_chunk_timeout_s)
        self.max_wait_s = float(config.registration_max_wait_s)
        self._session_open = session_open
        self._clock = clock
        # Guards every field below. Held for arithmetic only: nothing here
        # ever waits (a request that must wait is queued and asks again).
        self._lock = threading.Lock()
        self._regs: dict[str, _Registration] = {}
        #: Queued requests by ticket, oldest first (dicts keep insertion order).
        self._queue: dict[str, _Waiter] = {}
        self._in_flight = 0
        self._outcomes = {o: 0 for o in ("admitted", *REASONS)}
        self._chunks = 0
        self._chunk_bytes_total = 0
        self._chunk_seconds_total = 0.0
        self._last_gbps = 0.0
        self._stalls = 0
        self._released = 0
        self._refusal_logged_at = -REFUSAL_LOG_PERIOD_S
        self._refusals_unlogged = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        log.info("registration admission: budget %.2f GiB%s (%.0f%% per uid), %d in flight, chunks of %.2f GiB, "
                 "watchdog %.1f s", self.budget / _GIB,
                 "" if config.registration_budget_bytes else f" ({frac:.0%} of MemTotal)", share * 100,
                 self.max_in_flight, self.chunk_bytes / _GIB, self.chunk_timeout_s)

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Starts the watchdog thread."""
        self._thread = threading.Thread(target=self._watch_loop, name="hwr-reg-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the watchdog thread; requests from now on are refused
        "busy" (none waits on a thread: see the module docstring)."""
        self._stop.set()
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
        with self._lock:
            for r in self._regs.values():
                if r.in_flight and not r.stalled and now - r.chunk_started > self.chunk_timeout_s:
                    r.stalled = True
                    # The slot goes to the next request: a stall blocks only
                    # its own session (see the module docstring).
                    r.in_flight = False
                    self._in_flight -= 1
                    self._stalls += 1
                    newly.append(r)
            stalled = sum(1 for r in self._regs.values() if r.stalled)
        for r in newly:
            log.warning("registration %s… (pid %d, %s, %s): chunk %d has run for more than %.1f s "
                        "(registration_chunk_timeout_s); its slot goes to the next request, and its session's "
                        "new requests are refused until it completes", r.rid[:6], r.pid, r.uid_key,
                        untrusted(r.label or "unlabelled"), r.chunks, self.chunk_timeout_s)
        return stalled

    def _stalled_locked(self, session_id: str) -> _Registration | None:
        return next((r for r in self._regs.values() if r.stalled and r.session_id == session_id), None)

    # -- requests ------------------------------------------------------------------

    def admit(self, session_id: str, nbytes: int, *, pid: int, uid_key: str = "anonymous",
              privileged: bool = False, client_name: str = "", label: str = "", wait_s: float = 0.0,
              ticket: str = "", ranges: tuple[PinnedRange, ...] = ()) -> Admission:
        """Admits ``nbytes`` for the session, queues the request, or refuses
        it with a reason. Never waits.

        Order of the checks: session, empty, this session's stalled chunk
        (watchdog), node budget (the node's pinned bytes with ``ranges``
        added, each file byte once: :meth:`_pinned_locked`), the uid's share
        (unless ``privileged``),
        then the in-flight slot: free and nobody queued ahead, admitted;
        otherwise queued (a ticket; ask again after ``retry_after_ms``)
        while ``min(wait_s, registration_max_wait_s)`` lasts and the uid has
        fewer than ``max_registration_waiters_per_uid`` tickets, else "busy".

        Args:
            uid_key: who shares count against (``Peer.uid_key``).
            privileged: root or the daemon's uid: no uid share.
            wait_s: how long the request may stay queued (a first request).
            ticket: the ticket of an earlier "queued" answer.
            ranges: the file pages the registration pins (empty: ``nbytes``
                counted on their own).

        Raises:
            InvalidArgument: ``ranges`` that do not describe ``nbytes``.
        """
        check_ranges("AdmitRegistration", nbytes, ranges)
        if not self._session_open(session_id):
            return self._refuse(SESSION, "the session is not open (it ended or the daemon restarted); open a new one")
        if nbytes <= 0:
            return self._refuse(EMPTY, f"nbytes {nbytes}: expected a positive byte count")
        self.check_watchdog()
        now = self._clock()
        with self._lock:
            self._expire_waiters_locked(now)
            waiter = self._queue.get(ticket) if ticket else None
            if waiter is not None and waiter.session_id != session_id:
                waiter = None  # another session's ticket: not this request's place
            refusal = self._refusal_locked(session_id, nbytes, uid_key, privileged, ranges)
            if refusal is not None:
                self._drop_waiter_locked(waiter)
                return self._refuse_locked(*refusal)
            ahead = self._ahead_locked(waiter)
            if self._stop.is_set():
                self._drop_waiter_locked(waiter)
                return self._refuse_locked(BUSY, "the daemon is stopping; stage instead")
            if self._in_flight >= self.max_in_flight or ahead:
                return self._queue_locked(waiter, session_id, uid_key, ahead, now, wait_s,
                                          capped=not privileged, had_ticket=bool(ticket))
            self._drop_waiter_locked(waiter)
            after = self._pinned_locked((nbytes, ranges))
            reg = _Registration(secrets.token_urlsafe(18), session_id, pid, uid_key, client_name, label, nbytes,
                                chunk_started=now, ranges=tuple(ranges))
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
        log.info("registration %s… admitted: pid %d (%s, %s) %s, %.2f GiB in chunks of %.2f GiB; %.2f of %.2f GiB "
                 "admitted on the node", reg.rid[:6], pid, uid_key, untrusted(client_name),
                 untrusted(label or "unlabelled"), nbytes / _GIB,
                 self.chunk_bytes / _GIB, node_admitted / _GIB, self.budget / _GIB)
        return Admission(True, reg.rid, self.chunk_bytes)

    def _refusal_locked(self, session_id: str, nbytes: int, uid_key: str, privileged: bool,
                        ranges: tuple[PinnedRange, ...] = ()) -> tuple[str, str] | None:
        """(reason, detail) of a refusal by the watchdog or a budget, or None."""
        stalled = self._stalled_locked(session_id)
        if stalled is not None:
            return WATCHDOG, (f"this session's registration {stalled.rid[:6]}… has a chunk running past "
                              f"registration_chunk_timeout_s ({self.chunk_timeout_s:g} s); stage instead")
        pinned, after = self._pinned_locked(), self._pinned_locked((nbytes, ranges))
        if after > self.budget:
            return BUDGET, (f"{nbytes} bytes asked ({after - pinned} not pinned yet), {pinned} of {self.budget} "
                            "admitted on this node (registration_budget_bytes / registration_budget_fraction); "
                            "stage instead")
        if not privileged:
            # The uid's pages, each file byte once, as for the node's budget.
            mine = [(r.nbytes, r.ranges) for r in self._regs.values() if r.uid_key == uid_key]
            held, with_this = union_bytes(mine), union_bytes(mine + [(nbytes, ranges)])
            if with_this > self.uid_cap:
                return BUDGET, (f"{nbytes} bytes asked, {held} admitted to {uid_key}; one uid may hold at most "
                                f"{self.uid_cap} bytes ({self.uid_share:g} of the budget: registration_uid_share); "
                                "stage instead")
        return None

    def _ahead_locked(self, waiter: _Waiter | None) -> int:
        """Requests queued before ``waiter`` (all of them for a new request)."""
        if waiter is None:
            return len(self._queue)
        for i, t in enumerate(self._queue):
            if t == waiter.ticket:
                return i
        return len(self._queue)

    def _queue_locked(self, waiter: _Waiter | None, session_id: str, uid_key: str, ahead: int, now: float,
                      wait_s: float, *, capped: bool, had_ticket: bool) -> Admission:
        """Queues a new request or renews a queued one; "busy" when its wait
        is over, it asked for none, or (``capped``: not root or the daemon's
        uid) its uid has too many tickets."""
        busy = (f"{self._in_flight} registration(s) in flight, the limit is {self.max_in_flight} "
                f"(max_registrations_in_flight), {len(self._queue)} queued")
        if waiter is None:
            wait = max(0.0, min(wait_s, self.max_wait_s))
            if wait <= 0:
                return self._refuse_locked(BUSY, busy + ("; this request's wait is over (its ticket is gone)"
                                                         if had_ticket else ""))
            mine = sum(1 for w in self._queue.values() if w.uid_key == uid_key)
            if capped and mine >= self.max_waiters_per_uid:
                return self._refuse_locked(BUSY, (
                    f"{uid_key} has {mine} requests queued already, the limit is {self.max_waiters_per_uid} "
                    f"(max_registration_waiters_per_uid); {busy}"))
            waiter = _Waiter(secrets.token_urlsafe(12), session_id, uid_key, now + wait, now)
            self._queue[waiter.ticket] = waiter
            self._outcomes[QUEUED] += 1
        elif now >= waiter.deadline:
            self._drop_waiter_locked(waiter)
            return self._refuse_locked(BUSY, f"{busy}; this request's wait is over")
        waiter.last_seen = now
        return Admission(False, "", self.chunk_bytes, QUEUED, f"{busy}; {ahead} ahead of this one",
                         waiter.ticket, RETRY_AFTER_MS, ahead)

    def _drop_waiter_locked(self, waiter: _Waiter | None) -> None:
        if waiter is not None:
            self._queue.pop(waiter.ticket, None)

    def _expire_waiters_locked(self, now: float) -> None:
        """Drops tickets whose worker stopped asking or whose wait is over."""
        gone = [t for t, w in self._queue.items() if now - w.last_seen > TICKET_TTL_S or now >= w.deadline]
        for t in gone:
            del self._queue[t]

    def _refuse(self, reason: str, detail: str) -> Admission:
        with self._lock:
            return self._refuse_locked(reason, detail)

    def _refuse_locked(self, reason: str, detail: str) -> Admission:
        self._outcomes[reason] += 1
        # At most one line per period (with the count not logged): a client
        # asking in a loop, or a flood of requests, must not flood the journal.
        now = self._clock()
        if now - self._refusal_logged_at >= REFUSAL_LOG_PERIOD_S:
            log.info("registration refused (%s): %s (and %d refusal(s) not logged since the last)", reason, detail,
                     self._refusals_unlogged)
            self._refusal_logged_at, self._refusals_unlogged = now, 0
        else:
            self._refusals_unlogged += 1
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
        with self._lock:
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
        log.info("registration %s… (pid %d): chunk %d, %.3f GiB in %.3f s (%.2f GB/s), %.2f of %.2f GiB%s",
                 rid[:6], r.pid, r.chunks - 1, nbytes / _GIB, seconds, gbps, r.done_bytes / _GIB, r.nbytes / _GIB,
                 "; done" if complete else "")
        if was_stalled:
            log.warning("registration %s… (pid %d): the stalled chunk completed after %.1f s; its session is "
                        "admitted again", rid[:6], r.pid, seconds)
        return True, complete

    def release(self, session_id: str, rid: str, *, reason: str = "released") -> bool:
        """Returns a registration's bytes to the budget; False if the session
        does not hold it."""
        with self._lock:
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

    def end_session(self, session_id: str) -> int:
        """Releases every registration of the session (it ended: close,
        crash, SIGKILL, timeout); returns how many."""
        with self._lock:
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
        with self._lock:
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
                "hwr_registrations_queued": float(len(self._queue)),
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
