"""Pull on a miss through a real OCI registry: push after publish, single flight across worker processes, an unreachable or stalled registry, a full disk."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import threading
import time

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import NotFound, ResourceExhausted, Unavailable
from hwr_client.core.identity import Identity
from hwr_server.remote.registry import RegistryClient
from tests.conftest import identity, sample_tensors
from tests.support.oci_nodes import blob_gets, config_digest, done_files, nothing_left, publish, pull, push
from tests.support.oci_nodes import nodes, registry  # noqa: F401 - fixtures, used by name
from tests.support.oci_registry import free_port, remote_config


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
    assert sorted(gets) == sorted({"sha256:" + f.blob for f in done_files(a, key)} | {config_digest(a, key)})
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
        # The filesystem's ENOSPC, or the space check each arriving step of
        # the download makes first (capacity is admitted as bytes arrive).
        assert "disk is full" in str(errors[0]) or "does not fit the disk" in str(errors[0]), errors[0]
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
