"""Push and pull through a real OCI registry (CNCF distribution,
``docker-registry``) with real daemons on separate roots playing nodes.

One registry and one counting proxy in front of it serve the module; each
test uses its own repository so they do not see each other's blobs.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import DataLoss, FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from hwr_client.core.identity import Identity
from hwr_client.core.manifest import Manifest, content_digest
from hwr_server.remote.oci import ARTIFACT_TYPE, MANIFEST_MEDIA_TYPE, build_oci_manifest, digest_of
from hwr_server.remote.registry import RegistryClient
from tests.conftest import identity, sample_tensors
from tests.support.oci_nodes import SECOND, blob_gets, config_digest, done_files, nothing_left, publish, pull, push, uploads
from tests.support.oci_nodes import nodes, registry  # noqa: F401 - fixtures, used by name
from tests.support.oci_registry import remote_config


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
    assert sorted(blob_gets(proxy.take())) == sorted({"sha256:" + f.blob for f in files1} | {config_digest(a, key1)})
    assert b.cli("verify", key1).returncode == 0
    # Pull of the second: only its new blobs come over the wire, with progress.
    events: list[pb.TransferProgress] = []
    with b.client() as c:
        done = c.transfer(c.admin.Pull, pb.PullRequest(reference=f"{repo}:{key2}"), progress=events.append)
    assert events and events[-1].bytes_done == events[-1].bytes_total == done.bytes_transferred
    assert [e.bytes_done for e in events] == sorted(e.bytes_done for e in events)
    got = blob_gets(proxy.take())
    assert sorted(g for g in got if g != config_digest(a, key2)) == sorted("sha256:" + h for h in new2)
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
    doc["tensors"][-1]["xxh3_128"] = "0" * 32
    doc["content_digest"] = content_digest((t["name"], t["dtype"], t["shape"], t["xxh3_128"]) for t in doc["tensors"])
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
