"""gRPC handlers of the store: Publish, Lookup, ReportCorruption (runtime) and
ListArtifacts, InspectArtifact, VerifyArtifact, DeleteArtifact (admin).

Each handler parses the request, calls the store or a publication, and builds
the reply; errors are :mod:`hwr_client.core.errors` classes that the servicer
translates to status codes.
"""

from __future__ import annotations

import dataclasses

import logging
from typing import TYPE_CHECKING, Iterator

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from hwr_client.core.identity import check_key
from hwr_server.access.peers import peer_of
from hwr_server.access.views import Viewer, viewer_of
from hwr_server.logtext import untrusted
from hwr_server.publish.limits import RequestPump
from hwr_server.publish.publication import Publication
from hwr_server.rpc.leases import lease_info_pb, trusted_publisher
from hwr_server.store.records import ArtifactSummary, summary_of

if TYPE_CHECKING:
    from hwr_server.components import Components

log = logging.getLogger(__name__)


# -- runtime ------------------------------------------------------------------


def publish(c: Components, requests: Iterator[pb.PublishRequest], context: grpc.ServicerContext) -> Iterator[pb.PublishEvent]:
    """Publish: plan → accepted → chunks (or, on the handoff transport,
    `written` per staging file) → commit → committed.

    After the plan, each message must arrive within
    ``config.publication_idle_s``, and the payload must come at
    ``config.publication_min_bytes_per_s`` (chunk bytes; on the handoff
    transport the bytes `written` reports, :meth:`Publication.reported_bytes`),
    or the publication ends ABORTED.

    Raises:
        InvalidArgument: no plan first, bad plan, bad chunk, stream ended early.
        Aborted: idle past the deadline; see also Publication.
        ResourceExhausted / FailedPrecondition: see Publication.
    """
    store = c.store
    first = next(requests, None)
    if first is None or first.WhichOneof("kind") != "plan":
        raise InvalidArgument("publish: the first message must be a plan")
    pub = Publication.begin(store, first.plan, peer=peer_of(context), is_active=context.is_active, handoff=c.handoff)
    pump = RequestPump(requests, idle_s=float(store.config.publication_idle_s), what=f"publication {pub.pub_id}",
                       min_bytes_per_s=float(store.config.publication_min_bytes_per_s), size_of=pub.reported_bytes)
    try:
        yield pb.PublishEvent(accepted=pub.accepted())
        while (req := pump.next()) is not None:
            kind = req.WhichOneof("kind")
            if kind == "chunk":
                chunk = req.chunk
                pub.write(chunk.file_index, chunk.offset, chunk.data)
            elif kind == "written":
                pub.written(req.written.file_index, req.written.data_bytes, req.written.complete)
            elif kind == "commit":
                done = pub.commit()
                if not done.already_published:
                    c.remote.push_after_publish(done.key)
                yield pb.PublishEvent(
                    committed=pb.PublishCommitted(
                        key=done.key, manifest_json=done.manifest_json, bytes_written=done.bytes_written,
                        already_published=done.already_published,
                    )
                )
                return
            else:
                raise InvalidArgument(f"publish {pub.pub_id}: unexpected {kind or 'empty'} message after the plan")
        raise InvalidArgument(f"publish {pub.pub_id}: the stream ended without a commit; nothing was published")
    finally:
        # Runs on success, error, idle deadline, client cancel and generator
        # close: staging, slots and reservation never outlive the call.
        pump.close()
        pub.close()


def lookup(c: Components, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupReply:
    """The stored manifest of a published key whose publisher the caller
    trusts (NotFound / FailedPrecondition / UntrustedPublisher otherwise)."""
    key = check_key(request.key)
    publisher = trusted_publisher(c, key, context)
    return pb.LookupReply(manifest_json=c.store.manifest_json(key), publisher=publisher.to_proto())


def report_corruption(c: Components, request: pb.ReportCorruptionRequest, context: grpc.ServicerContext
                      ) -> pb.ReportCorruptionReply:
    """Re-verifies on the daemon's own; quarantines only if it agrees.

    Any runtime client may call this, so the re-hash is throttled per key
    (:class:`hwr_server.store.scrub.ReportedVerify`): concurrent reports share one
    verification, and one that ended less than ``report_verify_interval_s``
    ago answers for it.
    """
    key = check_key(request.key)
    log.warning("client reports corruption of %s: %s", key[:12], untrusted(request.detail[:200]))
    outcome = c.store.reports.report(key)
    return pb.ReportCorruptionReply(quarantined=outcome.quarantined, problems=list(outcome.problems))


# -- admin --------------------------------------------------------------------


def _summary_proto(c: Components, s: ArtifactSummary, viewer: Viewer) -> pb.ArtifactSummary:
    count, last, publisher = 0, 0, None
    if s.state == "published":
        count = sum(1 for h in c.leases.holders(s.key) if viewer.sees_process(h.pid))
        last = int(c.leases.last_leased(s.key)) if viewer.everything else 0
        pub = c.store.publisher(s.key)
        if pub is not None and not viewer.everything and pub.uid != viewer.peer.uid:
            # Another user's process is theirs to know; the uid stays (it is
            # what the trust rule decides by).
            pub = dataclasses.replace(pub, pid=None, program="")
        publisher = pub.to_proto() if pub is not None else None
    return pb.ArtifactSummary(
        key=s.key, state=s.state, contract_name=s.contract_name, contract_version=s.contract_version,
        producer_id=s.producer_id, producer_version=s.producer_version, size_bytes=s.size_bytes,
        file_count=s.file_count, tensor_count=s.tensor_count, block_count=s.block_count, created_unix=s.created_unix,
        lease_count=count, last_leased_unix=last, reason=s.reason, publisher=publisher,
    )


def list_artifacts(c: Components, request: pb.ListArtifactsRequest, context: grpc.ServicerContext, *,
                   admin: bool) -> pb.ListArtifactsReply:
    """Every published and quarantined artifact, with its lease figures (on
    the runtime socket, the caller's own: :mod:`hwr_server.access.views`)."""
    viewer = viewer_of(context, admin=admin)
    return pb.ListArtifactsReply(artifacts=[_summary_proto(c, s, viewer) for s in c.store.summaries()])


def inspect(c: Components, request: pb.InspectArtifactRequest, context: grpc.ServicerContext, *,
            admin: bool) -> pb.InspectArtifactReply:
    """Summary, stored manifest and lease holders of one artifact (published
    or quarantined); on the runtime socket only the caller's own holders."""
    viewer = viewer_of(context, admin=admin)
    store = c.store
    key = check_key(request.key)
    q = store.quarantined(key)
    if store.contains(key) or q is None:
        manifest, _ = store.get(key)  # NotFound when neither published nor quarantined
        return pb.InspectArtifactReply(
            summary=_summary_proto(c, summary_of(manifest), viewer), manifest_json=store.manifest_json(key),
            leases=[lease_info_pb(h) for h in c.leases.holders(key) if viewer.sees_process(h.pid)],
        )
    return pb.InspectArtifactReply(summary=_summary_proto(c, q, viewer), manifest_json="")


def verify(c: Components, request: pb.VerifyArtifactRequest, context: grpc.ServicerContext) -> pb.VerifyArtifactReply:
    """Deep verification of one key or all; corrupt artifacts are quarantined
    and the call answers DATA_LOSS listing every problem.

    Raises:
        InvalidArgument: neither a key nor all. DataLoss: corruption found.
    """
    store = c.store
    if request.all == bool(request.key):
        raise InvalidArgument("verify: give exactly one of a key or all=true")
    keys = store.keys() if request.all else [check_key(request.key)]
    results: list[pb.VerifyResult] = []
    problems: list[str] = []
    for key in keys:
        try:
            r = store.verify(key)
        except NotFound:
            if request.all:
                continue  # deleted while we verified the others
            raise
        quarantined = False
        if not r.ok:
            store.quarantine(key, "verify-failed", bad_blobs=r.bad_blobs)
            quarantined = True
            problems.extend(r.problems)
        results.append(pb.VerifyResult(key=key, ok=r.ok, problems=list(r.problems), quarantined=quarantined,
                                       bytes_checked=r.bytes_checked))
    if problems:
        bad = [r.key[:12] for r in results if not r.ok]
        raise DataLoss(f"verify: {len(bad)} corrupt artifact(s) quarantined ({', '.join(bad)}): " + "; ".join(problems))
    return pb.VerifyArtifactReply(results=results)


def delete(c: Components, request: pb.DeleteArtifactRequest, context: grpc.ServicerContext) -> pb.DeleteArtifactReply:
    """Deletes an artifact unless leased (or force).

    Raises:
        NotFound: unknown key. FailedPrecondition: leased and not force.
    """
    store = c.store
    key = check_key(request.key)
    # The guard (the store's lock) spans the holder check AND the delete. A
    # lease grant reads the artifact under the same lock (store.get) before
    # it records the lease, so a grant either recorded its lease before our
    # check (we see the holder and refuse) or reads the artifact after the
    # delete (NotFound). Without it, a grant could read the artifact, record
    # its lease and hand out the blob paths between our check and the
    # unlink: a lease on a deleted artifact. Lock order: store, then leases
    # (holders() takes the lease manager's lock inside ours; the lease
    # manager never calls the store under its own).
    with store.delete_guard():
        if not request.force:
            holders = c.leases.holders(key)
            if holders:
                names = ", ".join(f"pid {h.pid} since {h.acquired_unix}" for h in holders)
                raise FailedPrecondition(
                    f"artifact {key[:12]}: leased by {names}; stop those workers or use `hwr rm --force`"
                )
        freed = store.delete(key)
    return pb.DeleteArtifactReply(bytes_freed=freed)
