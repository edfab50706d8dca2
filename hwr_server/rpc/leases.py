"""Lease rpcs: Session, AcquireLease, ReleaseLease (runtime) and ListLeases
(admin). Thin: parse, call :class:`hwr_server.leases.manager.LeaseManager`, build the
reply. Errors are raised as :mod:`hwr_client.core.errors` classes; the servicer
turns them into statuses.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterator

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.digests import check_label_text
from hwr_client.core.errors import InvalidArgument, NotFound
from hwr_server.access.peers import peer_of
from hwr_server.access.publisher import Publisher
from hwr_server.access.views import viewer_of
from hwr_server.leases.manager import LeaseInfo

if TYPE_CHECKING:
    from hwr_server.components import Components

log = logging.getLogger(__name__)


def session(c: Components, requests: Iterator[pb.SessionRequest], context: grpc.ServicerContext
            ) -> Iterator[pb.SessionEvent]:
    """The session stream: SessionOpen first, then keepalives.

    The session (and every lease bound to it) ends when the stream ends for
    any reason: the client closed it, its process died (the kernel closes
    the socket, gRPC cancels the call and runs our callback), the daemon
    cancelled it after missed keepalives, or shutdown.

    Raises:
        InvalidArgument: the first message is not ``open``, or ``open`` is
            sent twice.
    """
    leases = c.leases
    first = next(requests, None)
    if first is None or first.WhichOneof("kind") != "open":
        raise InvalidArgument("session: expected SessionOpen as the first message")
    opened = first.open
    check_label_text(opened.client_name, "Session: open.client_name")
    # The kernel's pid when the peer proved it (hwr_server.access.peers): what
    # operators see in `hwr leases` and in a refused delete must not be
    # whatever the client claims. The claim is used only for anonymous peers.
    peer = peer_of(context)
    pid = opened.pid if peer.pid is None else peer.pid
    if pid != opened.pid:
        log.info("session of %s: SessionOpen claims pid %d; recorded as pid %d", peer.key, opened.pid, pid)
    grant = leases.open_session(pid, opened.client_name, list(opened.reattach_lease_ids),
                                on_expire=context.cancel)
    sid = grant.session_id
    # The callback runs when the RPC terminates for any reason, even while
    # this generator is blocked waiting for the next request; that is what
    # makes a SIGKILLed client's leases go within a second. If the call has
    # already terminated, add_callback refuses and we end the session now.
    if not context.add_callback(lambda: leases.end_session(sid, reason="stream closed")):
        leases.end_session(sid, reason="stream closed before open completed")
        return
    try:
        yield pb.SessionEvent(opened=pb.SessionOpened(
            session_id=sid,
            keepalive_interval_ms=grant.keepalive_interval_ms,
            keepalive_timeout_ms=grant.keepalive_timeout_ms,
            reattached_lease_ids=list(grant.reattached),
            lost_lease_ids=list(grant.lost),
        ))
        for req in requests:
            if req.WhichOneof("kind") != "keepalive":
                raise InvalidArgument(f"session {sid[:6]}…: SessionOpen sent twice; expected keepalives")
            if not leases.keepalive(sid):
                # The daemon ended this session (timeout): end the stream so
                # the client notices and re-opens.
                return
            yield pb.SessionEvent(keepalive_ack=pb.KeepaliveAck())
    finally:
        leases.end_session(sid, reason="stream ended")


def trusted_publisher(c: Components, key: str, context: grpc.ServicerContext) -> Publisher:
    """The publisher of ``key`` if the caller trusts it (docs/trust.md).

    Raises:
        InvalidArgument / NotFound / FailedPrecondition: as ``Store.get``.
        UntrustedPublisher: naming the publisher and the caller.
    """
    publisher = c.store.publisher(key)
    if publisher is None:
        c.store.get(key)  # raises: malformed, not published or quarantined
        raise NotFound(f"artifact {key[:12]}: removed while being looked up")
    c.trust.check(peer_of(context), key, publisher)
    return publisher


def acquire(c: Components, request: pb.AcquireLeaseRequest, context: grpc.ServicerContext) -> pb.AcquireLeaseReply:
    """Pins an artifact the caller trusts for the calling session; see
    LeaseManager.acquire."""
    if not request.session_id:
        raise InvalidArgument("AcquireLease: session_id is empty; open a session first")
    publisher = trusted_publisher(c, request.key, context)
    grant = c.leases.acquire(request.session_id, request.key)
    # Records are unique per commit: the same record after the grant means
    # the grant's manifest is the artifact whose publisher was checked
    # (not one deleted and published again in between).
    if c.store.publisher(request.key) != publisher:
        c.leases.release(request.session_id, grant.lease_id)
        raise NotFound(f"artifact {request.key[:12]}: replaced while the lease was being granted; look it up again")
    return pb.AcquireLeaseReply(lease_id=grant.lease_id, manifest_json=grant.manifest_json,
                                blob_paths=list(grant.blob_paths), publisher=publisher.to_proto())


def release(c: Components, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext) -> pb.ReleaseLeaseReply:
    """Releases a lease the session holds; anything else answers False."""
    return pb.ReleaseLeaseReply(released=c.leases.release(request.session_id, request.lease_id))


def lease_info_pb(info: LeaseInfo) -> pb.LeaseInfo:
    """The wire form of a LeaseInfo: ListLeases and InspectArtifact both use it."""
    return pb.LeaseInfo(lease_id_prefix=info.lease_id_prefix, key=info.key, pid=info.pid,
                        client_name=info.client_name, acquired_unix=info.acquired_unix, state=info.state)


def list_leases(c: Components, request: pb.ListLeasesRequest, context: grpc.ServicerContext, *,
                admin: bool) -> pb.ListLeasesReply:
    """Every lease, attached or awaiting re-attach, by acquisition time; on
    the runtime socket only the caller's own (:mod:`hwr_server.access.views`)."""
    viewer = viewer_of(context, admin=admin)
    return pb.ListLeasesReply(leases=[lease_info_pb(i) for i in c.leases.list() if viewer.sees_process(i.pid)])
