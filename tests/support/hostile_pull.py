"""Fixtures and helpers of the hostile-registry tests
(tests/server/test_hostile_registry_*.py) and bench/hostile.py's pull
cases: a source daemon whose store provides real artifacts' bytes, the
hostile registry serving them, daemons configured for it, and the daemon's
peak RSS, threads and descriptors."""

from __future__ import annotations

import os
import threading
from collections import Counter

import grpc
import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import from_rpc_error
from tests.conftest import identity, sample_tensors
from tests.support.daemon import cleanup, make_daemon
from tests.support.hostile_registry import HostileRegistry, registry_config, stored_artifact

MiB = 1 << 20
REPO = "hwr/x"


class Source:
    """A daemon that publishes the artifacts a hostile registry serves."""

    def __init__(self, tmp_dir):
        self.daemon = make_daemon(tmp_dir).start()

    def artifact(self, tag: str, tensors=None, **publish) -> tuple[str, bytes, dict[str, bytes]]:
        """(key, manifest.json, blobs) of a fresh publication."""
        with self.daemon.client() as c:
            key = c.publish(identity(hostile=tag), sample_tensors() if tensors is None else tensors, **publish).key
        config, blobs = stored_artifact(self.daemon.root, key)
        return key, config, blobs

    def close(self) -> None:
        cleanup(self.daemon)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    s = Source(tmp_path_factory.mktemp("source"))
    yield s
    s.close()


@pytest.fixture
def hostile():
    reg = HostileRegistry()
    yield reg
    reg.close()


def node_for(make_daemon_fixture, tmp_path, registry: str, *, name: str = "node", https: bool = False,
             ca_file: str = "", pull_on_miss: bool = False, extra: dict | None = None, top: dict | None = None,
             args: tuple[str, ...] = ()):
    """A daemon whose [remote] is ``registry`` (plain HTTP unless ``https``);
    ``extra``: more [remote] keys; ``top``: top-level keys."""
    cfg = registry_config(str(tmp_path / f"{name}.toml"), registry, https=https, ca_file=ca_file,
                          pull_on_miss=pull_on_miss, extra={"timeout_s": 5.0, "layer_attempts": 2, **(extra or {})},
                          top=top)
    return make_daemon_fixture("--config", cfg, *args, root=str(tmp_path / f"{name}-root"))


def pull(node, ref: str, *, timeout: float = 120.0) -> pb.TransferDone:
    """``hwr pull REF`` on the admin socket, the whole call bounded by
    ``timeout`` (a daemon that hangs fails the test with DEADLINE_EXCEEDED
    instead of hanging it)."""
    return _transfer(node, "admin", "Pull", pb.PullRequest(reference=ref), timeout)


def pull_on_miss(node, key: str, *, timeout: float = 120.0) -> pb.TransferDone:
    """PullOnMiss on the runtime socket, bounded by ``timeout``."""
    return _transfer(node, "runtime", "PullOnMiss", pb.PullOnMissRequest(key=key), timeout)


def _transfer(node, stub: str, method: str, request, timeout: float) -> pb.TransferDone:
    with node.client() as c:
        try:
            for ev in getattr(getattr(c, stub), method)(request, timeout=timeout):
                if ev.WhichOneof("kind") == "done":
                    return ev.done
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
    raise AssertionError(f"{method}: the stream ended without done")


def peak_rss_mib(daemon) -> int:
    """The daemon's peak resident set (VmHWM), MiB."""
    return _status(daemon)["VmHWM"] // 1024


def rss_mib(daemon) -> int:
    return _status(daemon)["VmRSS"] // 1024


def threads(daemon) -> int:
    return len(os.listdir(f"/proc/{daemon.proc.pid}/task"))


def fds(daemon) -> int:
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def _status(daemon) -> dict[str, int]:
    out = {}
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[name] = int(value.split()[0])
    return out


def staging_bytes(daemon) -> int:
    """Bytes the daemon's staging holds on disk (allocated blocks, so a
    preallocation counts before a byte is written)."""
    total = 0
    for dirpath, _, files in os.walk(os.path.join(daemon.root, "staging")):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def nothing_visible(node) -> None:
    assert os.listdir(os.path.join(node.root, "staging")) == []
    assert os.listdir(os.path.join(node.root, "artifacts")) == []


__all__ = ["MiB", "REPO", "Source", "fds", "hostile", "node_for", "nothing_visible", "peak_rss_mib", "pull",
           "pull_on_miss", "rss_mib", "source", "staging_bytes", "threads"]


def pull_on_miss_calls(node, keys: list[str], timeout: float, parallel: int = 40, codes: Counter | None = None) -> Counter:
    """One PullOnMiss per key, ``parallel`` at a time from this process; the status
    codes they ended with (DEADLINE_EXCEEDED: the caller gave up, which
    cancels the call), counted into ``codes`` as they end."""
    codes = Counter() if codes is None else codes
    lock = threading.Lock()
    todo = list(keys)

    def worker() -> None:
        with node.client() as c:
            while True:
                with lock:
                    if not todo:
                        return
                    key = todo.pop()
                try:
                    for _ in c.runtime.PullOnMiss(pb.PullOnMissRequest(key=key), timeout=timeout):
                        pass
                    code = "OK"
                except grpc.RpcError as err:
                    code = err.code().name
                with lock:
                    codes[code] += 1

    workers = [threading.Thread(target=worker) for _ in range(parallel)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(300)
    return codes
