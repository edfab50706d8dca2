"""GetStats: one JSON object merging the ``stats()`` of every daemon
component that has one (names mirror the Prometheus metrics)."""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc

from hwr_client.core._proto import hwr_pb2 as pb

log = logging.getLogger(__name__)

#: Daemon attributes whose ``stats()`` are merged, in this order.
COMPONENTS = ("store", "leases", "sources", "gc", "scrub", "metrics")


def collect(daemon: Any) -> dict[str, float]:
    """Merged figures of every component (a failing component is logged and
    skipped so one broken figure does not hide the others)."""
    out: dict[str, float] = {}
    sources = [(name, getattr(daemon, name, None)) for name in COMPONENTS] + [("daemon", daemon)]
    for name, component in sources:
        fn = getattr(component, "stats", None)
        if component is None or not callable(fn):
            continue
        try:
            out.update({str(k): float(v) for k, v in fn().items()})
        except Exception:  # noqa: BLE001 - stats are best effort per component
            log.exception("stats of %s failed", name)
    return out


def get_stats(daemon: Any, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsReply:
    return pb.GetStatsReply(stats_json=json.dumps(collect(daemon), sort_keys=True))
