"""The client process's session with the daemon (DESIGN §7).

One session stream per process per :class:`~hwr_client.client.Client`,
opened by :meth:`hwr_client.client.Client.session` on the first acquire.
The daemon binds leases to it and releases them when the stream ends, so a
worker that exits, crashes or is SIGKILLed never leaks a lease.

* Keepalives: the stream's request generator sends one every
  ``keepalive_interval_ms`` (told by the daemon); no extra thread.
* Re-attach: a reader thread follows the stream. When the stream breaks
  while we did not close it (daemon restart), it reconnects with backoff and
  sends the ids of the leases this process still holds; the daemon re-binds
  those it kept. Leases the daemon no longer has are reported by logging
  and by ``Lease.lost``; their mapped bytes stay readable regardless.
* Fork safety: a session belongs to the process that opened it
  (``os.getpid()``); a forked child opens its own session on its own
  channel and never touches the parent's stream.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import weakref
from typing import Any, Callable, Iterator, Protocol

import grpc

from hwr_client.channel import call as call_unary
from hwr_client.channel import forget_peer_token, open_channel, quiesce
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core._proto import hwr_pb2_grpc as pb_grpc
from hwr_client.core.errors import FailedPrecondition, HwrError, Unavailable, from_rpc_error

log = logging.getLogger(__name__)

#: How long an acquire waits for a (re)connecting session. Seconds.
CONNECT_TIMEOUT_S = 10.0
#: Reconnect backoff bounds. Seconds. The cap stays well below the daemon's
#: default lease grace period (60 s) so re-attach happens in time.
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.05, 1.0
_KEEPALIVE = pb.SessionRequest(keepalive=pb.Keepalive())
_SESSION_ERROR_PREFIX = "session:"


class LossListener(Protocol):
    """What the session tells when the daemon no longer has a lease it
    tracked (:class:`hwr_client.lease.Lease` is one)."""

    def _mark_lost(self) -> None: ...


def default_client_name() -> str:
    """The program name, shown to operators as the lease holder."""
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


class Session:
    """One open session stream and the lease ids bound to it.

    Args:
        socket: runtime socket path of the daemon.
        client_name: free text shown to operators.
        connect_timeout_s: bound on opening (and waiting for a reconnect).

    Raises:
        Unavailable: the daemon did not answer the open in time.
    """

    def __init__(self, socket: str, *, client_name: str | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.pid = os.getpid()
        self.socket = socket
        self.client_name = default_client_name() if client_name is None else client_name
        self.connect_timeout_s = connect_timeout_s
        # Our own channel: the session does not depend on the Client's
        # channel, and a forked child's new session never shares the
        # parent's channel.
        self.channel = open_channel(socket)
        self.runtime = pb_grpc.RuntimeStub(self.channel)
        self._cond = threading.Condition()
        self._session_id: str | None = None
        # lease id -> weakref to its Lease (_none_ref until track() names it)
        self._held: dict[str, Callable[[], LossListener | None]] = {}
        self._closed = False
        self._call: Any = None
        self._outbox: queue.Queue | None = None
        # The threads serving the current stream: ours that reads it and
        # grpc's that pulls _requests (close() waits for both, see quiesce).
        self._threads: list[threading.Thread] = []
        self._interval_s = 1.0
        self.reconnects = 0
        try:
            self._connect([])
        except BaseException:
            self._closed = True
            self.channel.close()
            raise

    # -- stream ----------------------------------------------------------------

    def _requests(self, outbox: queue.Queue, opener: pb.SessionRequest) -> Iterator[pb.SessionRequest]:
        with self._cond:
            self._threads.append(threading.current_thread())
        yield opener
        while True:
            try:
                # The timeout IS the keepalive period: no message for one
                # interval means it is time to prove we are alive.
                item = outbox.get(timeout=self._interval_s)
            except queue.Empty:
                item = _KEEPALIVE
            if item is None:
                return  # half-close: the daemon ends the session
            yield item

    def _connect(self, reattach: list[str]) -> pb.SessionOpened:
        outbox: queue.Queue = queue.Queue()
        opener = pb.SessionRequest(open=pb.SessionOpen(pid=self.pid, client_name=self.client_name,
                                                       reattach_lease_ids=reattach))
        call = self.runtime.Session(self._requests(outbox, opener))
        first: dict[str, Any] = {}
        got = threading.Event()
        with self._cond:
            # Installed before the reader starts, so the reader can tell that
            # its stream is the current one when it breaks.
            self._call, self._outbox = call, outbox
        reader = threading.Thread(target=self._read, args=(call, first, got), name="hwr-session", daemon=True)
        with self._cond:
            # Threads of a broken earlier stream have ended or are ending.
            self._threads = [t for t in self._threads if t.is_alive()] + [reader]
        reader.start()
        # Wait for SessionOpened (or the stream's failure); bounded so that a
        # hung daemon turns into Unavailable instead of a hung worker.
        if not got.wait(self.connect_timeout_s):
            call.cancel()
            raise Unavailable(f"daemon on {self.socket}: no answer to SessionOpen within {self.connect_timeout_s} s")
        if "error" in first:
            raise first["error"]
        opened: pb.SessionOpened = first["opened"]
        with self._cond:
            if self._closed:
                call.cancel()
                raise FailedPrecondition("session: closed while connecting")
            self._interval_s = max(0.01, opened.keepalive_interval_ms / 1000.0)
            # Wakes the request generator, which was waiting with the
            # pre-open period; from now on it waits the daemon's interval.
            outbox.put(_KEEPALIVE)
            self._session_id = opened.session_id
            lost = [self._held.pop(i) for i in opened.lost_lease_ids if i in self._held]
            self._cond.notify_all()
        for ref in lost:
            lease = ref()
            if lease is not None:
                lease._mark_lost()
        if opened.lost_lease_ids:
            log.warning("session re-opened on %s: %d lease(s) lost (the daemon no longer had them): %s",
                        self.socket, len(opened.lost_lease_ids), [i[:8] for i in opened.lost_lease_ids])
        if opened.reattached_lease_ids:
            log.info("session re-opened on %s: re-attached %d lease(s)", self.socket,
                     len(opened.reattached_lease_ids))
        return opened

    def _read(self, call: Any, first: dict[str, Any], got: threading.Event) -> None:
        """Follows one stream until it ends; then reconnects unless closed."""
        try:
            for event in call:
                if not got.is_set():
                    first["opened"] = event.opened
                    got.set()
        except grpc.RpcError as err:
            if not got.is_set():
                first["error"] = from_rpc_error(err)
        if not got.is_set():
            first.setdefault("error", Unavailable(f"daemon on {self.socket}: session stream ended before open"))
            got.set()
            return
        with self._cond:
            if self._closed or self._call is not call:
                return
            self._session_id = None  # callers wait for the reconnect
        self._reconnect()

    def _reconnect(self) -> None:
        delay = _BACKOFF_MIN_S
        while True:
            with self._cond:
                if self._closed:
                    return
                reattach = list(self._held)
            # A restarted daemon may not know our peer token (a new key):
            # shake hands again, or this process would count as anonymous.
            forget_peer_token(self.socket)
            try:
                self._connect(reattach)
                self.reconnects += 1
                return
            except HwrError as exc:
                log.debug("session reconnect to %s failed (%s); retrying in %.2f s", self.socket, exc, delay)
            with self._cond:
                # Sleep that close() cuts short.
                self._cond.wait_for(lambda: self._closed, timeout=delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)

    # -- use ----------------------------------------------------------------------

    def session_id(self, *, timeout: float | None = None) -> str:
        """The current session id, waiting for a reconnect in progress.

        Raises:
            Unavailable: no session within ``timeout`` (default: the connect
                timeout).
            FailedPrecondition: the session was closed.
        """
        timeout = self.connect_timeout_s if timeout is None else timeout
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._session_id is not None, timeout=timeout)
            if self._closed:
                raise FailedPrecondition("session: closed; use a new Client")
            if self._session_id is None:
                raise Unavailable(f"daemon on {self.socket}: session not re-established within {timeout} s")
            return self._session_id

    def acquire(self, key: str) -> pb.AcquireLeaseReply:
        """AcquireLease on this session; the id is tracked for re-attach.

        Retries once when the daemon no longer knows our session (it
        restarted and the reader has not re-opened yet).
        """
        return self.granting(
            lambda sid: call_unary(self.runtime.AcquireLease, pb.AcquireLeaseRequest(session_id=sid, key=key)),
            what=f"acquire of {key[:12]}")

    def granting(self, call: Callable[[str], Any], *, what: str,
                 lease_id: Callable[[Any], str] = lambda reply: reply.lease_id) -> Any:
        """Runs ``call(session_id)``, an rpc that may grant a lease on this
        session (AcquireLease, ResolveLease), with AcquireLease's rules:
        retried when the daemon no longer knows the session (it restarted
        and the reader has not re-opened yet), and a granted id (non-empty
        ``lease_id(reply)``) tracked for re-attach.

        Returns:
            The reply.
        """
        for attempt in range(3):
            sid = self.session_id()
            try:
                reply = call(sid)
            except (FailedPrecondition, Unavailable) as exc:
                stale = isinstance(exc, Unavailable) or str(exc).startswith(_SESSION_ERROR_PREFIX)
                if attempt == 2 or not stale:
                    raise
                self._wait_replaced(sid)
                continue
            granted = lease_id(reply)
            if not granted:
                return reply
            with self._cond:
                if self._session_id == sid:
                    self._held[granted] = _none_ref
                    return reply
            # Granted on a session that has since been replaced: that grant
            # will not be re-attached (the daemon drops it after its grace
            # period); take a fresh one on the new session.
            log.info("lease %s… granted on a replaced session; acquiring again", granted[:8])
        raise Unavailable(f"daemon on {self.socket}: session kept changing during {what}")

    def _wait_replaced(self, old_sid: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._session_id not in (None, old_sid),
                                timeout=self.connect_timeout_s)

    def track(self, lease_id: str, lease: LossListener) -> None:
        """Associates a Lease object with its id so a lost lease is flagged."""
        with self._cond:
            if lease_id in self._held:
                self._held[lease_id] = weakref.ref(lease)

    def release(self, lease_id: str) -> bool:
        """ReleaseLease; False when the daemon did not hold it for us.
        Without a live session the id is just forgotten: the daemon drops it
        at the end of its grace period, as it is not re-attached."""
        with self._cond:
            if self._held.pop(lease_id, None) is None or self._closed:
                return False
            sid = self._session_id
        if sid is None:
            return False
        reply = call_unary(self.runtime.ReleaseLease, pb.ReleaseLeaseRequest(session_id=sid, lease_id=lease_id))
        return reply.released

    @property
    def held(self) -> list[str]:
        """Ids of the leases this process holds on the session (re-attached
        after a daemon restart)."""
        with self._cond:
            return list(self._held)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed session is never reopened."""
        return self._closed

    @property
    def usable(self) -> bool:
        """True while the session is open and belongs to this process; a
        session inherited through fork is not (its stream is the parent's)."""
        return not self._closed and self.pid == os.getpid()

    def close(self) -> None:
        """Ends the stream (the daemon releases every lease of this
        session) and closes the channel. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            call, outbox, threads = self._call, self._outbox, list(self._threads)
            self._cond.notify_all()
        if self.pid != os.getpid():
            return  # a forked child must never touch the parent's stream
        if outbox is not None:
            outbox.put(None)  # half-close first: an orderly end of session
        if call is not None:
            call.cancel()
        self.channel.close()
        quiesce(*threads)  # a process may exit right after close()


def _none_ref() -> None:
    return None
