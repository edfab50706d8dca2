"""Helpers shared by several test modules (moved from tests/server/test_gc_daemon.py)."""

from __future__ import annotations

import json

import torch

from tests.conftest import identity

MiB = 1 << 20


def publish(client, tag: str, mib: int = 40, *, seed: int | None = None, **kw):
    """Publishes a ~``mib`` MiB artifact (each block in its own file)."""
    return client.publish(identity(tag=tag), big_tensors(mib, seed if seed is not None else hash(tag) % 10_000, **kw),
                          file_target_bytes=1)


def stats(client) -> dict[str, float]:
    from hwr_client.core._proto import hwr_pb2 as pb

    return json.loads(client.call(client.reader.GetStats, pb.GetStatsRequest()).stats_json)


def keys(client) -> set[str]:
    from hwr_client.core._proto import hwr_pb2 as pb

    reply = client.call(client.reader.ListArtifacts, pb.ListArtifactsRequest())
    return {a.key for a in reply.artifacts if a.state == "published"}


def collect(c, target: int, *, dry_run: bool = False) -> dict:
    """CollectGarbage on the admin socket, in-process (fast)."""
    from hwr_client.core._proto import hwr_pb2 as pb

    r = c.call(c.admin.CollectGarbage, pb.CollectGarbageRequest(dry_run=dry_run, target_bytes=target), timeout=300)
    return {"items": [{"kind": i.kind, "name": i.name, "bytes": i.bytes, "reason": i.reason} for i in r.items],
            "bytes_freed": r.bytes_freed, "executed": r.executed, "usage_before": r.usage_before,
            "usage_after": r.usage_after, "deferred_reason": r.deferred_reason}


def big_tensors(mib: int, seed: int, *, blocks: int = 4, shared_blocks: int = 0) -> dict[str, torch.Tensor]:
    """~``mib`` MiB of random uint8 blocks (one tensor per block) plus a small
    shared embedding. The first ``shared_blocks`` blocks are identical across
    seeds, so artifacts built from them share those payload blobs."""
    out = {"embed.weight": torch.arange(256, dtype=torch.float32)}
    per = mib * MiB // blocks
    for i in range(blocks):
        g = torch.Generator().manual_seed(1_000_000 + i if i < shared_blocks else seed * 1000 + i)
        out[f"blocks.{i}.w"] = torch.randint(0, 256, (per,), dtype=torch.uint8, generator=g)
    return out
