"""What a transfer may evict: room is made for payload bytes that arrived,
never for sizes claimed. A node at capacity 100 MiB holds three unleased
artifacts of 24 MiB (72 MiB; high watermark 90 MiB). A registry that
claims a 40 MiB layer and sends 100 bytes of it deletes none of them (the
landed daemon collected for the 40 MiB before a byte came); the same pull
served whole deletes one, just what its bytes need. A 40 MiB publication
that sends one valid 4 MiB chunk and is cancelled deletes none (the
landed daemon deleted two at that first chunk)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import Unavailable
from hwr_client.core.plan import to_proto
from hwr_client.tensors import build_plan
from tests.conftest import identity
from tests.support.hostile_pull import (  # noqa: F401 - fixtures, used by name
    MiB, REPO, hostile, node_for, pull, source,
)
from tests.support.raw_publish import chunks, held_stream


def _mib(n: int, v: float) -> dict[str, torch.Tensor]:
    return {"blocks.0.w": torch.full((n * MiB // 4,), float(v))}


def _keys(node) -> set[str]:
    with node.client() as c:
        return {a.key for a in c.call(c.admin.ListArtifacts, pb.ListArtifactsRequest()).artifacts}


def _full_node(make_daemon_fixture, tmp_path, registry: str):
    node = node_for(make_daemon_fixture, tmp_path, registry, args=("--capacity", "100MiB"),
                    extra={"layer_attempts": 2})
    with node.client() as c:
        kept = {c.publish(identity(t=f"kept{v}"), _mib(24, v)).key for v in (1, 2, 3)}
    return node, kept


def test_claimed_sizes_evict_nothing(make_daemon_fixture, tmp_path, source, hostile):
    key, config, blobs = source.artifact("claims", _mib(40, 9))
    hostile.add(REPO, config, blobs)
    node, kept = _full_node(make_daemon_fixture, tmp_path, hostile.host)
    (layer,) = blobs
    hostile.short = {layer: 100}  # every GET of the layer: 100 bytes, then the connection closes
    with pytest.raises(Unavailable, match="truncated|broke off"):
        pull(node, f"{hostile.host}/{REPO}:{key}")
    assert [h.body_bytes for h in hostile.take() if h.path.endswith(layer)] == [100, 100]  # both attempts
    assert _keys(node) == kept
    # Served whole: one unleased artifact goes, as much as the 40 MiB need.
    hostile.short = {}
    assert pull(node, f"{hostile.host}/{REPO}:{key}").key == key
    left = _keys(node)
    assert key in left and len(left & kept) == 2, left
    assert "for pull pull-" in node.log()  # the collection names the pull


def test_one_chunk_of_a_publication_evicts_only_what_it_needs(make_daemon_fixture, tmp_path, hostile):
    node, kept = _full_node(make_daemon_fixture, tmp_path, hostile.host)
    tensors = _mib(40, 7)
    plan = build_plan(identity(t="one-chunk"), tensors)
    first = chunks(plan, tensors, 4 * MiB)[0]
    assert len(first.chunk.data) == 4 * MiB
    release = threading.Event()
    with node.client() as c:
        call = held_stream(c, [pb.PublishRequest(plan=to_proto(plan)), first], release, timeout=60)
        try:
            assert next(call).WhichOneof("kind") == "accepted"
            # The chunk is written once the staging file holds its bytes.
            for _ in range(600):
                if _staged(node) >= 4 * MiB:
                    break
                time.sleep(0.05)
            assert _staged(node) >= 4 * MiB
            assert _keys(node) == kept
        finally:
            release.set()
            call.cancel()
    assert _keys(node) == kept


def _staged(node) -> int:
    total = 0
    for dirpath, _, files in os.walk(os.path.join(node.root, "staging")):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total
