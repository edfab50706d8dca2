"""Stream admission: which client streams may hold a server thread (DESIGN §16).

grpcio's sync server runs every rpc, unary or streaming, on a thread of the
socket's one ThreadPoolExecutor (``grpc_threads``) for the rpc's whole life,
so an idle stream holds its thread. Without a gate, 64 Session streams that
never send SessionOpen (or 64 Publish streams that send only a plan) took
every thread and the node's other calls hung. The rules, per socket:

* **A reserved unary share.** At most :func:`stream_capacity` threads
  (``grpc_threads`` less ``max(4, grpc_threads // 4)``) may be held by client
  streams; the rest always serve unary calls (Lookup, AcquireLease,
  GetStats, ...).
* **Admission before the first read.** A stream is counted at handler entry,
  before its first message, against its peer's cap
  (``max_streams_per_peer`` for a peer proven by the credentials handshake,
  ``max_streams_anonymous`` for every caller without a token together), its
  uid's cap (``max_streams_per_uid``, default half the socket's streams: one
  user forking processes must not hold every stream while other users'
  workers are refused; root and the daemon's uid are not capped by it) and
  the total. Over a cap: RESOURCE_EXHAUSTED naming the cap and its config
  field, and the thread goes back to the pool at once.
* **A first-message deadline.** An admitted stream that sends nothing
  within ``stream_first_message_timeout_s`` is cancelled (which wakes its
  thread, blocked in the request iterator). After the first message the
  rpc's own rules take over: Session keepalives, the publication's idle
  deadline.
* **The backstop.** gRPC's ``maximum_concurrent_rpcs``
  (``max_concurrent_rpcs``): rpcs beyond it, running or queued for a thread,
  get RESOURCE_EXHAUSTED from gRPC itself without taking a thread.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from typing import Any, Callable, Iterator

import grpc

from hwr_client.core.errors import InvalidArgument, ResourceExhausted
from hwr_server.access.peers import Peer, privileged
from hwr_server.config import ServerConfig

log = logging.getLogger(__name__)

#: Refusals are logged at most once per this period per socket (with the
#: count of those not logged): a client retrying in a loop must not flood
#: the journal. Seconds.
_REFUSAL_LOG_PERIOD_S = 1.0


def unary_reserve(config: ServerConfig) -> int:
    """Threads of ``grpc_threads`` that client streams can never take."""
    return max(4, int(config.grpc_threads) // 4)


def stream_capacity(config: ServerConfig) -> int:
    """Client streams (Session, Publish) one socket serves at once."""
    return max(1, int(config.grpc_threads) - unary_reserve(config))


def uid_stream_cap(config: ServerConfig) -> int:
    """Client streams the processes of one (unprivileged) uid hold together:
    ``max_streams_per_uid``, or half of :func:`stream_capacity` when 0."""
    return int(config.max_streams_per_uid) or max(1, stream_capacity(config) // 2)


class _Timer:
    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None] | None):
        self.callback = callback


class Deadlines:
    """One thread that runs callbacks at their deadlines: the first-message
    timers of every stream. (A ``threading.Timer`` per stream would double
    the threads that a flood of streams costs.)"""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Timer]] = []
        self._seq = itertools.count()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the timer thread."""
        self._thread = threading.Thread(target=self._run, name="hwr-deadlines", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread; pending callbacks never run."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def arm(self, after_s: float, callback: Callable[[], None]) -> _Timer:
        """Runs ``callback`` (on the timer thread) in ``after_s`` seconds
        unless :meth:`disarm` comes first."""
        timer = _Timer(callback)
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + after_s, next(self._seq), timer))
            self._cond.notify()  # the new deadline may be the earliest
        return timer

    def disarm(self, timer: _Timer) -> None:
        """Cancels a timer; its heap entry is dropped when it comes due."""
        with self._cond:
            timer.callback = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    # Sleeps until the earliest deadline; arm() and stop()
                    # wake it. Correctness does not depend on when it wakes.
                    self._cond.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                if self._stopped:
                    return
                _, _, timer = heapq.heappop(self._heap)
                callback, timer.callback = timer.callback, None
            if callback is not None:
                try:
                    callback()
                except Exception:  # noqa: BLE001 - one bad callback must not stop the others
                    log.exception("deadline callback failed")


class Ticket:
    """One admitted stream; :meth:`release` (idempotent) frees its place."""

    def __init__(self, admission: StreamAdmission, peer: Peer):
        self._admission = admission
        self._peer = peer
        self._released = False

    def release(self) -> None:
        """Frees the stream's place (called by the handler's exit AND by the
        rpc's termination callback: whichever comes first)."""
        self._admission._release(self)


class StreamAdmission:
    """The stream caps of one socket (see the module docstring).

    Args:
        config: grpc_threads, max_streams_per_peer, max_streams_anonymous,
            stream_first_message_timeout_s, max_concurrent_rpcs.
        socket_name: for messages ("runtime socket").
        deadlines: the timer thread shared by the daemon's sockets.
        per_peer: False on the admin socket (mode 0600: only the daemon's
            own user reaches it, without a token): only the total applies.

    Raises:
        InvalidArgument: a cap or the timeout is out of range.
    """

    def __init__(self, config: ServerConfig, *, socket_name: str, deadlines: Deadlines, per_peer: bool = True):
        for name, value, low in (("max_streams_per_peer", config.max_streams_per_peer, 1),
                                 ("max_streams_anonymous", config.max_streams_anonymous, 0),
                                 ("max_streams_per_uid", config.max_streams_per_uid, 0),
                                 ("max_concurrent_rpcs", config.max_concurrent_rpcs, config.grpc_threads)):
            if value < low:
                raise InvalidArgument(f"config: {name} = {value}; expected at least {low}")
        if not config.stream_first_message_timeout_s > 0:
            raise InvalidArgument(f"config: stream_first_message_timeout_s = {config.stream_first_message_timeout_s}; "
                                  "expected a positive number of seconds")
        self.config = config
        self.socket_name = socket_name
        self.per_peer = per_peer
        self.capacity = stream_capacity(config)
        self.uid_cap = uid_stream_cap(config)
        self._deadlines = deadlines
        self._lock = threading.Lock()
        self._per_peer: dict[Peer, int] = {}
        # Streams per uid of the unprivileged peers that hold any.
        self._per_uid: dict[int, int] = {}
        self._total = 0
        self._refused = 0
        self._timeouts = 0
        self._refusals_unlogged = 0
        self._refusal_logged_at = -_REFUSAL_LOG_PERIOD_S

    def admit(self, peer: Peer, rpc: str) -> Ticket:
        """Counts a stream of ``peer``, or refuses it.

        Raises:
            ResourceExhausted: the peer's cap or the socket's total is reached;
                the message names the cap and its config field.
        """
        with self._lock:
            held = self._per_peer.get(peer, 0)
            refusal = self._refusal(peer, rpc, held)
            unlogged = -1  # -1: do not log this one
            if refusal is not None:
                self._refused += 1
                now = time.monotonic()
                if now - self._refusal_logged_at >= _REFUSAL_LOG_PERIOD_S:
                    unlogged, self._refusals_unlogged, self._refusal_logged_at = self._refusals_unlogged, 0, now
                else:
                    self._refusals_unlogged += 1
            else:
                self._per_peer[peer] = held + 1
                if peer.uid is not None and self._uid_capped(peer):
                    self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1
                self._total += 1
        if refusal is not None:
            if unlogged >= 0:
                log.warning("%s (and %d refusal(s) not logged since the last)", refusal, unlogged)
            raise ResourceExhausted(refusal)
        return Ticket(self, peer)

    def _uid_capped(self, peer: Peer) -> bool:
        """Whether ``peer``'s streams count against its uid's cap."""
        return self.per_peer and peer.uid is not None and not privileged(peer)

    def _refusal(self, peer: Peer, rpc: str, held: int) -> str | None:
        cfg = self.config
        who = f"{rpc} stream of {peer.key} on the {self.socket_name}"
        anonymous = peer.pid is None
        if self.per_peer and anonymous and held >= cfg.max_streams_anonymous:
            return (f"{who}: callers without a peer token hold {held} client streams together, the limit is "
                    f"{cfg.max_streams_anonymous} (max_streams_anonymous); use hwr_client (it sends a token from "
                    "the credentials handshake) or raise max_streams_anonymous in the daemon config")
        if self.per_peer and not anonymous and held >= cfg.max_streams_per_peer:
            return (f"{who}: this process holds {held} client streams, the limit is {cfg.max_streams_per_peer} "
                    "per process (max_streams_per_peer); close idle clients or raise max_streams_per_peer in the "
                    "daemon config")
        uid = peer.uid
        if uid is not None and self._uid_capped(peer) and self._per_uid.get(uid, 0) >= self.uid_cap:
            return (f"{who}: the processes of uid {uid} hold {self._per_uid[uid]} client streams "
                    f"together, the limit is {self.uid_cap} per uid (max_streams_per_uid; 0 = half of the "
                    f"{self.capacity} streams of this socket), so other users' workers find a place; close idle "
                    "clients or raise max_streams_per_uid in the daemon config")
        if self._total >= self.capacity:
            return (f"{who}: {self._total} client streams are open, the limit is {self.capacity} "
                    f"(grpc_threads={cfg.grpc_threads} less {unary_reserve(cfg)} threads kept for unary calls); "
                    "retry later, or raise grpc_threads in the daemon config")
        return None

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket._released:
                return
            ticket._released = True
            self._total -= 1
            peer = ticket._peer
            left = self._per_peer[peer] - 1
            if left:
                self._per_peer[peer] = left
            else:
                del self._per_peer[peer]  # the table holds only peers with streams
            uid = peer.uid
            if uid is not None and self._uid_capped(peer):
                n = self._per_uid[uid] - 1
                if n:
                    self._per_uid[uid] = n
                else:
                    del self._per_uid[uid]

    @contextlib.contextmanager
    def admitted(self, peer: Peer, rpc: str, context: grpc.ServicerContext) -> Iterator[None]:
        """:meth:`admit` for the life of one rpc: released when the handler
        exits or the rpc terminates, whichever comes first (a handler
        generator that is never closed must not keep its place forever)."""
        ticket = self.admit(peer, rpc)
        try:
            if not context.add_callback(ticket.release):
                ticket.release()  # already terminated
            yield
        finally:
            ticket.release()

    def first_message_deadline(self, requests: Iterator[Any], context: grpc.ServicerContext, peer: Peer,
                               rpc: str) -> Iterator[Any]:
        """``requests``, with the stream cancelled if its first message does
        not arrive within ``stream_first_message_timeout_s``."""
        timeout = float(self.config.stream_first_message_timeout_s)

        def expire() -> None:
            with self._lock:
                self._timeouts += 1
            log.warning("%s stream of %s on the %s: no first message within %.1f s "
                        "(stream_first_message_timeout_s); ended", rpc, peer.key, self.socket_name, timeout)
            # Wakes the handler thread blocked on the first read: the
            # request iterator raises, the handler exits, its thread is free.
            context.cancel()

        timer = self._deadlines.arm(timeout, expire)
        return _disarm_after_first(requests, self._deadlines, timer)

    def stats(self) -> dict[str, float]:
        """Stream gauges and counters for GetStats and Prometheus."""
        with self._lock:
            return {
                "hwr_streams_active": float(self._total),
                "hwr_streams_capacity": float(self.capacity),
                "hwr_streams_refused_total": float(self._refused),
                "hwr_streams_first_message_timeouts_total": float(self._timeouts),
            }


def _disarm_after_first(requests: Iterator[Any], deadlines: Deadlines, timer: _Timer) -> Iterator[Any]:
    try:
        first = next(requests)
    except StopIteration:
        return
    finally:
        deadlines.disarm(timer)  # the first message came, or the stream ended
    yield first
    yield from requests
