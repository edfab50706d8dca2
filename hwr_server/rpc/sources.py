"""gRPC handlers of the source-digest cache: ResolveSources (runtime),
ListSources and ForgetSource (admin).

Each handler validates the request, calls :class:`hwr_server.sources.cache.SourceCache`
and builds the reply; errors are :mod:`hwr_client.core.errors` classes that the
servicer translates in one place. Hashing blocks a gRPC worker thread (never
an event loop): the handler waits on the cache's hashing pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.digests import check_path_text
from hwr_client.core.errors import HwrError, InvalidArgument, ResourceExhausted
from hwr_server.access.peers import peer_of
from hwr_server.access.views import Viewer, viewer_of
from hwr_server.sources.cache import FileState, SourceRecordRow
from hwr_server.sources.access import Seen

if TYPE_CHECKING:
    from hwr_server.components import Components


def resolve(c: Components, request: pb.ResolveSourcesRequest, context: grpc.ServicerContext) -> pb.ResolveSourcesReply:
    """ResolveSources: one SourceDigest per requested path, in order, for
    the calling peer (what it may read itself; see hwr_server.sources.cache).

    Every path is validated here, before any file is looked at.

    Raises:
        InvalidArgument: no paths; a path with a NUL byte or of PATH_MAX
            bytes or more (naming its index); a relative path; ``seen``
            neither empty nor one per path.
        ResourceExhausted: more than ``max_resolve_paths`` paths.
        PermissionDenied, NotFound, FailedPrecondition: see SourceCache.resolve.
    """
    paths = list(request.paths)
    if not paths:
        raise InvalidArgument("ResolveSources: expected at least one path")
    limit = c.sources.config.max_resolve_paths
    if len(paths) > limit:
        raise ResourceExhausted(
            f"ResolveSources: {len(paths)} paths in one call; the limit is {limit} (max_resolve_paths in the "
            "daemon config); send them in smaller batches"
        )
    for i, p in enumerate(paths):
        check_path_text(p, f"ResolveSources: paths[{i}]")
    if request.seen and len(request.seen) != len(paths):
        raise InvalidArgument(f"ResolveSources: {len(request.seen)} seen entries for {len(paths)} paths; expected "
                              "none or one per path")
    seen = [seen_of(v) for v in request.seen] if request.seen else None
    digests = c.sources.resolve(paths, peer=peer_of(context), seen=seen)
    return pb.ResolveSourcesReply(
        sources=[
            pb.SourceDigest(path=d.path, content_id=d.content_id, size=d.size, cached=d.cached, origin=d.origin)
            for d in digests
        ]
    )


def seen_of(msg: pb.FileIdentity) -> Seen:
    """The file a caller sees, from its wire form."""
    return Seen(msg.dev, msg.ino, msg.size, msg.mtime_ns)


def list_records(c: Components, request: pb.ListSourcesRequest, context: grpc.ServicerContext, *,
                 admin: bool) -> pb.ListSourcesReply:
    """ListSources: every valid cache record, sorted by path; on the runtime
    socket only those of files the caller could read itself
    (:mod:`hwr_server.access.views`).

    Raises:
        Unavailable: the cache database cannot be read now.
    """
    viewer = viewer_of(context, admin=admin)
    records = [r for r in c.sources.list_records() if _shown(c, viewer, r)]
    return pb.ListSourcesReply(
        records=[
            pb.SourceRecord(
                path=r.path, content_id=r.content_id, size=r.state.size, mtime_ns=r.state.mtime_ns,
                recorded_unix=r.recorded_unix,
            )
            for r in records
        ]
    )


def _shown(c: Components, viewer: Viewer, record: SourceRecordRow) -> bool:
    """Whether ``viewer`` may see ``record``: it sees everything, or
    ResolveSources would answer it for this very file now."""
    if viewer.everything:
        return True
    try:
        _, st, real = c.sources.access.check(record.path, viewer.peer)
    except HwrError:
        return False  # refused, missing or moved: nothing about it is shown
    return FileState.of(st, real) == record.state


def forget(c: Components, request: pb.ForgetSourceRequest, context: grpc.ServicerContext) -> pb.ForgetSourceReply:
    """ForgetSource (admin socket only): drops one path's record.

    Raises:
        InvalidArgument: an empty or relative path.
        Unavailable: the cache database cannot be written now.
    """
    if not request.path:
        raise InvalidArgument("ForgetSource: expected a path")
    check_path_text(request.path, "ForgetSource: path")
    return pb.ForgetSourceReply(forgotten=c.sources.forget(request.path))
