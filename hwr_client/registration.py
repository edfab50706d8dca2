"""The worker's side of registration admission (DESIGN §16).

Before pinning host memory for the device (``cudaHostRegister``), a worker
asks the node daemon, which owns the node-wide budget, the in-flight cap, the
chunk size and the watchdog (:mod:`hwr_server.registration.admission`). The transport
uses :class:`RegistrationBroker`::

    broker = RegistrationBroker(client.session())
    grant = broker.request(nbytes, label="blocks-00 [0, 4 GiB)")
    if not grant.admitted:
        ...  # stage; grant.reason says why ("budget", "watchdog", "busy", ...)
    for offset, length in grant.chunks:
        t0 = time.monotonic(); register(offset, length)  # one cudaHostRegister
        broker.chunk_done(grant, length, time.monotonic() - t0)
    ...
    broker.release(grant)  # after cudaHostUnregister

or :meth:`RegistrationBroker.register`, which does that loop and releases on
a failed chunk. Nothing here raises for a refusal or an unreachable daemon:
both answer "not admitted", and the worker stages. The admitted bytes are
bound to the session, so the daemon frees them when this process dies.

The DLO runtime gets its broker from the lease (:func:`broker_for`) and runs
the loop itself, one chunk per mapped-file range
(``dlo_runtime.transports.register_regions``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

from hwr_client.channel import DEFAULT_TIMEOUT_S
from hwr_client.channel import call as call_unary
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import HwrError
from hwr_client.session import Session

log = logging.getLogger(__name__)

#: Reason of a refusal made by this side: the daemon could not be asked.
UNREACHABLE = "daemon"
#: Reason of a registration that failed at a chunk (see register()).
FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class RegistrationGrant:
    """The daemon's answer to one request.

    Attributes:
        admitted: True: register ``chunks`` now, reporting each.
        registration_id: the daemon's id (empty when refused).
        nbytes: the bytes asked for.
        chunks: ``(offset, length)`` ranges covering ``[0, nbytes)``, each at
            most the daemon's chunk size; empty when refused.
        reason: empty when admitted; else "budget", "watchdog", "busy",
            "session", "empty", "daemon" (unreachable) or "failed" (a
            "queued" answer is asked again until admitted or refused).
        detail: the refusal in words.
        chunk_bytes: the daemon's largest chunk, bytes (0 when it was not
            reached); a caller that plans its own chunks (per mapped file)
            cuts them at most this large.
    """

    admitted: bool
    registration_id: str
    nbytes: int
    chunks: tuple[tuple[int, int], ...]
    reason: str = ""
    detail: str = ""
    chunk_bytes: int = 0


def plan_chunks(nbytes: int, chunk_bytes: int) -> tuple[tuple[int, int], ...]:
    """``[0, nbytes)`` cut into ``(offset, length)`` pieces of at most
    ``chunk_bytes`` (the last may be shorter)."""
    if chunk_bytes <= 0:
        return ((0, nbytes),) if nbytes > 0 else ()
    return tuple((o, min(chunk_bytes, nbytes - o)) for o in range(0, nbytes, chunk_bytes))


#: How long a runtime registration waits for the node's in-flight slot by
#: default (the daemon caps it at its ``registration_max_wait_s``). Seconds.
DEFAULT_WAIT_S = 120.0
#: The daemon's "queued" reason: not refused yet, ask again with the ticket.
QUEUED = "queued"
#: Longest pause between two asks of a queued request, whatever the daemon
#: says (a bound on a bad retry_after_ms). Seconds.
_MAX_RETRY_S = 2.0


class RegistrationBroker:
    """Asks the node daemon before registering; one per worker process.

    Args:
        session: this process's session (``Client.session()``); the
            admitted bytes are bound to it.
        wait_s: how long a request may wait for an in-flight slot (the
            daemon caps it at its ``registration_max_wait_s``).
    """

    def __init__(self, session: Session, *, wait_s: float = DEFAULT_WAIT_S):
        self.session = session
        self.wait_s = wait_s

    def request(self, nbytes: int, *, label: str = "", wait_s: float | None = None,
                ranges: Sequence[tuple[str, int, int]] = ()) -> RegistrationGrant:
        """Asks to register ``nbytes``; never raises for a refusal or an
        unreachable daemon (both answer ``admitted=False``).

        ``ranges``: the file pages pinned, ``(key, offset, length)`` with
        lengths summing to ``nbytes`` (see ``PinnedRange`` in the proto):
        the daemon counts pages other workers pinned already only once."""
        wait = self.wait_s if wait_s is None else wait_s
        if not self.session.usable:
            # Closed, or inherited through fork (its stream is the parent's):
            # never call on it; this process has no session to bind bytes to.
            detail = f"session on {self.session.socket} is closed or belongs to another process"
            log.info("registration of %s (%d bytes): %s; staging", label, nbytes, detail)
            return RegistrationGrant(False, "", nbytes, (), UNREACHABLE, detail)
        try:
            reply = self._ask(nbytes, label, wait, ranges)
        except HwrError as exc:
            log.info("registration of %s (%d bytes): daemon not asked (%s); staging", label, nbytes, exc)
            return RegistrationGrant(False, "", nbytes, (), UNREACHABLE, str(exc))
        if not reply.admitted:
            log.info("registration of %s (%d bytes) refused (%s): %s; staging", label, nbytes, reply.reason,
                     reply.detail)
            return RegistrationGrant(False, "", nbytes, (), reply.reason, reply.detail, int(reply.chunk_bytes))
        return RegistrationGrant(True, reply.registration_id, nbytes, plan_chunks(nbytes, int(reply.chunk_bytes)),
                                 chunk_bytes=int(reply.chunk_bytes))

    def _ask(self, nbytes: int, label: str, wait: float,
             ranges: Sequence[tuple[str, int, int]] = ()) -> pb.AdmitRegistrationReply:
        """AdmitRegistration, asked again with the ticket while the daemon
        answers "queued" and ``wait`` lasts. The daemon never holds a call
        open for the wait (it answers at once), so each ask is a short call;
        the waiting happens here, in this worker.

        Raises:
            HwrError: a call failed (the daemon is unreachable, ...).
        """
        sid = self.session.session_id()
        deadline = time.monotonic() + max(0.0, wait)
        ticket = ""
        pinned = [pb.PinnedRange(key=k, offset=o, length=n) for k, o, n in ranges]
        while True:
            left = max(0.0, deadline - time.monotonic())
            reply = call_unary(self.session.runtime.AdmitRegistration,
                               pb.AdmitRegistrationRequest(session_id=sid, nbytes=nbytes, label=label,
                                                           wait_ms=int(left * 1000), queue_ticket=ticket,
                                                           ranges=pinned),
                               timeout=DEFAULT_TIMEOUT_S)
            if reply.admitted or reply.reason != QUEUED:
                return reply
            if time.monotonic() >= deadline:
                # Our wait is over: the daemon drops the ticket when it is
                # not asked again; this worker stages.
                return pb.AdmitRegistrationReply(admitted=False, chunk_bytes=reply.chunk_bytes, reason="busy",
                                                 detail=f"still queued after {wait:g} s: {reply.detail}")
            ticket = reply.queue_ticket
            pause = min(_MAX_RETRY_S, max(0.01, reply.retry_after_ms / 1000.0), deadline - time.monotonic())
            time.sleep(max(0.0, pause))

    def chunk_done(self, grant: RegistrationGrant, nbytes: int, seconds: float) -> bool:
        """Reports one registered chunk; False when the daemon no longer
        knows the registration (or could not be told)."""
        try:
            reply = call_unary(self.session.runtime.ReportRegistrationChunk,
                               pb.ReportRegistrationChunkRequest(session_id=self.session.session_id(),
                                                                 registration_id=grant.registration_id,
                                                                 nbytes=nbytes, seconds=seconds))
        except HwrError as exc:
            log.warning("registration %s…: chunk report failed: %s", grant.registration_id[:6], exc)
            return False
        return bool(reply.known)

    def release(self, grant: RegistrationGrant, *, reason: str = "unregistered") -> bool:
        """Returns the grant's bytes to the node's budget (call after
        unregistering); False when there was nothing to release."""
        if not grant.admitted:
            return False
        try:
            reply = call_unary(self.session.runtime.ReleaseRegistration,
                               pb.ReleaseRegistrationRequest(session_id=self.session.session_id(),
                                                             registration_id=grant.registration_id, reason=reason))
        except HwrError as exc:
            # The session's end frees the bytes anyway.
            log.warning("registration %s…: release failed: %s", grant.registration_id[:6], exc)
            return False
        return bool(reply.released)

    def register(self, nbytes: int, register_chunk: Callable[[int, int], None], *,
                 unregister_chunk: Callable[[int, int], None] | None = None, label: str = "",
                 wait_s: float | None = None) -> RegistrationGrant:
        """Admission, then ``register_chunk(offset, length)`` per chunk, each
        timed and reported.

        A chunk that raises: the chunks done are undone with
        ``unregister_chunk`` (when given), the grant released, and a refused
        grant with reason "failed" returned, so the caller stages. The
        caller releases a successful grant after unregistering.
        """
        grant = self.request(nbytes, label=label, wait_s=wait_s)
        if not grant.admitted:
            return grant
        done: list[tuple[int, int]] = []
        for k, (offset, length) in enumerate(grant.chunks):
            t0 = time.monotonic()
            try:
                register_chunk(offset, length)
            except Exception as exc:  # noqa: BLE001 - any failure means: stage
                for o, n in reversed(done):
                    if unregister_chunk is not None:
                        unregister_chunk(o, n)
                why = f"chunk {k} [{offset}, {offset + length}) failed: {type(exc).__name__}: {exc}"
                self.release(grant, reason=why)
                log.warning("registration of %s: %s; staging", label, why)
                return RegistrationGrant(False, "", nbytes, (), FAILED, why, grant.chunk_bytes)
            done.append((offset, length))
            self.chunk_done(grant, length, time.monotonic() - t0)
        return grant


def broker_for(source: object, *, wait_s: float = DEFAULT_WAIT_S) -> RegistrationBroker | None:
    """The broker for the daemon session ``source`` (a lease) is bound to.

    None when ``source`` has no daemon session (a local artifact, a test
    lease, ordinary tensors): nothing on the node accounts for those
    mappings, so their registration proceeds without admission. A session
    that is closed or inherited through fork still gets a broker: its
    request fails to reach the daemon and answers "not admitted" (staging),
    rather than pinning bytes the node's budget never saw.
    """
    session = getattr(source, "session", None)
    return RegistrationBroker(session, wait_s=wait_s) if isinstance(session, Session) else None
