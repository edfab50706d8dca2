"""The Collector against the real Store and LeaseManager, in process and wired
as the daemon wires them: what GC must not take from a publication that is
in flight. These are the cases an earlier ``store.busy_keys()`` pin was meant
for (that method never existed); Collector.pinned explains why leases are
the only pin needed, and these tests hold the store to that argument."""

from __future__ import annotations

import os

import pytest

from hwr_client.core.errors import Aborted
from hwr_client.core.plan import to_proto
from hwr_client.tensors import build_plan
from hwr_server import failpoints
from hwr_server.gc import collector as gc_module
from hwr_server.config import ServerConfig
from hwr_server.gc.collector import Collector
from hwr_server.leases.manager import LeaseManager
from hwr_server.publish.publication import Publication
from hwr_server.store.store import Store
from tests.conftest import identity, sample_tensors
from tests.support.store import publish_inproc


def wired(tmp_path) -> tuple[Store, LeaseManager, Collector]:
    """Store, leases and collector as hwr_server.daemon builds them."""
    cfg = ServerConfig(root=str(tmp_path / "root")).resolved()
    store = Store(cfg)
    leases = LeaseManager(cfg, store)
    gc = Collector(cfg, store, leases, fallback_hook=store.default_capacity_hook)
    store.capacity_hook = gc.capacity_hook
    store.recover()
    return store, leases, gc


def test_blobs_a_committing_publication_reuses_survive_gc(tmp_path, monkeypatch):
    """Publication B dedups every payload file against unleased artifact A;
    GC collects A between B's blob install and B's publish point. A goes, its
    blobs stay (B references them), and B commits whole."""
    store, leases, gc = wired(tmp_path)
    tensors = sample_tensors()
    a = publish_inproc(store, build_plan(identity(t="old"), tensors, file_target_bytes=1), tensors)
    blobs = [f.blob for f in store.get(a.key)[0].files]
    seen: list[tuple] = []

    def collect_mid_commit(name: str) -> None:
        # Hit just before step 3: every blob of B is installed, B is not visible.
        if name == "commit.write_manifest":
            gc_plan, result, deferred = gc.collect(target_bytes=1)
            seen.append((gc_plan, result, deferred, store.keys(),
                         [os.path.exists(store.blob_path(b)) for b in blobs]))

    monkeypatch.setattr(failpoints, "hit", collect_mid_commit)
    b_plan = build_plan(identity(t="new"), tensors, file_target_bytes=1)
    b = publish_inproc(store, b_plan, tensors)
    monkeypatch.undo()
    [(gc_plan, result, deferred, keys_then, exist_then)] = seen
    assert deferred == "" and result is not None
    assert gc_plan.artifact_keys() == [a.key] and keys_then == []  # A was collected ...
    assert all(exist_then)  # ... and none of the blobs B is committing went with it
    kept = {i.name: why for i, why in result.skipped if i.kind == "blob"}
    assert set(kept) == set(blobs) and all("still referenced" in why for why in kept.values())
    assert result.bytes_freed == 0 and not b.already_published
    assert store.keys() == [b.key] and store.verify(b.key).ok
    leases.stop()


def test_already_published_then_collected_is_aborted_and_publishes_again(tmp_path):
    """The plan answers already_published for an unleased artifact; GC takes
    it before the commit. The commit answers Aborted (nothing written) and a
    new publication of the same identity commits the artifact whole."""
    store, leases, gc = wired(tmp_path)
    tensors = sample_tensors()
    plan = build_plan(identity(t="again"), tensors)
    first = publish_inproc(store, plan, tensors)
    again = Publication.begin(store, to_proto(plan))
    try:
        assert again.already_published
        _plan, result, _deferred = gc.collect(target_bytes=1)
        assert result is not None and [i.name for i in result.items if i.kind == "artifact"] == [first.key]
        with pytest.raises(Aborted, match="publish again"):
            again.commit()
    finally:
        again.close()
    assert store.keys() == []
    redone = publish_inproc(store, plan, tensors)
    assert not redone.already_published and redone.key == first.key
    assert store.verify(first.key).ok
    leases.stop()


def test_staging_claimed_after_the_snapshot_is_kept_and_not_counted_freed(tmp_path, monkeypatch):
    """A staging leftover is planned for removal, then a publication claims
    that directory before the plan runs: ``remove_staging`` keeps it, and the
    result must list it as kept, not count its bytes as freed."""
    store, leases, gc = wired(tmp_path)
    name = "pub-claimed-late"
    os.makedirs(os.path.join(store.staging_dir, name))
    with open(os.path.join(store.staging_dir, name, "f"), "wb") as f:
        f.write(b"x" * 65536)
    real_plan = gc_module.plan

    def plan_then_claim(*args, **kwargs):
        planned = real_plan(*args, **kwargs)
        store.claim("k" * 64, name)  # what Publication.begin does for its staging dir
        return planned

    monkeypatch.setattr(gc_module, "plan", plan_then_claim)
    gc_plan, result, deferred = gc.collect()
    assert deferred == "" and result is not None
    assert [i.name for i in gc_plan.items if i.kind == "staging"] == [name]
    assert [(i.name, why) for i, why in result.skipped] == [(name, "claimed by a publication since planning")]
    assert result.bytes_freed == 0 and gc.bytes_freed_total == 0
    assert os.path.isdir(os.path.join(store.staging_dir, name))
    leases.stop()
