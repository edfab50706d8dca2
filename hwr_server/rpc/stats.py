"""GetStats: one JSON object of every component's figures (names mirror the
Prometheus metrics). The merge is :meth:`hwr_server.metrics.Metrics.gather`,
so ``hwr stats --json`` and a scrape never disagree."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc

from hwr_client.core._proto import hwr_pb2 as pb

if TYPE_CHECKING:
    from hwr_server.components import Components


def get_stats(c: Components, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsReply:
    """The merged figures as JSON, keys sorted."""
    return pb.GetStatsReply(stats_json=json.dumps(c.metrics.gather(), sort_keys=True))
