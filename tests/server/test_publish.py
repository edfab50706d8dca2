"""Publication and the store's admin calls against the REAL daemon."""

from __future__ import annotations

import json
import os
import threading

import grpc
import pytest
import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import Aborted, DataLoss, FailedPrecondition, NotFound
from hwr_client.local import write_artifact
from hwr_client.core.plan import check_plan, to_proto
from hwr_client.tensors import build_plan
from tests.conftest import identity, sample_tensors


def strip_created(text: str) -> dict:
    doc = json.loads(text)
    doc.pop("created_unix")
    return doc


@pytest.mark.parametrize("ordered", [True, False])
def test_published_manifest_and_blobs_equal_the_reference_writer(daemon, tmp_path, ordered):
    tensors = sample_tensors(blocks=5)
    with daemon.client() as client:
        report = client.publish(identity(t="conformance"), tensors, ordered=ordered, file_target_bytes=4000)
        stored = client.call(client.runtime.Lookup, pb.LookupRequest(key=report.key)).manifest_json
    plan = build_plan(identity(t="conformance"), tensors, ordered=ordered, file_target_bytes=4000)
    ref, ref_paths = write_artifact(str(tmp_path / "ref"), plan, tensors)
    assert report.key == ref.key and not report.already_published
    assert strip_created(stored) == strip_created(ref.to_json())
    assert len(ref_paths) > 2
    for f, ref_path in zip(report.manifest.files, ref_paths):
        blob = os.path.join(daemon.root, "blobs", "sha256", f.blob)
        assert open(blob, "rb").read() == open(ref_path, "rb").read()
        assert os.stat(blob).st_mode & 0o777 == 0o444
    assert os.listdir(os.path.join(daemon.root, "staging")) == []
    # Every block's tensors are contiguous in one file and its range is in the manifest.
    for b in report.manifest.blocks:
        ts = [report.manifest.tensor(n) for n in b.tensors]
        assert {t.file for t in ts} == {b.file}
        assert b.begin == ts[0].offset and b.end == ts[-1].offset + ts[-1].nbytes


def test_publish_again_answers_already_published(daemon):
    tensors = sample_tensors()
    with daemon.client() as client:
        first = client.publish(identity(t="again"), tensors)
        second = client.publish(identity(t="again"), tensors)
    assert second.already_published and second.bytes_written == 0
    assert second.manifest == first.manifest


def test_large_tensors_are_sliced_and_small_ones_coalesced(daemon):
    tensors = {f"layers.{i}.w": torch.randn(1536, 1024) for i in range(3)}  # 6 MiB each
    tensors.update({f"tiny.{i}": torch.tensor([float(i)]) for i in range(300)})
    with daemon.client() as client:
        report = client.publish(identity(t="sizes"), tensors, blocks=[[f"layers.{i}.w"] for i in range(3)])
        assert len(report.manifest.blocks) == 3
        reply = client.call(client.admin.VerifyArtifact, pb.VerifyArtifactRequest(key=report.key))
    assert reply.results[0].ok and reply.results[0].bytes_checked == report.manifest.size_bytes


@pytest.mark.parametrize("message_bytes", [1 << 20, 4096 + 17])
def test_messages_are_full_and_cover_each_data_region_in_order(message_bytes):
    """Every message but a file's last is exactly ``message_bytes`` (one
    buffer size for the allocator to reuse), and the messages of a file,
    joined, are its data region byte for byte."""
    from hwr_client.tensors import iter_payload
    from hwr_client.publish import iter_pieces

    tensors = {f"blocks.{i}.w": torch.randn(300 + 97 * i, 33) for i in range(6)}  # odd sizes: pads and splits
    tensors.update({f"blocks.{i}.b": torch.randn(7) for i in range(6)})
    checked = check_plan(build_plan(identity(t="pieces"), tensors))
    pieces = list(iter_pieces(checked, tensors, message_bytes))
    for fi, lay in enumerate(checked.layouts):
        mine = [p for p in pieces if p.file_index == fi]
        assert all(p.nbytes == message_bytes for p in mine[:-1])
        assert 0 < mine[-1].nbytes <= message_bytes
        assert [p.offset for p in mine] == [k * message_bytes for k in range(len(mine))]
        sent = b"".join(bytes(part) for p in mine for part in p.parts)
        region = b"".join(bytes(d) for _, d in iter_payload(lay, tensors, 1 << 30))
        assert sent == region and len(sent) == lay.data_size
        for p in mine:  # and each message decodes to the same bytes
            chunk = pb.PublishRequest.FromString(p.request()).chunk
            assert (chunk.file_index, chunk.offset, chunk.data) == (fi, p.offset, b"".join(bytes(x) for x in p.parts))


def test_second_publisher_of_a_key_is_aborted_at_plan(daemon):
    tensors = sample_tensors()
    plan = build_plan(identity(t="flight"), tensors)
    with daemon.client() as client:
        hold = threading.Event()

        def holder():
            yield pb.PublishRequest(plan=to_proto(plan))
            hold.wait(60)  # keeps the first publication open

        events = client.runtime.Publish(holder())
        assert next(events).accepted.key == plan.identity.key
        staging = os.listdir(os.path.join(daemon.root, "staging"))
        with pytest.raises(Aborted, match="in flight"):
            client.publish(identity(t="flight"), tensors)
        assert os.listdir(os.path.join(daemon.root, "staging")) == staging  # the second wrote nothing
        hold.set()
        with pytest.raises(grpc.RpcError):
            next(events)  # the first ended without a commit
        report = client.publish(identity(t="flight"), tensors)
        assert not report.already_published


def test_list_inspect_verify_delete_stats(daemon):
    tensors = sample_tensors()
    with daemon.client() as client:
        a = client.publish(identity(t="a"), tensors)
        b = client.publish(identity(t="b"), tensors)
        rows = client.call(client.reader.ListArtifacts, pb.ListArtifactsRequest()).artifacts
        assert sorted(r.key for r in rows) == sorted([a.key, b.key])
        assert all(r.state == "published" and r.tensor_count == len(tensors) for r in rows)
        info = client.call(client.reader.InspectArtifact, pb.InspectArtifactRequest(key=a.key))
        assert json.loads(info.manifest_json)["key"] == a.key and info.summary.block_count == 3
        ok = client.call(client.admin.VerifyArtifact, pb.VerifyArtifactRequest(all=True))
        assert [r.ok for r in ok.results] == [True, True]
        stats = json.loads(client.call(client.reader.GetStats, pb.GetStatsRequest()).stats_json)
        assert stats['hwr_publications_total{outcome="committed"}'] == 2
        assert stats['hwr_artifacts{state="published"}'] == 2
        assert stats['hwr_store_bytes{state="published"}'] == a.manifest.size_bytes  # shared blobs count once
        freed = client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=a.key)).bytes_freed
        assert 0 < freed < a.manifest.size_bytes  # the blobs are shared with b
        with pytest.raises(NotFound):
            client.lookup(a.key)
        assert client.lookup(b.key).key == b.key


def test_delete_of_a_leased_artifact_names_the_holder_unless_forced(daemon):
    pytest.importorskip("hwr_client.lease")
    with daemon.client() as client:
        report = client.publish(identity(t="leased"), sample_tensors())
        lease = client.acquire(report.key)
        try:
            with pytest.raises(FailedPrecondition, match=f"pid {os.getpid()}"):
                client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=report.key))
            info = client.call(client.reader.InspectArtifact, pb.InspectArtifactRequest(key=report.key))
            assert [x.pid for x in info.leases] == [os.getpid()]
            reply = client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=report.key, force=True))
            assert reply.bytes_freed > 0
            # The mapped bytes stay valid after the unlink.
            assert torch.equal(lease.tensors()["embed.weight"], sample_tensors()["embed.weight"])
        finally:
            lease.close()


def test_verify_quarantines_a_corrupt_artifact_with_data_loss(daemon):
    with daemon.client() as client:
        report = client.publish(identity(t="corrupt"), sample_tensors())
        t = report.manifest.tensor("blocks.1.mlp.weight")
        path = os.path.join(daemon.root, "blobs", "sha256", report.manifest.files[t.file].blob)
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.seek(t.offset + 3)
            f.write(b"\xee")
        with pytest.raises(DataLoss) as exc:
            client.call(client.admin.VerifyArtifact, pb.VerifyArtifactRequest(key=report.key))
        assert "'blocks.1.mlp.weight'" in str(exc.value) and "block 1" in str(exc.value)
        with pytest.raises(FailedPrecondition, match="quarantined"):
            client.lookup(report.key)
        rows = client.call(client.reader.ListArtifacts, pb.ListArtifactsRequest()).artifacts
        assert [(r.key, r.state) for r in rows] == [(report.key, "quarantined")]
        # A fresh publication of the same identity replaces the quarantined one.
        again = client.publish(identity(t="corrupt"), sample_tensors())
        assert not again.already_published and client.lookup(report.key).key == report.key
        reply = client.call(client.admin.VerifyArtifact, pb.VerifyArtifactRequest(key=report.key))
        assert reply.results[0].ok


def test_report_corruption_quarantines_only_when_the_daemon_agrees(daemon):
    with daemon.client() as client:
        report = client.publish(identity(t="report"), sample_tensors())
        reply = client.call(client.runtime.ReportCorruption, pb.ReportCorruptionRequest(key=report.key, detail="x"))
        assert not reply.quarantined and client.lookup(report.key).key == report.key


def test_daemon_memory_does_not_grow_with_artifact_size(daemon):
    def hwm_kib() -> int:
        with open(f"/proc/{daemon.proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmHWM")).split()[1])

    with daemon.client() as client:
        client.publish(identity(t="warm"), {"blocks.0.w": torch.zeros(1024, 1024)})  # warm up threads/buffers
        before = hwm_kib()
        big = {f"blocks.{i}.w": torch.full((4096, 1024), float(i)) for i in range(16)}  # 256 MiB
        client.publish(identity(t="big"), big, file_target_bytes=64 << 20)
    grown_mib = (hwm_kib() - before) / 1024
    assert grown_mib < 96, f"daemon peak RSS grew by {grown_mib:.0f} MiB for a 256 MiB artifact"


def test_plan_layouts_sent_by_the_daemon_match_the_client(daemon):
    plan = build_plan(identity(t="layout"), sample_tensors())
    checked = check_plan(plan)
    with daemon.client() as client:
        events = client.runtime.Publish(iter([pb.PublishRequest(plan=to_proto(plan))]))
        accepted = next(events).accepted
        assert [(f.data_size, tuple(f.tensor_offsets)) for f in accepted.files] == [
            (lay.data_size, lay.tensor_offsets) for lay in checked.layouts
        ]
        with pytest.raises(grpc.RpcError) as exc:
            next(events)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_concurrent_publications_of_different_keys_all_commit(daemon):
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        with daemon.client() as client:
            return client.publish(identity(t="concurrent", i=i), sample_tensors(seed=i), ordered=bool(i % 2))

    with ThreadPoolExecutor(max_workers=6) as pool:
        reports = list(pool.map(one, range(6)))
    assert len({r.key for r in reports}) == 6 and not any(r.already_published for r in reports)
    with daemon.client() as client:
        reply = client.call(client.admin.VerifyArtifact, pb.VerifyArtifactRequest(all=True))
        assert len(reply.results) == 6 and all(r.ok for r in reply.results)
    assert os.listdir(os.path.join(daemon.root, "staging")) == []
