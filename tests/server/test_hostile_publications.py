"""Hardening, the publication part: limits checked at plan before
anything is built, idle publications ended, per-peer shares, few descriptors,
exact boundaries, and what a publication may evict.

Each limit is tested at its exact boundary against a REAL daemon started
with small limits in its config file: n accepted, n + 1 refused with the
status and a message naming the config field, nothing left behind. The
per-peer cases run in-process with two distinct Peer values (the daemon
cannot yet tell its peers apart: every caller is the anonymous peer).
Every wait is bounded (call timeouts of seconds); no wall-clock assertion.
"""

from __future__ import annotations

import errno
import os
import resource
import threading
import time

import grpc
import pytest
import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import InvalidArgument, NotFound, ResourceExhausted
from hwr_client.core.identity import Identity, is_key
from hwr_client.core.layout import MAX_DIM, TensorSpec
from hwr_client.core.manifest import Manifest
from hwr_client.core.plan import check_plan, planned_manifest_bytes, to_proto
from hwr_client.tensors import build_plan
from hwr_server.config import ServerConfig
from hwr_server.publish.publication import Publication
from hwr_server.store.staging_io import os_error
from hwr_server.store.store import Store
from tests.conftest import identity, sample_tensors
from tests.support.daemon import cleanup, make_daemon
from tests.support.raw_publish import COMMIT, chunks, raw_publish
from tests.support.raw_publish import StatusCode, daemon_rss_mib, held_stream
from tests.support.raw_publish import start_with

MiB = 1024 * 1024

#: The small limits of the ``limited`` daemon.
LIMITS = {
    "max_artifact_tensors": 8,
    "max_artifact_files": 3,
    "max_tensor_name_bytes": 40,
    "max_tensor_dims": 3,
    "max_chunk_bytes": 4096,
    "publication_idle_s": 1.0,
}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    d = start_with(tmp_path_factory.mktemp("limited"), "limited", LIMITS)
    yield d
    cleanup(d)


# -- helpers ---------------------------------------------------------------------


def key_of(tag: str) -> str:
    return Identity.from_dict(identity(t=tag)).key


def assert_nothing_left(daemon, key: str | None = None) -> None:
    """No staging, no artifact, no blob; the key unknown."""
    deadline = time.monotonic() + 10  # the stream's teardown runs just after the status
    while os.listdir(os.path.join(daemon.root, "staging")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.listdir(os.path.join(daemon.root, "staging")) == []
    assert os.listdir(os.path.join(daemon.root, "artifacts")) == []
    assert os.listdir(os.path.join(daemon.root, "blobs", "sha256")) == []
    if key:
        with daemon.client() as client, pytest.raises(NotFound):
            client.lookup(key)


def publish_and_remove(daemon, tag: str, tensors, **kw) -> None:
    """Publishes (must succeed), then deletes it again so the store is empty."""
    with daemon.client() as client:
        report = client.publish(identity(t=tag), tensors, **kw)
        assert client.lookup(report.key).key == report.key
        client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=report.key))


def refused(daemon, tag: str, tensors, **kw) -> Exception:
    with daemon.client() as client, pytest.raises((ResourceExhausted, InvalidArgument)) as exc:
        client.publish(identity(t=tag), tensors, **kw)
    assert_nothing_left(daemon, key_of(tag))
    return exc.value


def daemon_threads(daemon) -> int:
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def daemon_fds(daemon) -> int:
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def scalars(n: int, prefix: str = "t") -> dict[str, torch.Tensor]:
    return {f"{prefix}{i}": torch.zeros((), dtype=torch.uint8) for i in range(n)}


# -- counts checked on the wire plan, before anything is built ------------


def test_tensor_count_boundary(limited):
    publish_and_remove(limited, "tensors-8", scalars(8))
    exc = refused(limited, "tensors-9", scalars(9))
    assert isinstance(exc, ResourceExhausted)
    assert "tensors 9 exceeds the limit 8" in str(exc) and "max_artifact_tensors" in str(exc)


def test_file_count_boundary(limited):
    def files(n):
        tensors = {f"blocks.{i}.w": torch.full((4,), float(i)) for i in range(n)}
        assert len(check_plan(build_plan(identity(t="x"), tensors, file_target_bytes=1)).layouts) == n
        return tensors

    publish_and_remove(limited, "files-3", files(3), file_target_bytes=1)
    exc = refused(limited, "files-4", files(4), file_target_bytes=1)
    assert isinstance(exc, ResourceExhausted) and "files 4 exceeds the limit 3" in str(exc)
    assert "max_artifact_files" in str(exc)


@pytest.mark.parametrize("name_ok, name_bad", [("n" * 40, "n" * 41), ("é" * 20, "é" * 20 + "n")],
                         ids=["ascii", "utf8"])
def test_tensor_name_bytes_boundary(limited, name_ok, name_bad):
    assert len(name_ok.encode()) == 40 and len(name_bad.encode()) == 41
    publish_and_remove(limited, f"name-ok-{len(name_ok)}", {name_ok: torch.zeros(2)})
    exc = refused(limited, f"name-bad-{len(name_bad)}", {name_bad: torch.zeros(2)})
    assert isinstance(exc, InvalidArgument) and "max_tensor_name_bytes" in str(exc)


def test_tensor_dims_boundary(limited):
    publish_and_remove(limited, "dims-3", {"w": torch.zeros(1, 2, 3)})
    exc = refused(limited, "dims-4", {"w": torch.zeros(1, 2, 3, 1)})
    assert isinstance(exc, InvalidArgument) and "4 dimensions" in str(exc) and "max_tensor_dims" in str(exc)


def test_huge_plan_is_refused_before_it_is_built(tmp_path):
    """Default limits: 65,537 scalar tensors (a 0.9 MB plan) are refused at
    once; the landed daemon accepted them (and 1M of them took 1.7 GB and
    14 s). The daemon's memory barely moves: it never built the plan."""
    d = make_daemon(tmp_path).start()
    try:
        n = ServerConfig().max_artifact_tensors + 1
        msg = pb.PublishPlan(identity_json=Identity.from_dict(identity(t="huge")).to_json(), files=[
            pb.FilePlan(name="f", tensors=[pb.TensorPlan(name=f"t{i}", dtype="U8") for i in range(n)])])
        rss0 = daemon_rss_mib(d)
        with d.client() as client:
            code, details = raw_publish(client, [pb.PublishRequest(plan=msg), COMMIT])
        assert code == StatusCode.RESOURCE_EXHAUSTED, details
        assert f"tensors {n} exceeds the limit {n - 1}" in details and "max_artifact_tensors" in details
        # Building it would cost ~120 MiB (measured at the limit); the wire message itself a few.
        assert daemon_rss_mib(d) - rss0 < 48
        assert_nothing_left(d, key_of("huge"))
    finally:
        cleanup(d)


# -- header and manifest sizes checked at plan ----------------------------


def _plan_and_size(tag: str, name: str, what: str):
    tensors = {"blocks.0.w": torch.zeros(4), name: torch.zeros(4)}
    plan = build_plan(identity(t=tag), tensors)
    checked = check_plan(plan)
    size = max(len(lay.header) for lay in checked.layouts) if what == "header" else planned_manifest_bytes(checked)
    return tensors, size


def test_header_bytes_boundary(tmp_path):
    # Headers are padded to 64 bytes: the next larger header is 64 bytes more.
    ok, h = _plan_and_size("hdr-ok", "x" * 100, "header")
    bad, h_bad = _plan_and_size("hdr-no", "x" * 200, "header")
    assert h_bad > h
    d = start_with(tmp_path, "header", {"max_header_bytes": h})
    try:
        publish_and_remove(d, "hdr-ok", ok)
        exc = refused(d, "hdr-no", bad)
        assert isinstance(exc, ResourceExhausted)
        assert f"header bytes {h_bad} exceeds the limit {h}" in str(exc) and "max_header_bytes" in str(exc)
    finally:
        cleanup(d)


def _header_sizes(tag: str, name: str) -> tuple[dict, int, int]:
    """(tensors, padded header bytes, the same header without its padding)."""
    tensors = {"blocks.0.w": torch.zeros(4), name: torch.zeros(4)}
    lay = max(check_plan(build_plan(identity(t=tag), tensors)).layouts, key=lambda lay: len(lay.header))
    return tensors, len(lay.header), len(lay.header.rstrip(b" "))


def test_header_limit_off_the_64_byte_padding(tmp_path):
    """Headers are padded to 64 bytes; limits that are not multiples of 64
    must still be compared with the PADDED size (the bytes written and
    parsed). With a limit one byte under a header's padded size, that
    header is refused although its unpadded JSON fits; with a limit half a
    pad above it, it is accepted, and the next larger header (one pad more,
    its unpadded JSON under the limit) is refused."""
    # A header whose padding is large, and one a pad larger whose JSON ends
    # within the first half of its last pad.
    a = next(x for x in (_header_sizes("pad-a", "x" * n) for n in range(100, 164)) if x[1] - x[2] >= 16)
    tensors_a, h, unpadded_a = a
    b = next(x for x in (_header_sizes("pad-b", "x" * n) for n in range(100, 400)) if x[1] == h + 64
             and x[2] <= h + 32)
    tensors_b, h_b, unpadded_b = b
    assert h % 64 == 0 and unpadded_a < h - 1 and unpadded_b <= h + 32 < h_b
    under = start_with(tmp_path, "pad-under", {"max_header_bytes": h - 1})
    try:
        exc = refused(under, "pad-a", tensors_a)
        assert isinstance(exc, ResourceExhausted)
        assert f"header bytes {h} exceeds the limit {h - 1}" in str(exc) and "max_header_bytes" in str(exc)
    finally:
        cleanup(under)
    over = start_with(tmp_path, "pad-over", {"max_header_bytes": h + 32})
    try:
        publish_and_remove(over, "pad-a", tensors_a)
        exc = refused(over, "pad-b", tensors_b)
        assert isinstance(exc, ResourceExhausted)
        assert f"header bytes {h_b} exceeds the limit {h + 32}" in str(exc)
    finally:
        cleanup(over)


def test_manifest_bytes_boundary_and_estimate_is_exact(tmp_path):
    """The refused manifest is exactly one byte larger (one more name
    character); the stored manifest of the accepted one has exactly the size
    the plan predicted."""
    ok, m = _plan_and_size("man-ok", "x" * 100, "manifest")
    bad, m_bad = _plan_and_size("man-no", "x" * 101, "manifest")
    assert m_bad == m + 1
    d = start_with(tmp_path, "manifest", {"max_manifest_bytes": m})
    try:
        with d.client() as client:
            report = client.publish(identity(t="man-ok"), ok)
            reply = client.call(client.runtime.Lookup, pb.LookupRequest(key=report.key))
            assert len(reply.manifest_json.encode()) == m
            client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=report.key))
        exc = refused(d, "man-no", bad)
        assert isinstance(exc, ResourceExhausted)
        assert f"manifest bytes {m + 1} exceeds the limit {m}" in str(exc) and "max_manifest_bytes" in str(exc)
    finally:
        cleanup(d)


def test_unservable_manifest_is_never_published(tmp_path):
    """The issue's case, scaled to the default limit: long names whose
    manifest would exceed max_manifest_bytes (32 MiB) are refused at plan,
    before any payload, and the key stays free (no already_published)."""
    d = make_daemon(tmp_path).start()
    try:
        n = 40_000  # 40k names of 1000 characters: a ~40 MB plan, a ~80 MB manifest
        msg = pb.PublishPlan(identity_json=Identity.from_dict(identity(t="fat")).to_json(), files=[
            pb.FilePlan(name=f"f{j}", tensors=[pb.TensorPlan(name=f"{j:02d}{i:06d}" + "n" * 992, dtype="U8")
                                               for i in range(n // 40)]) for j in range(40)])
        with d.client() as client:
            code, details = raw_publish(client, [pb.PublishRequest(plan=msg), COMMIT], timeout=60)
            assert code == StatusCode.RESOURCE_EXHAUSTED and "max_manifest_bytes" in details, details
            assert_nothing_left(d, key_of("fat"))
            report = client.publish(identity(t="fat"), {"w": torch.zeros(4)})  # the key is free
            assert report.already_published is False
    finally:
        cleanup(d)


# -- bounds of a shape; anchored hex -------------------------


def _zero_byte_plan(tag: str, shape: list[int]) -> pb.PublishPlan:
    return pb.PublishPlan(identity_json=Identity.from_dict(identity(t=tag)).to_json(), ordered=True, files=[
        pb.FilePlan(name="f", tensors=[pb.TensorPlan(name="w", dtype="U8", shape=shape)])])


@pytest.mark.parametrize("shape", [[2**64 - 1, 0], [2**63, 0], [2**62, 2**62, 0], [0, 2**62, 2**62]],
                         ids=["2^64-1", "2^63", "product", "product-after-zero"])
def test_shape_beyond_int64_is_invalid_at_plan(limited, shape):
    with limited.client() as client:
        code, details = raw_publish(client, [pb.PublishRequest(plan=_zero_byte_plan(f"dim-{shape}", shape)), COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "2**63 - 1" in details, details
    assert_nothing_left(limited, key_of(f"dim-{shape}"))


def test_shape_at_int64_max_is_accepted_and_viewable(limited):
    tag = "dim-max"
    with limited.client() as client:
        code, details = raw_publish(client, [pb.PublishRequest(plan=_zero_byte_plan(tag, [MAX_DIM, 0])), COMMIT])
        assert code == StatusCode.OK, details
        with client.acquire(key_of(tag)) as lease:
            assert tuple(lease.tensors()["w"].shape) == (MAX_DIM, 0)
        client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=key_of(tag)))
    assert TensorSpec("w", "U8", (MAX_DIM, 0)).validate()
    with pytest.raises(InvalidArgument):
        TensorSpec("w", "U16", (2**62, 2)).validate()  # 2**63 bytes


def test_hex_fields_with_a_trailing_newline_are_refused(limited):
    tensors = {"w": torch.zeros(4)}
    plan = build_plan(identity(t="nl"), tensors)
    msg = to_proto(plan)
    msg.files[0].declared_sha256 = "0" * 64 + "\n"
    with limited.client() as client:
        code, details = raw_publish(client, [pb.PublishRequest(plan=msg), *chunks(plan, tensors, 4096), COMMIT])
        assert code == StatusCode.INVALID_ARGUMENT and "declared_sha256" in details, details
        with pytest.raises(InvalidArgument):
            client.lookup(key_of("nl") + "\n")
    assert not is_key("a" * 64 + "\n")
    assert_nothing_left(limited, key_of("nl"))


def test_manifest_hex_with_a_trailing_newline_is_refused(tmp_path):
    store = Store(ServerConfig(root=str(tmp_path / "root")))
    store.recover()
    tensors = {"w": torch.zeros(4)}
    pub = Publication.begin(store, to_proto(build_plan(identity(t="mnl"), tensors)))
    try:
        for fi, off, data in [(c.chunk.file_index, c.chunk.offset, c.chunk.data)
                              for c in chunks(build_plan(identity(t="mnl"), tensors), tensors, 4096)]:
            pub.write(fi, off, data)
        text = pub.commit().manifest_json
    finally:
        pub.close()
    blob = Manifest.from_json(text).files[0].blob
    with pytest.raises(InvalidArgument, match="malformed"):
        Manifest.from_json(text.replace(f'"{blob}"', f'"{blob}\\n"', 1))


# -- the exact end of the planned data, in both modes ----------------------


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_one_byte_past_the_planned_data_is_refused(limited, ordered):
    """The whole planned region is accepted up to its last byte; one byte
    more (the last chunk extended, or a 1-byte chunk at the end) is refused,
    and nothing is left. Before: a mutation allowing one byte more passed
    every test and committed a corrupt artifact in unordered mode."""
    tensors = {"w": torch.arange(1024, dtype=torch.float32)}  # 4096 bytes: data size 4096
    tag = f"end-{ordered}"
    plan = build_plan(identity(t=tag), tensors, ordered=ordered)
    reqs = chunks(plan, tensors, 1000)
    size = check_plan(plan).layouts[0].data_size
    assert reqs[-1].chunk.offset + len(reqs[-1].chunk.data) == size
    extended = pb.PublishRequest()
    extended.CopyFrom(reqs[-1])
    extended.chunk.data = reqs[-1].chunk.data + b"\0"
    tail = pb.PublishRequest(chunk=pb.PayloadChunk(file_index=0, offset=size, data=b"\0"))
    with limited.client() as client:
        for bad in ([*reqs[:-1], extended], [*reqs, tail]):
            code, details = raw_publish(client, [pb.PublishRequest(plan=to_proto(plan)), *bad, COMMIT])
            assert code == StatusCode.INVALID_ARGUMENT and "more payload than planned" in details, details
            assert f"runs past the planned data size {size}" in details
            assert_nothing_left(limited, key_of(tag))
        code, details = raw_publish(client, [pb.PublishRequest(plan=to_proto(plan)), *reqs, COMMIT])
        assert code == StatusCode.OK, details
        assert client.lookup(key_of(tag)).size_bytes == check_plan(plan).total_bytes
        client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=key_of(tag)))


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_chunk_size_boundary(limited, ordered):
    tensors = {"w": torch.arange(2048, dtype=torch.float32)}  # 8192 bytes
    tag = f"chunk-{ordered}"
    plan = build_plan(identity(t=tag), tensors, ordered=ordered)
    with limited.client() as client:
        big = chunks(plan, tensors, 4097)
        assert len(big[0].chunk.data) == 4097
        code, details = raw_publish(client, [pb.PublishRequest(plan=to_proto(plan)), *big, COMMIT])
        assert code == StatusCode.INVALID_ARGUMENT and "chunk of 4097 bytes; expected 1..4096" in details
        assert_nothing_left(limited, key_of(tag))
        code, details = raw_publish(client, [pb.PublishRequest(plan=to_proto(plan)),
                                             *chunks(plan, tensors, 4096), COMMIT])
        assert code == StatusCode.OK, details
        client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=key_of(tag)))


# -- idle publications, descriptors -----------------------------------------


@pytest.mark.parametrize("after", ["plan", "chunk"])
def test_idle_publication_is_aborted_and_frees_everything(limited, after):
    """publication_idle_s = 1: a publication that stops sending ends ABORTED
    (the landed daemon waited until the caller's 15 s deadline), its staging
    and reader thread gone."""
    tensors = {"w": torch.arange(2048, dtype=torch.float32)}
    plan = build_plan(identity(t=f"idle-{after}"), tensors)
    reqs = [pb.PublishRequest(plan=to_proto(plan))] + (chunks(plan, tensors, 4096)[:1] if after == "chunk" else [])
    threads0 = daemon_threads(limited)
    release = threading.Event()
    with limited.client() as client:
        call = held_stream(client, reqs, release)
        try:
            assert next(call).WhichOneof("kind") == "accepted"
            with pytest.raises(grpc.RpcError) as err:
                next(call)
        finally:
            release.set()
    assert err.value.code() == StatusCode.ABORTED, err.value.details()
    assert "no message for 1 s" in err.value.details() and "publication_idle_s" in err.value.details()
    assert_nothing_left(limited, key_of(f"idle-{after}"))
    deadline = time.monotonic() + 10
    while daemon_threads(limited) > threads0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon_threads(limited) <= threads0  # the reader thread ended with the call


def test_plan_only_publications_do_not_hold_every_slot(limited):
    """As many plan-only publications as there are slots: a real one still
    commits (they end at the idle deadline; before, it waited for ever)."""
    release = threading.Event()
    calls = []
    with limited.client() as client:
        try:
            for i in range(ServerConfig().max_publications):
                plan = build_plan(identity(t=f"hog-{i}"), {"w": torch.zeros(4)})
                calls.append(held_stream(client, [pb.PublishRequest(plan=to_proto(plan))], release))
            report = client.publish(identity(t="legit"), {"w": torch.ones(4)})
            assert client.lookup(report.key).key == report.key
            client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=report.key))
            codes = []
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    for _ in call:
                        pass
                codes.append(err.value.code())
            assert set(codes) == {StatusCode.ABORTED}
        finally:
            release.set()
    assert_nothing_left(limited)


def test_a_plan_of_many_files_holds_few_descriptors(tmp_path):
    """500 one-tensor files: the landed daemon held one descriptor per file
    from plan to commit (19,981 of them once made others' calls fail). The
    daemon's descriptors are sampled from the plan to the commit."""
    d = make_daemon(tmp_path).start()
    try:
        tensors = {f"blocks.{i}.w": torch.full((16,), float(i)) for i in range(500)}
        for ordered in (True, False):
            plan = build_plan(identity(t=f"files-{ordered}"), tensors, ordered=ordered, file_target_bytes=1)
            assert len(check_plan(plan).layouts) == 500
            fds0 = daemon_fds(d)
            samples: list[int] = []
            accepted = threading.Event()

            def gen():
                yield pb.PublishRequest(plan=to_proto(plan))
                accepted.wait(30)
                for i, req in enumerate(chunks(plan, tensors, 1 << 20)):
                    if i % 50 == 0:
                        samples.append(daemon_fds(d))
                    yield req
                samples.append(daemon_fds(d))
                yield COMMIT

            with d.client() as client:
                events = client.runtime.Publish(gen(), timeout=60)
                assert next(events).WhichOneof("kind") == "accepted"
                samples.append(daemon_fds(d))  # the plan is staged: every file exists
                accepted.set()
                assert next(events).WhichOneof("kind") == "committed"
            assert len(samples) >= 10 and max(samples) - fds0 < 50, (fds0, samples)
    finally:
        cleanup(d)


def test_out_of_descriptors_is_resource_exhausted(tmp_path):
    assert isinstance(os_error(OSError(errno.EMFILE, "Too many open files"), "x"), ResourceExhausted)
    assert isinstance(os_error(OSError(errno.ENFILE, "File table overflow"), "x"), ResourceExhausted)
    store = Store(ServerConfig(root=str(tmp_path / "root")))
    store.recover()
    msg = to_proto(build_plan(identity(t="emfile"), sample_tensors()))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe, hard))  # the next open fails with EMFILE
    try:
        with pytest.raises(ResourceExhausted, match="out of file descriptors"):
            Publication.begin(store, msg)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # Without a descriptor even the cleanup cannot list the staging directory;
    # what is left is no longer in flight, so GC (or a restart) removes it.
    for entry in store.staging_entries():
        assert not entry.in_flight and store.remove_staging(entry.name)
    assert os.listdir(store.staging_dir) == []
