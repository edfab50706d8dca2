"""GC's pure part: reachability on graphs, plans on snapshots, and execution
order against a recording store (the store seam; the real store is exercised
in tests/server/test_gc_daemon.py)."""

from __future__ import annotations

import os
import random

import pytest

from hwr_client.core.errors import NotFound
from hwr_server.gc.collector import execute
from hwr_server.gc.plan import ArtifactRecord, DirRecord, GcItem, Snapshot, plan, reachable

MiB = 1 << 20


def test_reachable_walks_chains_and_cycles():
    refs = {"a": ["b"], "b": ["c", "a"], "c": [], "d": ["e"], "x": ["a"]}
    assert reachable(["a"], refs) == {"a", "b", "c"}
    assert reachable([], refs) == set()
    assert reachable(["d"], refs) == {"d", "e"}  # e has no entry: a leaf
    assert reachable(["x", "d"], refs) == {"x", "a", "b", "c", "d", "e"}


def test_reachable_is_pure():
    refs = {"a": ["b"], "b": []}
    roots = ["a"]
    reachable(roots, refs)
    assert refs == {"a": ["b"], "b": []} and roots == ["a"]


def _art(key: str, blobs: dict[str, int], last: int = 0, created: int = 0) -> ArtifactRecord:
    return ArtifactRecord(key, tuple(blobs.items()), last, created)


def test_plan_orders_waste_first_then_least_recently_leased():
    snap = Snapshot(
        artifacts=(_art("new", {"b1": 40 * MiB}, last=300), _art("old", {"b2": 40 * MiB}, last=100),
                   _art("never", {"b3": 40 * MiB}, last=0, created=50)),
        staging=(DirRecord("pub-1", 5 * MiB, in_flight=False), DirRecord("pub-2", 7 * MiB, in_flight=True)),
        quarantine=(DirRecord("k.bad.1", 3 * MiB),),
        taken_unix=1000,
    )
    assert snap.usage == 135 * MiB
    p = plan(snap, target_bytes=60 * MiB)
    assert [(i.kind, i.name) for i in p.items] == [
        ("staging", "pub-1"), ("quarantine", "k.bad.1"),
        ("artifact", "never"), ("blob", "b3"), ("artifact", "old"), ("blob", "b2"),
    ]
    assert p.bytes_freed == 88 * MiB and p.usage_after == 47 * MiB
    assert "never leased" in p.items[2].reason and "last leased 900 s ago" in p.items[4].reason


def test_plan_stops_at_target_and_keeps_pinned():
    snap = Snapshot(artifacts=tuple(_art(f"k{i}", {f"b{i}": 40 * MiB}, last=i) for i in range(3)))
    p = plan(snap, target_bytes=100 * MiB, pinned={"k0"})
    assert p.artifact_keys() == ["k1"] and p.usage_after == 80 * MiB
    everything = plan(snap, target_bytes=0, pinned={"k0"})
    assert everything.artifact_keys() == ["k1", "k2"] and everything.usage_after == 40 * MiB


def test_plan_keeps_blob_shared_with_surviving_artifact():
    snap = Snapshot(artifacts=(_art("a", {"shared": 30 * MiB, "only-a": 10 * MiB}, last=1),
                               _art("b", {"shared": 30 * MiB, "only-b": 10 * MiB}, last=2)))
    assert snap.usage == 50 * MiB
    p = plan(snap, target_bytes=45 * MiB)
    assert [(i.kind, i.name) for i in p.items] == [("artifact", "a"), ("blob", "only-a")]
    both = plan(snap, target_bytes=0)
    assert [(i.kind, i.name) for i in both.items] == [
        ("artifact", "a"), ("blob", "only-a"), ("artifact", "b"), ("blob", "only-b"), ("blob", "shared")]
    assert both.usage_after == 0


def test_plan_counts_deleted_mapped_as_usage_it_cannot_free():
    snap = Snapshot(artifacts=(_art("a", {"x": 10 * MiB}),), deleted_mapped_bytes=50 * MiB)
    p = plan(snap, target_bytes=20 * MiB)
    assert p.usage_before == 60 * MiB and p.usage_after == 50 * MiB and p.artifact_keys() == ["a"]


@pytest.mark.parametrize("seed", range(20))
def test_plan_matches_reachability_on_random_graphs(seed):
    rng = random.Random(seed)
    blobs = {f"b{i}": rng.randint(1, 100) for i in range(30)}
    arts = tuple(_art(f"k{i}", {b: blobs[b] for b in rng.sample(sorted(blobs), rng.randint(1, 5))},
                      last=rng.randint(0, 5)) for i in range(15))
    pinned = {a.key for a in arts if rng.random() < 0.3}
    snap = Snapshot(artifacts=arts)
    p = plan(snap, target_bytes=rng.randint(0, snap.usage), pinned=pinned)
    removed = set(p.artifact_keys())
    assert not removed & pinned
    live = reachable([a.key for a in arts if a.key not in removed], {a.key: [b for b, _ in a.blobs] for a in arts})
    freed = {i.name for i in p.items if i.kind == "blob"}
    assert freed == {b for a in arts for b, _ in a.blobs} - live
    # Stops as soon as the target is met: without the last artifact it was not.
    if removed and p.usage_after <= p.target_bytes:
        last = p.artifact_keys()[-1]
        before_last = sum(i.bytes for i in p.items if i.kind == "blob" and i.owner != last)
        assert snap.usage - before_last > p.target_bytes


class RecordingStore:
    """The store seam: records calls; blob files live under a real root."""

    def __init__(self, root: str, blobs_by_key: dict[str, list[str]]):
        self.root = root
        self.calls: list[tuple[str, str]] = []
        self.blobs_by_key = blobs_by_key
        os.makedirs(os.path.join(root, "blobs", "sha256"))
        for bl in blobs_by_key.values():
            for b in bl:
                open(os.path.join(root, "blobs", "sha256", b), "wb").close()

    def delete(self, key: str) -> int:
        if key not in self.blobs_by_key:
            raise NotFound(f"artifact {key}: not published")
        self.calls.append(("delete", key))
        mine = self.blobs_by_key.pop(key)
        others = {b for bl in self.blobs_by_key.values() for b in bl}
        for b in mine:
            if b not in others:
                os.unlink(os.path.join(self.root, "blobs", "sha256", b))
        return 0

    def remove_staging(self, name: str) -> bool:
        self.calls.append(("staging", name))
        return True  # removed (False: claimed by a publication since the snapshot)

    def remove_quarantine(self, name: str) -> None:
        self.calls.append(("quarantine", name))


def test_execute_follows_plan_order_and_rechecks_pins(tmp_path):
    store = RecordingStore(str(tmp_path), {"a": ["x", "s"], "b": ["y", "s"], "c": ["z"]})
    snap = Snapshot(artifacts=(_art("a", {"x": 1, "s": 5}, 1), _art("b", {"y": 2, "s": 5}, 2), _art("c", {"z": 3}, 3)),
                    staging=(DirRecord("st", 7),), quarantine=(DirRecord("q", 11),))
    p = plan(snap, target_bytes=0)
    checked: list[str] = []

    def is_pinned(key: str) -> bool:
        checked.append(key)
        return key == "b"  # a lease on b arrived after planning

    result = execute(p, store=store, is_pinned=is_pinned)
    assert store.calls == [("staging", "st"), ("quarantine", "q"), ("delete", "a"), ("delete", "c")]
    assert checked == ["a", "b", "c"]
    assert [(i.kind, i.name) for i in result.items] == [
        ("staging", "st"), ("quarantine", "q"), ("artifact", "a"), ("blob", "x"), ("artifact", "c"), ("blob", "z")]
    kept = {(i.kind, i.name): why for i, why in result.skipped}
    assert kept[("artifact", "b")] == "leased since planning"
    assert ("blob", "s") in kept and ("blob", "y") in kept  # b kept: its blobs stay
    assert result.bytes_freed == 7 + 11 + 1 + 3
    assert os.path.exists(tmp_path / "blobs" / "sha256" / "s")


def test_execute_treats_vanished_artifact_as_kept(tmp_path):
    store = RecordingStore(str(tmp_path), {"a": ["x"]})
    p = plan(Snapshot(artifacts=(_art("a", {"x": 1}), _art("gone", {"g": 4}))), target_bytes=0)
    result = execute(p, store=store, is_pinned=lambda k: False)
    assert [i.name for i in result.items] == ["a", "x"]
    assert any(i.name == "gone" and why.startswith("NotFound") for i, why in result.skipped)


def test_execute_holds_guard_around_check_and_delete(tmp_path):
    store = RecordingStore(str(tmp_path), {"a": ["x"]})
    events: list[str] = []

    class Guard:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    def is_pinned(key):
        events.append("check")
        return False

    execute(plan(Snapshot(artifacts=(_art("a", {"x": 1}),)), target_bytes=0), store=store, is_pinned=is_pinned,
            guard=Guard)
    assert events == ["enter", "check", "exit"] and store.calls == [("delete", "a")]


def test_gc_item_is_a_frozen_record():
    item = GcItem("blob", "x", 1, "r")
    with pytest.raises(Exception):
        item.bytes = 2  # type: ignore[misc]
