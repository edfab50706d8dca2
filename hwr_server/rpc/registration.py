"""Registration admission rpcs (runtime): AdmitRegistration,
ReportRegistrationChunk, ReleaseRegistration. Thin: parse, call
:class:`hwr_server.registration.admission.RegistrationAdmission`, build the reply. A
refusal is a reply (``admitted=false`` with a reason), never a status: the
worker then stages. No handler here waits: a request that must wait for the
in-flight slot is answered "queued" with a ticket and asks again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.digests import check_label_text
from hwr_client.core.errors import InvalidArgument
from hwr_server.access.peers import peer_of, privileged
from hwr_server.registration.accounting import PinnedRange

if TYPE_CHECKING:
    from hwr_server.components import Components


def _session_id(rpc: str, session_id: str) -> str:
    if not session_id:
        raise InvalidArgument(f"{rpc}: session_id is empty; open a session first")
    return session_id


def admit(c: Components, request: pb.AdmitRegistrationRequest, context: grpc.ServicerContext
          ) -> pb.AdmitRegistrationReply:
    """Admits, queues or refuses a registration for the calling session;
    answers at once."""
    sid = _session_id("AdmitRegistration", request.session_id)
    check_label_text(request.label, "AdmitRegistration: label")
    if len(request.queue_ticket) > 64:
        raise InvalidArgument(f"AdmitRegistration: queue_ticket of {len(request.queue_ticket)} characters; expected "
                              "the ticket of an earlier answer (at most 64)")
    # The kernel's pid when the peer proved it (as for sessions); operators
    # see it in the per-worker figures. Shares are counted per uid.
    peer = peer_of(context)
    pid = peer.pid if peer.pid is not None else 0
    ranges = tuple(PinnedRange(r.key, int(r.offset), int(r.length)) for r in request.ranges)
    got = c.registration.admit(sid, int(request.nbytes), pid=pid, uid_key=peer.uid_key, privileged=privileged(peer),
                               client_name=peer.uid_key, label=request.label, wait_s=request.wait_ms / 1000.0,
                               ticket=request.queue_ticket, ranges=ranges)
    return pb.AdmitRegistrationReply(admitted=got.admitted, registration_id=got.registration_id,
                                     chunk_bytes=got.chunk_bytes, reason=got.reason, detail=got.detail,
                                     queue_ticket=got.ticket, retry_after_ms=got.retry_after_ms,
                                     queue_position=got.position)


def report_chunk(c: Components, request: pb.ReportRegistrationChunkRequest, context: grpc.ServicerContext
                 ) -> pb.ReportRegistrationChunkReply:
    """Records one registered chunk of an admitted registration."""
    sid = _session_id("ReportRegistrationChunk", request.session_id)
    known, complete = c.registration.report_chunk(sid, request.registration_id, int(request.nbytes),
                                                  float(request.seconds))
    return pb.ReportRegistrationChunkReply(known=known, complete=complete)


def release(c: Components, request: pb.ReleaseRegistrationRequest, context: grpc.ServicerContext
            ) -> pb.ReleaseRegistrationReply:
    """Returns a registration's bytes to the budget."""
    sid = _session_id("ReleaseRegistration", request.session_id)
    released = c.registration.release(sid, request.registration_id, reason=request.reason or "released")
    return pb.ReleaseRegistrationReply(released=released)
