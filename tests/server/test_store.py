"""The store and publication in process (no daemon): conformance with the
reference writer, zero read-back in ordered mode, recovery, verify, delete,
single flight and capacity. The same behaviours are tested against the real
daemon in test_publish*.py."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from hwr_client.local import write_artifact
from hwr_client.core.manifest import Manifest
from hwr_client.core.plan import check_plan, to_proto
from hwr_client.tensors import build_plan
from hwr_server.store import commit as commit_mod
from hwr_server import failpoints
from hwr_server.publish import streamed as streamed_mod
from hwr_server.metrics import store_stats
from hwr_server.publish.publication import Publication
from hwr_server.store.staging_io import Coverage
from hwr_server.store.store import Store
from tests.conftest import identity, sample_tensors
from tests.support.store import make_store, publish_inproc
from tests.support.store import chunks_of


def strip_created(text: str) -> dict:
    doc = json.loads(text)
    doc.pop("created_unix")
    return doc


@pytest.mark.parametrize("ordered", [True, False])
def test_inprocess_publication_matches_reference_writer(tmp_path, ordered):
    store = make_store(tmp_path)
    tensors = sample_tensors(blocks=4)
    plan = build_plan(identity(t="conf"), tensors, ordered=ordered, file_target_bytes=3000)
    done = publish_inproc(store, plan, tensors, shuffle=not ordered)
    ref, ref_paths = write_artifact(str(tmp_path / "ref"), plan, tensors)
    assert strip_created(done.manifest_json) == strip_created(ref.to_json())
    _, paths = store.get(done.key)
    assert len(paths) == len(ref_paths) > 2
    for mine, theirs in zip(paths, ref_paths):
        assert open(mine, "rb").read() == open(theirs, "rb").read()
        assert os.stat(mine).st_mode & 0o777 == 0o444
    assert os.stat(os.path.join(store.artifact_dir(done.key), "manifest.json")).st_mode & 0o777 == 0o444
    assert os.listdir(store.staging_dir) == []


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_ordered_mode_reads_no_payload_back(tmp_path, monkeypatch):
    store = make_store(tmp_path)
    import torch

    tensors = {f"blocks.{i}.w": torch.full((1024, 1024), float(i)) for i in range(8)}  # 32 MiB
    plan = build_plan(identity(t="noread"), tensors, file_target_bytes=8 << 20)
    calls = []
    monkeypatch.setattr(streamed_mod, "readback", lambda *a, **k: calls.append(a))
    chunks = chunks_of(plan, tensors, 4 << 20)
    before = _rchar()
    pub = Publication.begin(store, to_proto(plan))
    for fi, off, data in chunks:
        pub.write(fi, off, data)
    pub.commit()
    pub.close()
    read = _rchar() - before
    payload = sum(len(c[2]) for c in chunks)
    assert calls == []
    assert read < payload // 100, f"read {read} bytes during an ordered publication of {payload}"


def test_unordered_overlap_and_gap_are_refused(tmp_path):
    cov = Coverage(100)
    cov.add(10, 20, "f")
    cov.add(30, 40, "f")
    cov.add(20, 30, "f")
    with pytest.raises(InvalidArgument, match="overlaps"):
        cov.add(5, 11, "f")
    with pytest.raises(InvalidArgument, match="overlaps"):
        cov.add(39, 41, "f")
    assert cov.first_gap() == (0, 10)
    cov.add(0, 10, "f")
    cov.add(40, 100, "f")
    assert cov.first_gap() is None


def test_single_flight_and_already_published(tmp_path):
    store = make_store(tmp_path)
    tensors = sample_tensors()
    plan = build_plan(identity(t="flight"), tensors)
    first = Publication.begin(store, to_proto(plan))
    with pytest.raises(Aborted, match="in flight"):
        Publication.begin(store, to_proto(plan))
    assert len(os.listdir(store.staging_dir)) == 1  # the second wrote nothing
    first.close()
    publish_inproc(store, plan, tensors)
    again = Publication.begin(store, to_proto(plan))
    assert again.already_published and again.commit().already_published
    again.close()
    assert store_stats(store.figures())['hwr_publications_total{outcome="conflict"}'] == 1


def test_already_published_then_collected_before_commit_is_aborted(tmp_path):
    """GC may remove an unleased artifact between the plan's
    already_published answer and the commit: the publisher gets a retryable
    Aborted (it wrote nothing), never an internal error."""
    store = make_store(tmp_path)
    tensors = sample_tensors()
    plan = build_plan(identity(t="raced"), tensors)
    publish_inproc(store, plan, tensors)
    again = Publication.begin(store, to_proto(plan))
    assert again.already_published
    store.delete(plan.identity.key)
    with pytest.raises(Aborted, match="publish again"):
        again.commit()
    again.close()
    with pytest.raises(NotFound):
        store.manifest_json(plan.identity.key)


def test_capacity_hook_refuses_before_staging(tmp_path):
    store = make_store(tmp_path, capacity=1000)
    plan = build_plan(identity(t="cap"), sample_tensors())
    with pytest.raises(ResourceExhausted, match="capacity"):
        Publication.begin(store, to_proto(plan))
    assert os.listdir(store.staging_dir) == []


def test_nonzero_padding_is_refused(tmp_path):
    store = make_store(tmp_path)
    tensors = sample_tensors()
    plan = build_plan(identity(t="pad"), tensors)
    checked = check_plan(plan)
    fi = next(i for i, lay in enumerate(checked.layouts) if lay.padding_ranges())
    begin, _ = checked.layouts[fi].padding_ranges()[0]
    pub = Publication.begin(store, to_proto(plan))
    with pytest.raises(InvalidArgument, match="padding"):
        for f, off, data in chunks_of(plan, tensors, 1 << 20):
            if f == fi and off == begin:
                data = b"\x01" * len(data)
            pub.write(f, off, data)
        pub.commit()
    pub.close()
    assert os.listdir(store.staging_dir) == [] and store.keys() == []


def test_verify_reports_every_mismatch_and_delete_keeps_shared_blobs(tmp_path):
    store = make_store(tmp_path)
    tensors = sample_tensors(blocks=2)
    a = publish_inproc(store, build_plan(identity(t="a"), tensors, file_target_bytes=1), tensors)
    b = publish_inproc(store, build_plan(identity(t="b"), tensors, file_target_bytes=1), tensors)
    manifest, paths = store.get(a.key)
    assert store.get(b.key)[1] == paths  # identical files are stored once
    t0, t1 = manifest.tensor("blocks.0.norm.weight"), manifest.tensor("blocks.1.norm.weight")
    for t in (t0, t1):
        path = paths[t.file]
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.seek(t.offset)
            byte = f.read(1)
            f.seek(t.offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    result = store.verify(a.key)
    assert not result.ok
    text = "\n".join(result.problems)
    assert "'blocks.0.norm.weight'" in text and "'blocks.1.norm.weight'" in text
    assert "block 0" in text and "block 1" in text
    assert len(result.bad_blobs) == 2
    assert store.delete(b.key) > 0
    assert all(os.path.exists(p) for p in paths)  # still used by a
    store.quarantine(a.key, "verify failed", bad_blobs=result.bad_blobs)
    with pytest.raises(FailedPrecondition, match="quarantined"):
        store.get(a.key)
    assert os.listdir(store.blobs_dir) == []
    with pytest.raises(NotFound):
        store.delete(b.key)


def test_recovery_removes_staging_orphans_and_quarantines_bad_manifests(tmp_path):
    store = make_store(tmp_path)
    tensors = sample_tensors()
    good = publish_inproc(store, build_plan(identity(t="good"), tensors), tensors)
    bad = publish_inproc(store, build_plan(identity(t="bad"), tensors, file_target_bytes=1), tensors)
    os.makedirs(os.path.join(store.staging_dir, "leftover"))
    open(os.path.join(store.blobs_dir, "ab" * 32), "wb").close()
    mpath = os.path.join(store.artifact_dir(bad.key), "manifest.json")
    os.chmod(mpath, 0o644)
    open(mpath, "w").close()  # truncated to zero
    report = Store(store.config).recover()
    assert (report.artifacts, report.quarantined, report.staging_removed) == (1, 1, 1)
    # The planted blob and the blobs only the unreadable manifest referenced.
    assert report.orphan_blobs_removed == 1 + 3
    assert sorted(os.listdir(store.blobs_dir)) == sorted(f.blob for f in store.get(good.key)[0].files)
    fresh = Store(store.config)
    fresh.recover()
    assert fresh.keys() == [good.key]
    assert fresh.verify(good.key).ok
    with pytest.raises(FailedPrecondition):
        fresh.get(bad.key)
    assert [s.state for s in fresh.summaries() if s.key == bad.key] == ["quarantined"]
    assert Manifest.from_json(fresh.manifest_json(good.key)).key == good.key


def test_plan_declared_tensor_digest_is_checked(tmp_path):
    store = make_store(tmp_path)
    tensors = sample_tensors()
    plan = build_plan(identity(t="decl"), tensors)
    msg = to_proto(plan)
    msg.files[0].tensors[0].declared_sha256 = "0" * 64
    pub = Publication.begin(store, msg)
    try:
        for fi, off, data in chunks_of(plan, tensors):
            pub.write(fi, off, data)
        with pytest.raises(FailedPrecondition, match="declared"):
            pub.commit()
    finally:
        pub.close()
    assert store.keys() == [] and os.listdir(store.staging_dir) == [] and os.listdir(store.blobs_dir) == []
    assert isinstance(msg, pb.PublishPlan)


COMMIT_POINTS = [p.name for p in failpoints.POINTS if p.sequence == "commit"]


@pytest.mark.parametrize("step", COMMIT_POINTS)
def test_crash_at_each_commit_step_recovers_to_all_or_nothing(tmp_path, step):
    """A child process is SIGKILLed by the failpoint at a commit step (no
    cleanup runs); recovery then shows the artifact whole (from the publish
    point on) or not at all."""
    store = make_store(tmp_path)
    tensors = sample_tensors()
    plan = build_plan(identity(t=f"crash-{step}"), tensors, file_target_bytes=2000)
    pid = os.fork()
    if pid == 0:  # child: publish and die at `step`
        try:
            failpoints.arm(step)
            publish_inproc(store, plan, tensors)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert os.listdir(store.staging_dir)  # the crash left its staging behind
    fresh = Store(store.config)
    report = fresh.recover()
    assert os.listdir(fresh.staging_dir) == [] and report.staging_removed == 1
    if COMMIT_POINTS.index(step) > COMMIT_POINTS.index("commit.rename_artifact"):
        assert fresh.keys() == [plan.identity.key] and fresh.verify(plan.identity.key).ok
    else:
        assert fresh.keys() == [] and os.listdir(fresh.blobs_dir) == [] and os.listdir(fresh.artifacts_dir) == []


def test_staging_of_a_running_publication_is_in_flight_and_kept(tmp_path):
    store = make_store(tmp_path)
    pub = Publication.begin(store, to_proto(build_plan(identity(t="inflight"), sample_tensors())))
    try:
        [entry] = store.staging_entries()
        assert entry.name == pub.pub_id and entry.in_flight and entry.bytes > 0
        assert store.remove_staging(entry.name) is False and os.path.isdir(pub.staging)
    finally:
        pub.close()
    os.mkdir(os.path.join(store.staging_dir, "stale"))
    [stale] = store.staging_entries()
    assert not stale.in_flight and store.remove_staging("stale") and store.staging_entries() == []
    with pytest.raises(InvalidArgument):
        store.remove_staging("../artifacts")


def test_fsync_of_artifacts_failing_after_the_rename_keeps_the_artifact_valid(tmp_path, monkeypatch, caplog):
    """After the publish point nothing is undone: when the fsync of artifacts/
    fails, the failure is logged with the key and the artifact stays
    published, with its blobs, verifiable, also after a restart."""
    store = make_store(tmp_path)
    real = commit_mod.fsync_dir

    def failing(path):
        if path == store.artifacts_dir:
            raise OSError(errno.EIO, "Input/output error")
        real(path)

    monkeypatch.setattr(commit_mod, "fsync_dir", failing)
    tensors = sample_tensors()
    plan = build_plan(identity(t="fsync-eio"), tensors, file_target_bytes=2000)
    with caplog.at_level(logging.ERROR, logger="hwr_server.store.commit"):
        done = publish_inproc(store, plan, tensors)  # close() ran: the claim is released
    assert not done.already_published
    assert any(plan.identity.key in r.getMessage() and "fsync of artifacts/" in r.getMessage() for r in caplog.records)
    manifest, paths = store.get(done.key)
    assert all(os.path.exists(p) for p in paths) and store.verify(done.key).ok
    fresh = Store(store.config)
    fresh.recover()
    assert fresh.keys() == [done.key] and fresh.verify(done.key).ok


def test_recovery_removes_an_empty_quarantine_entry_and_keeps_real_ones(tmp_path):
    """A quarantine killed between creating its entry and the rename leaves an
    empty directory; recovery removes it (and only it)."""
    store = make_store(tmp_path)
    tensors = sample_tensors()
    done = publish_inproc(store, build_plan(identity(t="q-real"), tensors), tensors)
    real = store.quarantine(done.key, "test")
    os.mkdir(os.path.join(store.quarantine_dir, f"{'cd' * 32}.interrupted.1"))
    fresh = Store(store.config)
    fresh.recover()
    assert os.listdir(fresh.quarantine_dir) == [real]
    assert [(s.key, s.state) for s in fresh.summaries()] == [(done.key, "quarantined")]


def test_reference_writer_temp_names_are_unique_per_attempt(tmp_path, monkeypatch):
    """Two write_artifact calls in one process into one directory, the second
    running while the first is mid-file: each writes its own temp file (a
    per-process name made the second move the first one's file away)."""
    from hwr_client import local

    directory = str(tmp_path / "ref")
    tensors_a, tensors_b = sample_tensors(seed=1), sample_tensors(seed=2)
    plan_a = build_plan(identity(t="ref-a"), tensors_a, file_target_bytes=1)
    plan_b = build_plan(identity(t="ref-b"), tensors_b, file_target_bytes=1)
    real_iter = local.iter_payload
    nested: list = []

    def iter_payload(lay, tensors, chunk):
        for i, item in enumerate(real_iter(lay, tensors, chunk)):
            if tensors is tensors_a and i == 0 and not nested:
                nested.append(local.write_artifact(directory, plan_b, tensors_b))
            yield item

    monkeypatch.setattr(local, "iter_payload", iter_payload)
    manifest_a, paths_a = local.write_artifact(directory, plan_a, tensors_a)
    manifest_b, paths_b = nested[0]
    for manifest, paths in ((manifest_a, paths_a), (manifest_b, paths_b)):
        for f, path in zip(manifest.files, paths):
            with open(path, "rb") as fh:
                assert hashlib.sha256(fh.read()).hexdigest() == f.blob
    assert not [n for n in os.listdir(directory) if n.startswith(".tmp-")]


def test_recovery_quarantines_entries_that_are_not_artifacts(tmp_path):
    """A stray file or a directory with a non-key name under artifacts/ goes
    to quarantine through the same sequence, each into its own entry."""
    store = make_store(tmp_path)
    open(os.path.join(store.artifacts_dir, "notes.txt"), "w").close()
    os.mkdir(os.path.join(store.artifacts_dir, "not-a-key"))
    report = Store(store.config).recover()
    assert report.quarantined == 2 and os.listdir(store.artifacts_dir) == []
    entries = sorted(os.listdir(store.quarantine_dir))
    assert [e.split(".")[:2] for e in entries] == [["not-a-key", "unknown-entry"], ["notes_txt", "unknown-entry"]]
    assert all(os.path.lexists(os.path.join(store.quarantine_dir, e, "artifact")) for e in entries)
