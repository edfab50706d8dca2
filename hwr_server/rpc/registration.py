"""Registration admission rpcs (runtime): AdmitRegistration,
ReportRegistrationChunk, ReleaseRegistration. Thin: parse, call
:class:`hwr_server.registration.admission.RegistrationAdmission`, build the reply. A
refusal is a reply (``admitted=false`` with a reason), never a status: the
worker then stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.digests import check_label_text
from hwr_client.core.errors import InvalidArgument
from hwr_server.access.peers import peer_of
from hwr_server.registration.accounting import PinnedRange

if TYPE_CHECKING:
    from hwr_server.components import Components


def _session_id(rpc: str, session_id: str) -> str:
    if not session_id:
        raise InvalidArgument(f"{rpc}: session_id is empty; open a session first")
    return session_id


def admit(c: Components, request: pb.AdmitRegistrationRequest, context: grpc.ServicerContext
          ) -> pb.AdmitRegistrationReply:
    """Admits or refuses a registration for the calling session."""
    sid = _session_id("AdmitRegistration", request.session_id)
    check_label_text(request.label, "AdmitRegistration: label")
    # The kernel's pid when the peer proved it (as for sessions); operators
    # see it in the per-worker figures.
    peer = peer_of(context)
    pid = peer.pid if peer.pid is not None else 0
    who = "anonymous" if peer.pid is None else f"uid {peer.uid}"
    ranges = tuple(PinnedRange(r.key, int(r.offset), int(r.length)) for r in request.ranges)
    got = c.registration.admit(sid, int(request.nbytes), pid=pid, client_name=who, label=request.label,
                               wait_s=request.wait_ms / 1000.0, ranges=ranges)
    return pb.AdmitRegistrationReply(admitted=got.admitted, registration_id=got.registration_id,
                                     chunk_bytes=got.chunk_bytes, reason=got.reason, detail=got.detail)


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
