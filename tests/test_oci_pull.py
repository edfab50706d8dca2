"""Push and pull through a real OCI registry (CNCF distribution,
``docker-registry``) with real daemons on separate roots playing nodes.

One registry and one counting proxy in front of it serve the module; each
test uses its own repository so they do not see each other's blobs.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import errno
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import DataLoss, FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from hwr_client.core.identity import Identity
from hwr_client.core.manifest import Manifest, content_digest
from hwr_server.remote.oci import ARTIFACT_TYPE, MANIFEST_MEDIA_TYPE, build_oci_manifest, digest_of
from hwr_server.remote.registry import RegistryClient
from tests.conftest import identity, sample_tensors
from tests.oci_registry import Proxy, free_port, make_registry, remote_config

BASE = sample_tensors(blocks=3, seed=11)
#: Shares BASE's non-block file (embedding, final norm); its block files are new.
SECOND = {**BASE, **{k: v + 1 for k, v in BASE.items() if k.startswith("blocks.")}}


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = make_registry(str(tmp_path_factory.mktemp("registry")))
    proxy = Proxy(reg.host)
    yield reg, proxy
    proxy.close()
    reg.stop()


@pytest.fixture
def nodes(make_daemon_fixture, tmp_path, registry):
    """A factory of daemons configured for the proxy's registry."""
    reg, proxy = registry

    def make(repo: str = "", pull_on_miss: bool = False, layer_attempts: int = 3, push_after_publish: bool = False,
             extra: tuple[str, ...] = (), timeout_s: float = 10.0):
        cfg = remote_config(str(tmp_path / f"cfg-{len(os.listdir(tmp_path))}.toml"), registry=proxy.host,
                            repository=repo, pull_on_miss=pull_on_miss, layer_attempts=layer_attempts,
                            push_after_publish=push_after_publish, timeout_s=timeout_s)
        return make_daemon_fixture("--config", cfg, *extra, root=str(tmp_path / f"root-{len(os.listdir(tmp_path))}"))

    return make


def publish(node, tag: str, tensors=BASE) -> str:
    with node.client() as c:
        return c.publish(identity(t=tag), tensors, file_target_bytes=1).key


def pull(node, ref: str) -> pb.TransferDone:
    with node.client() as c:
        return c.transfer(c.admin.Pull, pb.PullRequest(reference=ref))


def push(node, key: str, ref: str) -> pb.TransferDone:
    with node.client() as c:
        return c.transfer(c.admin.Push, pb.PushRequest(key=key, reference=ref))


def blob_gets(seen) -> list[str]:
    return [s.path.rsplit("/", 1)[-1] for s in seen if s.method == "GET" and "/blobs/" in s.path]


def uploads(seen) -> int:
    return sum(1 for s in seen if s.method == "PUT" and "/blobs/uploads/" in s.path)


def nothing_left(node) -> None:
    assert os.listdir(os.path.join(node.root, "staging")) == []
    assert os.listdir(os.path.join(node.root, "artifacts")) == []
    assert os.listdir(os.path.join(node.root, "blobs", "sha256")) == []


def test_push_pull_verify_lease_and_shared_blobs(nodes, registry):
    reg, proxy = registry
    a, b = nodes(), nodes()
    key1, key2 = publish(a, "one"), publish(a, "two", SECOND)
    repo = f"{proxy.host}/hwr/two-nodes"
    proxy.take()
    out = a.cli("push", key1, repo, "--json", check=True)
    pushed = json.loads(out.stdout)
    with a.client() as c:
        files1 = c.lookup(key1).files
        files2 = c.lookup(key2).files
    assert pushed["layers_transferred"] == len(files1) and pushed["layers_skipped"] == 0
    assert uploads(proxy.take()) == len(files1) + 1  # the layers and the config
    # The second artifact shares its base file: only its new blobs go up.
    new2 = {f.blob for f in files2} - {f.blob for f in files1}
    assert new2 and len(new2) < len(files2)
    done2 = push(a, key2, repo)
    assert (done2.layers_transferred, done2.layers_skipped) == (len(new2), len(files2) - len(new2))
    assert uploads(proxy.take()) == len(new2) + 1

    out = b.cli("pull", f"{repo}:{key1}", "--json", check=True)
    pulled = json.loads(out.stdout)
    assert pulled["key"] == key1 and pulled["manifest_digest"] == pushed["manifest_digest"]
    assert sorted(blob_gets(proxy.take())) == sorted({"sha256:" + f.blob for f in files1} | {_config_digest(a, key1)})
    assert b.cli("verify", key1).returncode == 0
    # Pull of the second: only its new blobs come over the wire, with progress.
    events: list[pb.TransferProgress] = []
    with b.client() as c:
        done = c.transfer(c.admin.Pull, pb.PullRequest(reference=f"{repo}:{key2}"), progress=events.append)
    assert events and events[-1].bytes_done == events[-1].bytes_total == done.bytes_transferred
    assert [e.bytes_done for e in events] == sorted(e.bytes_done for e in events)
    got = blob_gets(proxy.take())
    assert sorted(g for g in got if g != _config_digest(a, key2)) == sorted("sha256:" + h for h in new2)
    assert done.layers_transferred == len(new2) and done.bytes_transferred == sum(
        f.size for f in files2 if f.blob in new2)
    assert b.cli("verify", key2).returncode == 0
    # A worker on B maps what A published.
    with b.client() as c:
        res = c.resolve(identity(t="two"), mode="required")
        assert res.outcome == "LOCAL_HIT"
        with res.lease as lease:
            tensors = lease.tensors()
            assert set(tensors) == set(SECOND)
            for name, t in SECOND.items():
                assert torch.equal(tensors[name], t), name
    # Pulled again: nothing to do. By digest, on a third node: works.
    assert pull(b, f"{repo}:{key1}").already_present
    c3 = nodes()
    by_digest = pull(c3, f"{repo}@{pushed['manifest_digest']}")
    assert by_digest.key == key1 and by_digest.layers_transferred == len(files1)


def _config_digest(node, key: str) -> str:
    with node.client() as c:
        text = c.call(c.runtime.Lookup, pb.LookupRequest(key=key)).manifest_json
    return digest_of(text.encode("utf-8"))


def test_chunked_upload(make_daemon_fixture, tmp_path, registry, nodes):
    reg, proxy = registry
    cfg = remote_config(str(tmp_path / "chunked.toml"), upload_chunk_bytes=1000)
    a = make_daemon_fixture("--config", cfg, root=str(tmp_path / "chunked"))
    key = publish(a, "chunked", sample_tensors(blocks=2, seed=5))
    repo = f"{proxy.host}/hwr/chunked"
    proxy.take()
    push(a, key, repo)
    patches = [s for s in proxy.take() if s.method == "PATCH"]
    with a.client() as c:
        sizes = [f.size for f in c.lookup(key).files]
    assert len(patches) == sum(-(-n // 1000) for n in sizes if n > 1000), patches
    b = nodes()
    assert pull(b, f"{repo}:{key}").key == key and b.cli("verify", key).returncode == 0


def test_tampered_layer_is_data_loss_and_nothing_is_published(nodes, registry):
    reg, proxy = registry
    a, b = nodes(), nodes()
    key = publish(a, "tampered", sample_tensors(blocks=3, seed=99))  # blobs of its own: the registry dedups
    repo = f"{proxy.host}/hwr/tampered"
    push(a, key, repo)
    with a.client() as c:
        blob = c.lookup(key).files[-1].blob
    data = reg.blob_data(blob)
    with open(data, "r+b") as f:  # same size, one byte flipped
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(DataLoss, match="hash to"):
        pull(b, f"{repo}:{key}")
    nothing_left(b)
    with b.client() as c:  # still serving
        with pytest.raises(NotFound):
            c.lookup(key)


def done_files(node, key: str):
    with node.client() as c:
        return c.lookup(key).files


def test_interrupted_layer_resumes_with_a_range_request_and_redirects_are_followed(nodes, registry):
    reg, proxy = registry
    a, b = nodes(), nodes()
    key = publish(a, "resume")
    repo = f"{proxy.host}/hwr/resume"
    push(a, key, repo)
    with a.client() as c:
        blob = c.lookup(key).files[-1].blob
    proxy.take()
    proxy.cut = ("sha256:" + blob, 100)  # that layer's GET breaks off after 100 bytes
    done = pull(b, f"{repo}:{key}")
    seen = proxy.take()
    assert any(s.range == "bytes=100-" and s.status == 206 for s in seen), seen
    assert done.key == key
    assert b.cli("verify", key).returncode == 0
    # A registry that redirects blob GETs (to object storage, here to itself).
    proxy.redirect_blobs = True
    try:
        c_node = nodes()
        assert pull(c_node, f"{repo}:{key}").key == key
    finally:
        proxy.redirect_blobs = False
    assert sum(1 for s in proxy.take() if s.status == 307) == len(done_files(a, key)) + 1  # layers and config
    assert c_node.cli("verify", key).returncode == 0


def test_registry_killed_mid_pull_then_retry_completes(nodes, registry):
    reg, proxy = registry
    a = nodes()
    b = nodes(layer_attempts=2)
    key = publish(a, "killed")
    repo = f"{proxy.host}/hwr/killed"
    push(a, key, repo)
    with a.client() as c:
        proxy.gate_digest = "sha256:" + c.lookup(key).files[-1].blob
    proxy.gate, proxy.gate_after = threading.Event(), 64
    proxy.holding.clear()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            pull(b, f"{repo}:{key}")
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert proxy.holding.wait(60)
        reg.stop()  # the registry dies while a layer is half-way
    finally:
        proxy.gate.set()
        proxy.gate = None
    t.join(120)
    assert len(errors) == 1 and isinstance(errors[0], Unavailable), errors
    nothing_left(b)
    reg.start()  # same storage, same port
    done = pull(b, f"{repo}:{key}")
    assert done.key == key and b.cli("verify", key).returncode == 0


def test_a_manifest_that_lies_about_a_tensor(make_daemon_fixture, tmp_path, registry, nodes):
    """Files that hash right under a manifest whose tensor digest is wrong:
    verify_pull="full" refuses it (DATA_LOSS); the default ("file") commits
    it and `hwr verify` finds it, as for any stored artifact."""
    reg, proxy = registry
    a = nodes()
    key = publish(a, "lying", sample_tensors(blocks=2, seed=31))
    repo = "hwr/lying"
    push(a, key, f"{proxy.host}/{repo}")
    with a.client() as c:
        doc = json.loads(c.call(c.runtime.Lookup, pb.LookupRequest(key=key)).manifest_json)
    doc["tensors"][-1]["sha256"] = "0" * 64
    doc["content_digest"] = content_digest((t["name"], t["dtype"], t["shape"], t["sha256"]) for t in doc["tensors"])
    lying = Manifest.from_json(json.dumps(doc))
    config = lying.to_json().encode()
    client = RegistryClient(reg.host, insecure=True)
    client.put_bytes_blob(repo, digest_of(config), config)
    client.put_manifest(repo, key, build_oci_manifest(lying, config), MANIFEST_MEDIA_TYPE)
    cfg = remote_config(str(tmp_path / "full.toml"), verify_pull="full")
    full = make_daemon_fixture("--config", cfg, root=str(tmp_path / "full"))
    with pytest.raises(DataLoss, match="fails verification"):
        pull(full, f"{proxy.host}/{repo}:{key}")
    nothing_left(full)
    trusting = nodes()
    pull(trusting, f"{proxy.host}/{repo}:{key}")
    assert trusting.cli("verify", key).returncode == 1


def test_refusals_name_the_problem(nodes, registry):
    reg, proxy = registry
    a, b = nodes(), nodes()
    key = publish(a, "refusals")
    other = Identity.from_dict(identity(t="never-published")).key
    repo = f"{proxy.host}/hwr/refusals"
    push(a, key, repo)
    with pytest.raises(NotFound, match="no such manifest"):
        pull(b, f"{repo}:{other}")
    # The artifact pushed under another key's tag: the key is not the tag.
    push(a, key, f"{repo}:{other}")
    with pytest.raises(FailedPrecondition, match="expected the tag"):
        pull(b, f"{repo}:{other}")
    # An OCI manifest that is not an HWR artifact.
    client = RegistryClient(reg.host, insecure=True)
    cfg = b"{}"
    client.put_bytes_blob("hwr/refusals", digest_of(cfg), cfg)
    foreign = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE,
                          "artifactType": "application/vnd.example.other",
                          "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": digest_of(cfg),
                                     "size": 2}, "layers": []}).encode()
    client.put_manifest("hwr/refusals", "foreign", foreign, MANIFEST_MEDIA_TYPE)
    with pytest.raises(FailedPrecondition, match=ARTIFACT_TYPE):
        pull(b, f"{repo}:foreign")
    nothing_left(b)
    # No room: RESOURCE_EXHAUSTED before a byte is fetched.
    small = nodes(extra=("--capacity", "4KiB"))
    with pytest.raises(ResourceExhausted, match="capacity"):
        pull(small, f"{repo}:{key}")
    nothing_left(small)


def test_push_after_publish_single_flight_and_pull_on_miss(nodes, registry):
    reg, proxy = registry
    repo = "hwr/miss"
    a = nodes(repo, push_after_publish=True)
    key = publish(a, "miss")
    client = RegistryClient(reg.host, insecure=True)
    deadline = time.monotonic() + 60
    while True:  # the publisher pushes in the background after its commit
        try:
            client.get_manifest(repo, key, limit=1 << 20)
            break
        except NotFound:
            assert time.monotonic() < deadline, a.log()[-2000:]
            time.sleep(0.05)
    c_node = nodes(repo, pull_on_miss=True)
    proxy.take()
    with c_node.client() as c:
        results: list = []

        def miss() -> None:
            results.append(c.pull_on_miss(key))

        threads = [threading.Thread(target=miss) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    gets = blob_gets(proxy.take())
    assert len(gets) == len(set(gets)), gets  # every blob fetched once for eight callers
    assert {r.key for r in results} == {key} and len(results) == 8
    # An empty node D with pull_on_miss: the worker's resolve is a LOCAL_HIT
    # and the canonical loader is never called.
    d = nodes(repo, pull_on_miss=True)
    loads = []
    with d.client() as c:
        res = c.resolve(identity(t="miss"), mode="preferred")
        if res.outcome != "LOCAL_HIT":
            loads.append("canonical")
        assert res.outcome == "LOCAL_HIT", res.reason
        res.lease.close()
        assert loads == []
        # Not in the registry: an ordinary miss (preferred falls back, required fails).
        res = c.resolve(identity(t="nowhere"), mode="preferred")
        assert res.outcome == "CANONICAL_FALLBACK" and "registry" in res.reason
        assert c.resolve(identity(t="nowhere"), mode="required").outcome == "FAILED"


def test_unreachable_registry_is_a_logged_miss_or_a_clear_failure(make_daemon_fixture, tmp_path):
    cfg = remote_config(str(tmp_path / "dead.toml"), registry=f"127.0.0.1:{free_port()}", repository="hwr/x",
                        pull_on_miss=True, layer_attempts=1)
    node = make_daemon_fixture("--config", cfg)
    with node.client() as c:
        res = c.resolve(identity(t="unreachable"), mode="preferred")
        assert res.outcome == "CANONICAL_FALLBACK" and "unreachable" in res.reason
        res = c.resolve(identity(t="unreachable"), mode="required")
        assert res.outcome == "FAILED" and isinstance(res.error, Unavailable) and "unreachable" in str(res.error)
        with pytest.raises(NotFound):  # the daemon keeps serving
            c.lookup(Identity.from_dict(identity(t="unreachable")).key)


def stats(node) -> dict[str, float]:
    with node.client() as c:
        return json.loads(c.call(c.reader.GetStats, pb.GetStatsRequest()).stats_json)


def wait_for(cond, what: str, node, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s; {node.log()[-2000:]}"
        time.sleep(0.05)


def test_a_stalled_pull_on_miss_gives_up_and_the_pull_goes_on(nodes, registry, monkeypatch, caplog):
    """The registry stalls before the first byte: the worker waits at most
    PULL_STALL_S without progress, then preferred falls back (the reason
    logged) and required fails naming the pull; the daemon's pull, whose
    callers went away, goes on when the registry answers again and commits
    whole, so the next miss is a plain LOCAL_HIT with no second download."""
    import hwr_client.resolve as resolve_mod

    reg, proxy = registry
    repo = "hwr/stall"
    a = nodes()
    key = publish(a, "stall")
    push(a, key, f"{proxy.host}/{repo}")
    # The daemon's own read timeout is far longer than the worker's bound:
    # what gives up here is the worker's wait, not the daemon's download.
    node = nodes(repo, pull_on_miss=True, timeout_s=120.0)
    monkeypatch.setattr(resolve_mod, "PULL_STALL_S", 0.5)
    proxy.take()
    proxy.stalled.clear()
    proxy.stall_digest, proxy.stall = "", threading.Event()
    try:
        with node.client() as c, caplog.at_level(logging.WARNING, logger="hwr_client.resolve"):
            res = c.resolve(identity(t="stall"), mode="preferred")
            assert res.outcome == "CANONICAL_FALLBACK", res.reason
            assert "pull from the registry failed" in res.reason and "no progress" in res.reason, res.reason
            assert any("no progress" in r.getMessage() and "canonical load" in r.getMessage()
                       for r in caplog.records), caplog.text
            res = c.resolve(identity(t="stall"), mode="required")
            assert res.outcome == "FAILED" and isinstance(res.error, Unavailable)
            assert "PullOnMiss: no progress" in str(res.error), res.error
            assert proxy.stalled.is_set()
            with pytest.raises(NotFound):  # nothing visible while the pull is held
                c.lookup(key)
    finally:
        proxy.stall.set()
        proxy.stall = None
    # Both callers gave up; the pull they started commits on its own.
    wait_for(lambda: stats(node).get('hwr_remote_transfers_total{op="pull",outcome="ok"}') == 1, "pull", node)
    with node.client() as c:
        res = c.resolve(identity(t="stall"), mode="required")
        assert res.outcome == "LOCAL_HIT", res.reason
        res.lease.close()
    gets = blob_gets(proxy.take())
    assert len(gets) == len(set(gets)) == len({f.blob for f in done_files(a, key)}) + 1, gets  # layers, config: once each
    assert os.listdir(os.path.join(node.root, "staging")) == []
    assert node.cli("verify", key).returncode == 0


def _resolve_worker(socket: str, ident: dict, out) -> None:
    """One worker process: resolve in preferred mode; a miss would call the
    canonical producer (reported, never run)."""
    import hwr_client

    try:
        with hwr_client.connect(socket) as c:
            res = c.resolve(ident, mode="preferred")
            out.put((os.getpid(), str(res.outcome), res.reason, "" if res.hit else "producer"))
            if res.hit:
                res.lease.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((os.getpid(), "ERROR", f"{type(exc).__name__}: {exc}", ""))


def test_eight_worker_processes_missing_one_key_cause_one_download(nodes, registry):
    reg, proxy = registry
    repo = "hwr/eight"
    a = nodes()
    key = publish(a, "eight")
    push(a, key, f"{proxy.host}/{repo}")
    node = nodes(repo, pull_on_miss=True, timeout_s=120.0)
    # forkserver: the heavy imports (torch, for the lease's views) happen
    # once in the server; the eight workers are forked from it.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["hwr_client.lease", "hwr_client.resolve"])
    out = ctx.Queue()
    proxy.take()
    # Every blob GET waits until all eight misses are in: then the seven
    # late ones surely join the first one's pull instead of finding it done.
    proxy.stall_digest, proxy.stall = "", threading.Event()
    procs = [ctx.Process(target=_resolve_worker, args=(node.socket, identity(t="eight"), out), daemon=True)
             for _ in range(8)]
    try:
        for p in procs:
            p.start()
        wait_for(lambda: stats(node).get("hwr_remote_pulls_joined_total") == 7, "seven joins", node, 120.0)
        proxy.stall.set()
        rows = [out.get(timeout=120) for _ in procs]
    finally:
        proxy.stall.set()
        proxy.stall = None
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
    assert len({r[0] for r in rows}) == 8, rows  # eight processes
    assert [r[1] for r in rows] == ["LOCAL_HIT"] * 8, rows
    assert [r[3] for r in rows if r[3]] == [], rows  # 0 producer calls
    gets = blob_gets(proxy.take())
    assert sorted(gets) == sorted({"sha256:" + f.blob for f in done_files(a, key)} | {_config_digest(a, key)})
    assert stats(node)['hwr_remote_transfers_total{op="pull",outcome="ok"}'] == 1


def _fill(path: str) -> None:
    """Writes ``path`` until its filesystem answers ENOSPC (every page taken)."""
    with open(path, "ab", buffering=0) as f:
        for block in (1 << 20, 1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc


def test_a_full_disk_is_resource_exhausted_and_nothing_is_left(make_daemon_fixture, tmp_path, registry, nodes):
    """A node whose root is a 16 MiB tmpfs. Free space below the artifact:
    refused before a byte is fetched. The disk filled while layers are in
    flight: the filesystem's own ENOSPC, RESOURCE_EXHAUSTED. Each time
    nothing is visible, no staging is left, the daemon keeps serving, and
    once space is freed the retry completes."""
    reg, proxy = registry
    root = str(tmp_path / "small")
    os.mkdir(root)
    if not shutil.which("mount"):
        pytest.skip("no mount binary (util-linux) to mount a small tmpfs for a real full disk")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", root], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for a real full disk (needs CAP_SYS_ADMIN): "
                    f"{mounted.stderr.strip() or mounted.returncode}")
    try:
        a = nodes()
        key = publish(a, "full", sample_tensors(blocks=2, width=512, seed=3))
        repo = f"{proxy.host}/hwr/full"
        push(a, key, repo)
        size = sum(f.size for f in done_files(a, key))
        assert 4 << 20 < size < 8 << 20  # fits the disk only when it is empty
        cfg = remote_config(str(tmp_path / "small.toml"), timeout_s=120.0)
        node = make_daemon_fixture("--config", cfg, root=root)
        filler = os.path.join(root, "filler")
        st = os.statvfs(root)
        with open(filler, "wb") as f:  # leaves 2 MiB free: less than the artifact
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - (2 << 20))
        with pytest.raises(ResourceExhausted, match="does not fit the disk"):
            pull(node, f"{repo}:{key}")
        nothing_left(node)
        os.unlink(filler)
        # The disk fills up while a layer is held at the registry.
        with a.client() as c:
            proxy.stall_digest = "sha256:" + c.lookup(key).files[0].blob
        proxy.stalled.clear()
        proxy.stall = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                pull(node, f"{repo}:{key}")
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        try:
            assert proxy.stalled.wait(60)
            _fill(filler)
        finally:
            proxy.stall.set()
            proxy.stall = None
        t.join(120)
        assert len(errors) == 1 and isinstance(errors[0], ResourceExhausted), errors
        assert "disk is full" in str(errors[0]), errors[0]
        nothing_left(node)
        with node.client() as c, pytest.raises(NotFound):  # still serving
            c.lookup(key)
        os.unlink(filler)
        assert pull(node, f"{repo}:{key}").key == key
        assert node.cli("verify", key).returncode == 0
        node.stop()
    finally:
        if subprocess.run(["umount", root], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", root], capture_output=True)  # a daemon still holds it: detach
