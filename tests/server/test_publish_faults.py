"""Bad input and faults, each against a REAL daemon: a clear error
with the fitting status code, nothing half-published visible, staging gone,
the daemon still serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest
import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from hwr_client.core.plan import check_plan, to_proto
from hwr_client.tensors import build_plan, iter_payload
from tests.conftest import identity, sample_tensors
from tests.support.paths import REPO_DIR

StatusCode = grpc.StatusCode


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One real daemon shared by the request-validation tests (each leaves the
    store empty, which assert_clean checks)."""
    from tests.support.daemon import cleanup, make_daemon

    d = make_daemon(tmp_path_factory.mktemp("faults")).start()
    yield d
    cleanup(d)


def raw_publish(client, requests) -> tuple[StatusCode, str]:
    """Sends ``requests`` on one Publish stream; returns the final status."""
    try:
        for _ in client.runtime.Publish(iter(requests), timeout=60):
            pass
    except grpc.RpcError as err:
        return err.code(), err.details()
    return StatusCode.OK, ""


def payload(plan, tensors, size=1 << 20) -> list[pb.PublishRequest]:
    checked = check_plan(plan)
    return [
        pb.PublishRequest(chunk=pb.PayloadChunk(file_index=fi, offset=off, data=bytes(d)))
        for fi, lay in enumerate(checked.layouts)
        for off, d in iter_payload(lay, tensors, size)
    ]


PLAN = pb.PublishRequest
COMMIT = pb.PublishRequest(commit=pb.PublishCommit())


def assert_clean(daemon, key: str | None = None) -> None:
    """Nothing visible, no staging, and the daemon still serves a publication."""
    assert os.listdir(os.path.join(daemon.root, "staging")) == []
    assert os.listdir(os.path.join(daemon.root, "artifacts")) == []
    with daemon.client() as client:
        if key:
            with pytest.raises(NotFound):
                client.lookup(key)
        report = client.publish(identity(t="still-serving", n=time.monotonic_ns()), sample_tensors(blocks=1))
        assert client.lookup(report.key).key == report.key
        client.call(client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=report.key))


def plan_msg(tag: str, tensors=None, **kw) -> tuple[pb.PublishPlan, object, dict]:
    tensors = tensors or sample_tensors()
    plan = build_plan(identity(t=tag), tensors, **kw)
    return to_proto(plan), plan, tensors


@pytest.mark.parametrize("bad_name", ["", "a/b", "blocks..x", "..", "x\x00y", "__hwr_pad.0"])
def test_plan_with_an_unsafe_tensor_name_is_invalid(served, bad_name):
    msg, _, _ = plan_msg("names")
    msg.files[0].tensors[0].name = bad_name
    with served.client() as client:
        code, details = raw_publish(client, [PLAN(plan=msg), COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "tensor name" in details
    assert_clean(served)


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda m: setattr(m.files[0].tensors[1], "name", m.files[0].tensors[0].name), "duplicate tensor"),
        (lambda m: setattr(m.files[0].tensors[0], "dtype", "F128"), "unknown"),
        (lambda m: m.ClearField("files"), "at least one file"),
        (lambda m: m.files[0].ClearField("tensors"), "zero tensors"),
        (lambda m: setattr(m, "identity_json", '{"contract": {}}'), "identity"),
        (lambda m: setattr(m.files[0], "declared_sha256", "xyz"), "declared_sha256"),
    ],
    ids=["duplicate", "unknown-dtype", "no-files", "zero-tensors", "bad-identity", "bad-declared"],
)
def test_invalid_plans_are_refused_before_anything_is_written(served, mutate, expect):
    msg, _, _ = plan_msg("plans")
    mutate(msg)
    with served.client() as client:
        code, details = raw_publish(client, [PLAN(plan=msg), COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and expect in details
    assert_clean(served)


def test_publishing_zero_tensors_fails_in_the_client(served):
    with served.client() as client, pytest.raises(InvalidArgument, match="at least one tensor"):
        client.publish(identity(t="empty"), {})


def test_first_message_must_be_a_plan(served):
    with served.client() as client:
        code, details = raw_publish(client, [COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "plan" in details
    assert_clean(served)


def test_more_payload_than_planned(served):
    msg, plan, tensors = plan_msg("more")
    chunks = payload(plan, tensors)
    last = chunks[-1].chunk
    extra = PLAN(chunk=pb.PayloadChunk(file_index=last.file_index, offset=last.offset + len(last.data), data=b"\0" * 64))
    with served.client() as client:
        code, details = raw_publish(client, [PLAN(plan=msg), *chunks, extra, COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "more payload than planned" in details
    assert_clean(served, plan.identity.key)


def test_shape_times_dtype_disagreeing_with_the_bytes_sent(served):
    # The plan says F32 [8, 8] (256 bytes); the producer sends 192 bytes then commits.
    tensors = {"w": torch.zeros(8, 8)}
    msg, plan, _ = plan_msg("shape", tensors)
    wrong = PLAN(chunk=pb.PayloadChunk(file_index=0, offset=0, data=b"\0" * 192))
    with served.client() as client:
        code, details = raw_publish(client, [PLAN(plan=msg), wrong, COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "too few bytes" in details
    assert_clean(served, plan.identity.key)


@pytest.mark.parametrize("ordered", [True, False])
def test_too_few_bytes_then_commit(served, ordered):
    msg, plan, tensors = plan_msg("few", ordered=ordered)
    chunks = payload(plan, tensors, size=256)
    with served.client() as client:
        code, details = raw_publish(client, [PLAN(plan=msg), *chunks[:-2], COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "too few bytes" in details
    assert_clean(served, plan.identity.key)


def test_out_of_order_chunk_in_ordered_mode(served):
    msg, plan, tensors = plan_msg("order")
    chunks = payload(plan, tensors, size=256)
    chunks[2], chunks[3] = chunks[3], chunks[2]
    with served.client() as client:
        code, details = raw_publish(client, [PLAN(plan=msg), *chunks, COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "out-of-order chunk" in details
    assert_clean(served, plan.identity.key)


def test_overlapping_chunk_in_unordered_mode(served):
    msg, plan, tensors = plan_msg("overlap", ordered=False)
    chunks = payload(plan, tensors, size=256)
    with served.client() as client:
        code, details = raw_publish(client, [PLAN(plan=msg), chunks[1], chunks[0], chunks[1], COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "overlaps" in details
    assert_clean(served, plan.identity.key)


@pytest.mark.parametrize("which", ["file", "tensor", "content"])
def test_declared_digest_mismatch_is_failed_precondition(served, which):
    msg, plan, tensors = plan_msg(f"declared-{which}")
    if which == "file":
        msg.files[0].declared_sha256 = "0" * 64
    elif which == "tensor":
        msg.files[-1].tensors[0].declared_sha256 = "1" * 64
    else:
        msg.declared_content_digest = "sha256:" + "2" * 64
    with served.client() as client:
        code, details = raw_publish(client, [PLAN(plan=msg), *payload(plan, tensors), COMMIT])
    assert code == StatusCode.FAILED_PRECONDITION and "declared" in details
    assert_clean(served, plan.identity.key)
    assert os.listdir(os.path.join(served.root, "blobs", "sha256")) == []  # no stray payload either


def test_nonzero_alignment_padding_is_invalid(served):
    msg, plan, tensors = plan_msg("padding")
    checked = check_plan(plan)
    fi = next(i for i, lay in enumerate(checked.layouts) if lay.padding_ranges())
    pad_begin = checked.layouts[fi].padding_ranges()[0][0]
    chunks = payload(plan, tensors, size=1 << 20)
    for c in chunks:
        if c.chunk.file_index == fi and c.chunk.offset == pad_begin:
            c.chunk.data = b"\x07" * len(c.chunk.data)
    with served.client() as client:
        code, details = raw_publish(client, [PLAN(plan=msg), *chunks, COMMIT])
    assert code == StatusCode.INVALID_ARGUMENT and "padding" in details
    assert_clean(served, plan.identity.key)


# -- on-disk damage before a restart ------------------------------------------


def _publish_one(daemon, tag, tensors):
    with daemon.client() as client:
        return client.publish(identity(t=tag), tensors)


def _writable(path):
    os.chmod(path, 0o644)
    return path


@pytest.mark.parametrize(
    "damage", ["bitflip-offset", "bitflip-digest", "bitflip-block", "bitflip-json", "truncate", "blob-deleted"]
)
def test_damaged_store_is_quarantined_at_restart(daemon, damage):
    shared = sample_tensors(seed=1)
    own = {**shared, **{k: v + 1 for k, v in shared.items() if k.startswith("blocks.")}}
    keep = _publish_one(daemon, "keep", shared)
    hurt = _publish_one(daemon, f"hurt-{damage}", own)
    # The base file (embedding, final norm) is identical and shared; block files are not.
    assert {f.blob for f in keep.manifest.files} & {f.blob for f in hurt.manifest.files}
    manifest_path = os.path.join(daemon.root, "artifacts", hurt.key, "manifest.json")
    daemon.stop()
    if damage.startswith("bitflip"):
        data = bytearray(open(manifest_path, "rb").read())
        anchor = {"bitflip-offset": b'"offset": ', "bitflip-digest": b'"content_digest": "sha256:',
                  "bitflip-block": b'"end": ', "bitflip-json": b"{"}[damage]
        data[data.index(anchor) + len(anchor)] ^= 0x01
        open(_writable(manifest_path), "wb").write(data)
    elif damage == "truncate":
        open(_writable(manifest_path), "wb").close()
    else:
        own = [f.blob for f in hurt.manifest.files if f.blob not in {g.blob for g in keep.manifest.files}]
        assert own
        os.unlink(os.path.join(daemon.root, "blobs", "sha256", own[0]))
    daemon.start()
    with daemon.client() as client:
        assert client.lookup(keep.key).key == keep.key
        with pytest.raises(Exception) as exc:
            client.lookup(hurt.key)
        assert type(exc.value).__name__ == "FailedPrecondition" and "quarantined" in str(exc.value)
        rows = {r.key: r.state for r in client.call(client.reader.ListArtifacts, pb.ListArtifactsRequest()).artifacts}
        assert rows == {keep.key: "published", hurt.key: "quarantined"}
        ok = client.call(client.admin.VerifyArtifact, pb.VerifyArtifactRequest(key=keep.key))
        assert ok.results[0].ok  # the shared blob survived the quarantine
    assert os.listdir(os.path.join(daemon.root, "staging")) == []
    assert [n.split(".")[0] for n in os.listdir(os.path.join(daemon.root, "quarantine"))] == [hurt.key]


# -- killed processes ----------------------------------------------------------

SLOW_CLIENT = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {repo!r})
    import hwr_client
    from tests.conftest import identity
    tensors = {{f"blocks.{{i}}.w": torch.full((1024, 1024), float(i)) for i in range(32)}}
    def progress(sent, total):
        print("sent", sent, flush=True)
        time.sleep(0.2)
    hwr_client.connect({sock!r}).publish(identity(t="killed"), tensors, progress=progress)
    """
)


def _staging_has_bytes(root) -> bool:
    staging = os.path.join(root, "staging")
    return any(os.listdir(staging))


def _wait(predicate, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_client_killed_mid_stream_leaves_no_staging(daemon):
    repo = REPO_DIR
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLIENT.format(repo=repo, sock=daemon.socket)],
                            stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):
            assert proc.stdout.readline().startswith("sent")
        assert _staging_has_bytes(daemon.root)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.stdout.close()
    _wait(lambda: not _staging_has_bytes(daemon.root))  # the daemon notices the broken stream
    assert_clean(daemon, identity_key("killed"))
    assert daemon.proc.poll() is None


def identity_key(tag: str) -> str:
    from hwr_client.core.identity import Identity

    return Identity.from_dict(identity(t=tag)).key


def test_daemon_sigkilled_mid_publication_recovers_on_restart(daemon):
    tensors = {f"blocks.{i}.w": torch.full((1024, 1024), float(i)) for i in range(32)}
    sent = threading.Event()
    outcome: list[BaseException] = []

    def progress(done, total):
        sent.set()
        time.sleep(0.1)

    def run():
        try:
            with daemon.client() as client:
                client.publish(identity(t="daemon-killed"), tensors, progress=progress)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert sent.wait(60)
    assert _staging_has_bytes(daemon.root)
    daemon.kill()
    thread.join(60)
    assert outcome and isinstance(outcome[0], Unavailable), outcome
    assert _staging_has_bytes(daemon.root)  # the leftover is there until recovery
    daemon.start()
    assert_clean(daemon, identity_key("daemon-killed"))
    with daemon.client() as client:
        report = client.publish(identity(t="daemon-killed"), tensors)
        assert client.call(client.admin.VerifyArtifact, pb.VerifyArtifactRequest(key=report.key)).results[0].ok


# -- disk full -----------------------------------------------------------------


def test_disk_full_is_resource_exhausted(make_daemon_fixture, small_disk):
    d = make_daemon_fixture(root=os.path.join(small_disk, "root"))
    big = {f"blocks.{i}.w": torch.full((1024, 1024), float(i)) for i in range(16)}  # 64 MiB > disk
    with d.client() as client:
        with pytest.raises(ResourceExhausted, match="free"):
            client.publish(identity(t="too-big"), big)
        assert os.listdir(os.path.join(d.root, "staging")) == []
        # The real ENOSPC: the plan fits, then the disk fills before the commit.
        tensors = {f"blocks.{i}.w": torch.full((1024, 1024), float(i)) for i in range(4)}  # 16 MiB
        plan = build_plan(identity(t="fills"), tensors)
        filler = os.path.join(small_disk, "filler")
        reqs = [PLAN(plan=to_proto(plan)), *payload(plan, tensors)]

        def stream():
            yield from reqs
            fill(filler)
            yield COMMIT

        code, details = raw_publish(client, stream())
        assert code == StatusCode.RESOURCE_EXHAUSTED and "disk is full" in details, details
        assert os.listdir(os.path.join(d.root, "staging")) == []
        assert os.listdir(os.path.join(d.root, "artifacts")) == []
        assert os.listdir(os.path.join(d.root, "blobs", "sha256")) == []
        os.unlink(filler)
        report = client.publish(identity(t="fills"), tensors)
        assert client.lookup(report.key).key == report.key


def fill(path: str) -> None:
    """Writes ``path`` until the filesystem has no free byte left."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\xff" * size)
            except OSError:
                pass


def test_capacity_budget_is_resource_exhausted(make_daemon_fixture):
    """The configured byte budget (works where no tmpfs can be mounted). With
    the GC present its hook collects first; an artifact larger than the whole
    budget is refused either way."""
    d = make_daemon_fixture("--capacity", "64KiB")
    with d.client() as client:
        client.publish(identity(t="fits"), sample_tensors(blocks=1))
        with pytest.raises(ResourceExhausted) as exc:
            client.publish(identity(t="over"), {"blocks.0.w": torch.zeros(128, 1024)})  # 512 KiB
        assert "65536" in str(exc.value) or "capacity" in str(exc.value)
        assert os.listdir(os.path.join(d.root, "staging")) == []
        with pytest.raises(NotFound):
            client.lookup(identity_key("over"))
        assert client.publish(identity(t="fits-too"), sample_tensors(blocks=1, seed=3)).key
