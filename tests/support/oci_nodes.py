"""Fixtures and helpers of the push/pull tests: a real registry behind a counting proxy, daemons configured for it playing nodes (moved from tests/server/test_oci_pull.py)."""

from __future__ import annotations

import os

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from tests.conftest import identity, sample_tensors
from tests.support.oci_registry import Proxy, make_registry, remote_config
from hwr_server.remote.oci import digest_of
from tests.support.oci_registry import remote_config

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
             extra: tuple[str, ...] = (), timeout_s: float = 10.0, remote_extra: str = ""):
        cfg = remote_config(str(tmp_path / f"cfg-{len(os.listdir(tmp_path))}.toml"), registry=proxy.host,
                            repository=repo, pull_on_miss=pull_on_miss, layer_attempts=layer_attempts,
                            push_after_publish=push_after_publish, timeout_s=timeout_s, extra=remote_extra)
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


def config_digest(node, key: str) -> str:
    with node.client() as c:
        text = c.call(c.runtime.Lookup, pb.LookupRequest(key=key)).manifest_json
    return digest_of(text.encode("utf-8"))


def done_files(node, key: str):
    with node.client() as c:
        return c.lookup(key).files
