"""Compile artifacts travel with their weights (hwr_server.remote.companions)
through the real registry (Debian's docker-registry 2.8: the referrers tag
schema) and a registry with the referrers API: a push of weights carries
their compile artifacts as referrers (subject = the weights' manifest), a
pull of weights brings those for the node's devices, explicitly and on a
worker's miss. The payloads here are synthetic compile artifacts (no
compile); test_compile_artifacts.py runs the real one across two daemons."""

from __future__ import annotations

import http.client
import json

import torch

from hwr_client.core._proto import hwr_pb2 as pb

from hwr_client.core.compile_link import target_of
from hwr_client.core.identity import Identity
from hwr_server.remote import companions
from hwr_server.remote.oci import MANIFEST_MEDIA_TYPE, build_oci_manifest, digest_of
from hwr_server.remote.registry import RegistryClient
from tests.conftest import identity
from tests.support.oci_nodes import nodes, registry  # noqa: F401 - fixtures, used by name
from tests.support.oci_nodes import publish, pull, push
from tests.support.referrers_registry import ReferrersRegistry

INDEX = "application/vnd.oci.image.index.v1+json"
CPU = {"kind": "cpu", "capability": "avx512", "name": "x86_64", "runtime": ""}
H200 = {"kind": "cuda", "capability": "9.0", "name": "NVIDIA H200", "runtime": "cuda 12.8"}


def compile_doc(weights_key: str, device: dict, tag: str = "") -> dict:
    doc = identity(t=tag)
    doc["contract"] = {"name": "torch-compile", "version": 1}
    doc["sources"] = [{"name": "weights", "content_id": "sha256:" + weights_key}]
    doc["extra"] = {"model": {"name": "transformers:LlamaForCausalLM", "library_version": "x"}, "device": device,
                    "tag": tag}
    return doc


def publish_compile(node, weights_key: str, device: dict, tag: str = "") -> str:
    entries = {"f:fxgraph:ab:entry": torch.arange(64, dtype=torch.uint8),
               "f:3z:c3z.main.so": torch.full((32,), 7, dtype=torch.uint8)}
    with node.client() as c:
        return c.publish(compile_doc(weights_key, device, tag), entries, blocks=[]).key


def keys_of(node) -> set[str]:
    with node.client() as c:
        return {a.key for a in c.call(c.reader.ListArtifacts, pb.ListArtifactsRequest()).artifacts}


def get(host: str, path: str, accept: str = MANIFEST_MEDIA_TYPE) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, timeout=10)
    try:
        conn.request("GET", path, headers={"Accept": accept})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_weights_push_carries_compile_referrers_and_pull_takes_the_nodes_devices(nodes, registry):
    reg, proxy = registry
    repo = "hwr/cc"
    a = nodes(repo)
    weights = publish(a, "weights")
    other = publish(a, "other-weights")
    cpu, cuda = publish_compile(a, weights, CPU), publish_compile(a, weights, H200)
    stray = publish_compile(a, other, CPU)  # belongs to other weights: not pushed with these
    done = push(a, weights, f"{proxy.host}/{repo}")
    # Each compile artifact is under its own tag and names the weights' manifest as its subject.
    for key in (cpu, cuda):
        status, body = get(reg.host, f"/v2/{repo}/manifests/{key}")
        assert status == 200
        doc = json.loads(body)
        assert doc["subject"] == {"mediaType": MANIFEST_MEDIA_TYPE, "digest": done.manifest_digest,
                                  "size": doc["subject"]["size"]}
        assert doc["annotations"][companions.WEIGHTS_ANNOTATION] == weights
    assert get(reg.host, f"/v2/{repo}/manifests/{stray}")[0] == 404
    # This registry has no referrers API: the tag schema's index lists them, device by device.
    status, body = get(reg.host, f"/v2/{repo}/manifests/sha256-{done.manifest_digest[7:]}", INDEX)
    assert status == 200
    listed = {d["annotations"]["org.hwr.key"]: d["annotations"][companions.DEVICE_ANNOTATION]
              for d in json.loads(body)["manifests"]}
    assert listed == {cpu: "cpu:avx512", cuda: "cuda:9.0"}
    # A CPU node pulling the weights gets the CPU kernels only.
    b = nodes(repo, remote_extra='compile_devices = ["cpu"]\n')
    pull(b, f"{proxy.host}/{repo}:{weights}")
    assert keys_of(b) == {weights, cpu}
    rows = {r["key"]: r for r in json.loads(b.cli("ls", "--json", check=True).stdout)}
    assert rows[cpu]["belongs_to"]["weights_key"] == weights and rows[weights]["belongs_to"] is None
    shown = json.loads(b.cli("inspect", cpu, "--json", check=True).stdout)["compile"]
    assert shown["belongs_to"] == {"weights_key": weights, "config_id": "", "device": "cpu:avx512",
                                   "model": "transformers:LlamaForCausalLM"}
    assert "compiled for       weights " + weights[:16] in b.cli("inspect", cpu, check=True).stdout
    # A node with the default (every device) that misses the weights at a
    # worker's resolve pulls them and both compile artifacts.
    c = nodes(repo, pull_on_miss=True)
    with c.client() as client:
        res = client.resolve(identity(t="weights"), mode="required")
        assert res.hit, res.reason
        res.lease.close()
    assert keys_of(c) == {weights, cpu, cuda}
    # And a node that asks for none gets the weights alone.
    d = nodes(repo, remote_extra="compile_devices = []\n")
    pull(d, f"{proxy.host}/{repo}:{weights}")
    assert keys_of(d) == {weights}


def test_a_compile_artifact_pushed_alone_names_the_manifest_its_weights_will_push(nodes, registry):
    """push_after_publish pushes a worker's compile artifact on its own, often
    before (or without) its weights: the subject is computed from the
    weights' manifest in the store, the bytes their own push sends."""
    reg, proxy = registry
    repo = "hwr/alone"
    a = nodes(repo)
    weights = publish(a, "w-alone")
    cpu = publish_compile(a, weights, CPU, tag="alone")
    push(a, cpu, f"{proxy.host}/{repo}")
    subject = json.loads(get(reg.host, f"/v2/{repo}/manifests/{cpu}")[1])["subject"]["digest"]
    assert get(reg.host, f"/v2/{repo}/manifests/{weights}")[0] == 404  # not pushed yet
    assert push(a, weights, f"{proxy.host}/{repo}").manifest_digest == subject
    b = nodes(repo)
    pull(b, f"{proxy.host}/{repo}:{weights}")
    assert keys_of(b) == {weights, cpu}


def test_a_registry_with_the_referrers_api_indexes_compile_artifacts_itself():
    reg = ReferrersRegistry()
    try:
        client = RegistryClient(reg.host, insecure=True)
        weights = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "n": 1}).encode()
        client.put_manifest("hwr/api", "w" * 64, weights, MANIFEST_MEDIA_TYPE)
        subject = {"mediaType": MANIFEST_MEDIA_TYPE, "digest": digest_of(weights), "size": len(weights)}
        found = []
        for device in (CPU, H200):
            ident = Identity.from_dict(compile_doc("ab" * 32, device))
            target = target_of(ident)
            assert target is not None
            notes = {companions.DEVICE_ANNOTATION: target.device, companions.WEIGHTS_ANNOTATION: "ab" * 32,
                     "org.hwr.key": ident.key, "org.hwr.contract": companions.COMPILE_TAG}
            oci = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE,
                              "artifactType": "application/vnd.hwr.artifact.v1", "subject": subject,
                              "annotations": notes}, sort_keys=True).encode()
            client.put_manifest("hwr/api", ident.key, oci, MANIFEST_MEDIA_TYPE)
            assert companions.index_referrer(client, "hwr/api", oci, subject, notes) == "referrers API"
            found.append((ident.key, digest_of(oci)))
        assert not any(ref.startswith("sha256-") for ref in reg.manifests)  # no fallback index written
        assert companions.find(client, "hwr/api", digest_of(weights), ["cuda"]) == [found[1]]
        assert sorted(companions.find(client, "hwr/api", digest_of(weights), ["*"])) == sorted(found)
        assert companions.find(client, "hwr/api", digest_of(weights), ["cuda:8.0"]) == []
    finally:
        reg.close()


def test_weights_manifests_are_unchanged_by_the_compile_fields(nodes):
    """A weight artifact's OCI manifest has no subject and no compile
    annotations: what earlier daemons pushed is what this one pushes."""
    a = nodes("hwr/same")
    weights = publish(a, "same")
    with a.client() as c:
        manifest = c.lookup(weights)
        text = c.call(c.runtime.Lookup, pb.LookupRequest(key=weights)).manifest_json
    assert companions.annotations_of(manifest) == {}
    assert build_oci_manifest(manifest, text.encode()) == build_oci_manifest(manifest, text.encode(), subject=None,
                                                                            extra_annotations={})
