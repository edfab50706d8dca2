"""Handler of the CollectGarbage rpc (admin socket only; the servicer refuses
it on the runtime socket).

``dry_run`` answers the plan; otherwise the plan is executed and the reply
lists what was actually removed. During the post-restart lease grace period
nothing is executed and ``deferred_reason`` says why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_server.gc.plan import GcItem

if TYPE_CHECKING:
    from hwr_server.components import Components


def _item(i: GcItem) -> pb.GcItem:
    return pb.GcItem(kind=i.kind, name=i.name, bytes=i.bytes, reason=i.reason)


def collect(c: Components, request: pb.CollectGarbageRequest, context: grpc.ServicerContext
            ) -> pb.CollectGarbageReply:
    """Plans or runs one garbage collection.

    Args:
        c: the daemon's components (``c.gc`` is the Collector).
        request: ``dry_run`` and ``target_bytes`` (0 = the low watermark).
        context: the gRPC context (unused).

    Returns:
        The items in execution order, bytes freed and usage before/after.
    """
    gc_plan, result, deferred = c.gc.collect(target_bytes=int(request.target_bytes), dry_run=bool(request.dry_run))
    if result is None:
        return pb.CollectGarbageReply(
            items=[_item(i) for i in gc_plan.items], bytes_freed=gc_plan.bytes_freed, executed=False,
            usage_before=gc_plan.usage_before, usage_after=gc_plan.usage_after, deferred_reason=deferred,
        )
    return pb.CollectGarbageReply(
        items=[_item(i) for i in result.items], bytes_freed=result.bytes_freed, executed=True,
        usage_before=result.usage_before, usage_after=result.usage_after,
    )
