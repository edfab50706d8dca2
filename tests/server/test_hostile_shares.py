"""Hardening, the publication part continued: per-peer shares of slots and reserved bytes (in-process, two distinct Peer values), what a publication may evict and when, and the pending-fsync bound."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import InvalidArgument, ResourceExhausted
from hwr_client.core.plan import check_plan, to_proto
from hwr_client.tensors import build_plan, iter_payload
from hwr_server.access.peers import Peer
from hwr_server.config import ServerConfig
from hwr_server.publish.publication import Publication
from hwr_server.store.store import Store
from tests.conftest import identity
from tests.support.daemon import cleanup
from tests.support.raw_publish import held_stream, start_with

MiB = 1024 * 1024


# -- per-peer shares (in-process: two distinct peers) ----------------------


# Two processes of two users (of one user, the per-uid cap would hold B up too).
A, B = Peer(pid=101, uid=1000), Peer(pid=202, uid=2000)


def _store(tmp_path, **kw) -> Store:
    store = Store(ServerConfig(root=str(tmp_path / "root"), **kw))
    store.recover()
    return store


def _begin(store, tag, peer, tensors=None, **kw):
    plan = build_plan(identity(t=tag), tensors or {"w": torch.zeros(4)})
    return Publication.begin(store, to_proto(plan), peer=peer, **kw)


def test_a_peer_over_its_slots_waits_for_its_own(tmp_path):
    store = _store(tmp_path, max_publications=4, max_publications_per_peer=2)
    held = [_begin(store, "a1", A), _begin(store, "a2", A)]
    try:
        started, result = threading.Event(), []
        gave_up = threading.Event()

        def third():
            started.set()
            try:
                result.append(_begin(store, "a3", A, is_active=lambda: not gave_up.is_set()))
            except InvalidArgument as exc:
                result.append(exc)

        t = threading.Thread(target=third)
        t.start()
        started.wait()
        b = _begin(store, "b1", B)  # another peer is not held up by A's wait
        b.close()
        assert store.publication_peers.held(A.key)[0] == 2 and not result  # A's third still waits
        held.pop().close()  # one of A's own ends: the third proceeds
        t.join(10)
        assert isinstance(result[0], Publication) and result[0].peer == A
        held.append(result[0])
        # At its cap again: a caller that leaves while waiting gets an error, holds nothing.
        result.clear()
        started.clear()

        def fourth():
            started.set()
            try:
                result.append(_begin(store, "a4", A, is_active=lambda: not gave_up.is_set()))
            except InvalidArgument as exc:
                result.append(exc)

        t = threading.Thread(target=fourth)
        t.start()
        started.wait()
        gave_up.set()
        t.join(10)
        assert isinstance(result[0], InvalidArgument) and "max_publications_per_peer" in str(result[0])
    finally:
        for p in held:
            p.close()
    assert store.publication_peers.held(A.key) == (0, 0) and store.publication_peers.held(B.key) == (0, 0)


def test_reserved_bytes_per_peer_boundary(tmp_path):
    one = check_plan(build_plan(identity(t="r"), {"w": torch.zeros(4)})).total_bytes
    store = _store(tmp_path, max_publications=8, max_publications_per_peer=8, peer_reserved_bytes=3 * one)
    first = [_begin(store, f"a{i}", A) for i in range(3)]  # exactly the cap: accepted
    try:
        with pytest.raises(ResourceExhausted, match="peer_reserved_bytes") as exc:
            _begin(store, "a3", A)  # one byte-for-byte publication more: refused
        assert f"exceeds the per-peer limit {3 * one} bytes" in str(exc.value)
        _begin(store, "b0", B).close()  # B's share is its own
        assert store.publication_peers.held(A.key) == (3, 3 * one)
    finally:
        for p in first:
            p.close()
    assert store.publication_peers.held(A.key) == (0, 0)
    # One byte less of room: the third is refused.
    tight = _store(tmp_path / "t", max_publications=8, max_publications_per_peer=8, peer_reserved_bytes=3 * one - 1)
    two = [_begin(tight, f"a{i}", A) for i in range(2)]
    try:
        with pytest.raises(ResourceExhausted, match="peer_reserved_bytes"):
            _begin(tight, "a2", A)
    finally:
        for p in two:
            p.close()
    # A first publication may be larger than the per-peer cap (the capacity check decides).
    small = _store(tmp_path / "s", peer_reserved_bytes=1)
    _begin(small, "big", A).close()


# -- what a publication may evict, and when ------------------------------


def test_a_plan_evicts_nothing_until_its_payload_arrives(tmp_path):
    """Capacity 100 MiB holding two unleased 40 MiB artifacts: a 40 MiB plan
    that is cancelled before its first chunk deletes nothing (the landed
    daemon collected at plan); the same publication sent whole collects, and
    the log names it and its peer."""
    d = start_with(tmp_path, "evict", {"capacity": "100MiB"})
    try:
        def big(v):
            return {"blocks.0.w": torch.full((10 * MiB,), float(v))}  # 40 MiB

        with d.client() as client:
            kept = {client.publish(identity(t=f"old{v}"), big(v)).key for v in (1, 2)}
            plan = build_plan(identity(t="new"), big(3))
            release = threading.Event()
            call = held_stream(client, [pb.PublishRequest(plan=to_proto(plan))], release)
            try:
                assert next(call).WhichOneof("kind") == "accepted"  # it fits once collected
            finally:
                release.set()
                call.cancel()
            assert_staging_empty(d)
            keys = {a.key for a in client.call(client.admin.ListArtifacts, pb.ListArtifactsRequest()).artifacts}
            assert keys == kept
            assert "collecting as its payload arrives" in d.log()
            report = client.publish(identity(t="new"), big(3))
            keys = {a.key for a in client.call(client.admin.ListArtifacts, pb.ListArtifactsRequest()).artifacts}
            assert report.key in keys and not kept <= keys
        # The peer is this test process, as the credentials handshake proved it.
        peer = f"(pid {os.getpid()} (uid {os.getuid()}))"
        assert any("for publication" in line and peer in line and "gc" in line for line in d.log().splitlines())
    finally:
        cleanup(d)


def assert_staging_empty(daemon) -> None:
    deadline = time.monotonic() + 10
    while os.listdir(os.path.join(daemon.root, "staging")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.listdir(os.path.join(daemon.root, "staging")) == []


@pytest.mark.parametrize("limit", [1, 3])
def test_pending_fsyncs_boundary(tmp_path, limit):
    """Ordered mode: with the background fsync stalled, ``limit`` finished
    files are handed to it without the writer waiting; finishing file
    ``limit + 1`` waits until the oldest fsync is done (each pending fsync
    holds a descriptor). The stall is a task queued ahead of the fsyncs on
    the publication's own one-thread fsync executor."""
    from tests.support.store import make_store

    store = make_store(tmp_path)
    tensors = {f"blocks.{i}.w": torch.full((4,), float(i)) for i in range(limit + 1)}  # one file per block
    plan = build_plan(identity(t=f"fsyncs-{limit}"), tensors, file_target_bytes=1)
    checked = check_plan(plan)
    assert len(checked.layouts) == limit + 1
    pub = Publication.begin(store, to_proto(plan), max_pending_fsyncs=limit)
    gate = threading.Event()
    pub.payload._fsync_pool.submit(gate.wait, 60)  # every fsync queues behind it (message transport)
    files = [[(fi, off, bytes(d)) for off, d in iter_payload(lay, tensors, 4096)]
             for fi, lay in enumerate(checked.layouts)]

    def write(chunks) -> threading.Thread:
        t = threading.Thread(target=lambda: [pub.write(*c) for c in chunks], daemon=True)
        t.start()
        return t

    try:
        first = write([c for f in files[:limit] for c in f])
        first.join(30)
        assert not first.is_alive()  # n finished files: no wait
        last = write(files[limit])
        last.join(0.5)
        assert last.is_alive()  # n + 1: waits for the stalled fsync
        gate.set()
        last.join(30)
        assert not last.is_alive()
        assert not pub.commit().already_published
    finally:
        gate.set()
        pub.close()
