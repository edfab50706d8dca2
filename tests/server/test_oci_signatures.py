"""Signed artifacts across nodes (docs/trust.md), through the real registry
(Debian's docker-registry 2.8, which has no referrers API: the tag-schema
fallback is what is exercised): a signed push pulls on a node that trusts
the key; an unsigned, wrongly signed, forged or replayed signature is
refused with nothing stored; the signature is an OCI referrer that plain
HTTP and the ORAS SDK see; only trusted publishers' artifacts are pushed."""

from __future__ import annotations

import http.client
import json
import time

import oras.provider
import pytest

from hwr_client.core.errors import PermissionDenied, UntrustedPublisher
from hwr_server.remote import signatures
from hwr_server.remote.oci import MANIFEST_MEDIA_TYPE, digest_of
from hwr_server.remote.registry import RegistryClient
from hwr_server.remote.signing import check_payload, payload
from tests.conftest import identity
from tests.support.oci_nodes import nodes, registry  # noqa: F401 - fixtures, used by name
from tests.support.oci_nodes import nothing_left, publish, pull, push
from tests.support.oci_registry import remote_config
from tests.support.referrers_registry import ReferrersRegistry
from tests.support.trust import NOBODY, keys_toml, new_key, open_to_nobody, publish_as_nobody

INDEX = "application/vnd.oci.image.index.v1+json"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two signing keys: A (the fleet's, trusted) and B (anyone else's)."""
    d = tmp_path_factory.mktemp("keys")
    return {name: (str(d / f"{name}.key"), *new_key(str(d / f"{name}.key"))) for name in ("A", "B")}


def _http_get(host: str, path: str, accept: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, timeout=10)
    try:
        conn.request("GET", path, headers={"Accept": accept})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_signed_push_pulls_on_a_node_that_trusts_the_key(nodes, registry, keys):
    reg, proxy = registry
    repo = "hwr/signed"
    path_a, _, pub_a = keys["A"]
    a = nodes(repo, remote_extra=keys_toml(signing=path_a))
    key = publish(a, "signed")
    done = push(a, key, f"{proxy.host}/{repo}")
    assert done.signer == pub_a.id and done.signature_digest.startswith("sha256:")
    # Standard tooling sees the signature as a referrer of the manifest.
    # This registry has no referrers API (404), so the tag schema holds it:
    status, _ = _http_get(reg.host, f"/v2/{repo}/referrers/{done.manifest_digest}", INDEX)
    assert status == 404
    status, body = _http_get(reg.host, f"/v2/{repo}/manifests/sha256-{done.manifest_digest[7:]}", INDEX)
    assert status == 200
    listed = json.loads(body)["manifests"]
    assert [(d["digest"], d["artifactType"]) for d in listed] == [
        (done.signature_digest, signatures.SIGNATURE_ARTIFACT_TYPE)]
    oras_client = oras.provider.Registry(insecure=True)
    sig = oras_client.get_manifest(f"{reg.host}/{repo}@{done.signature_digest}")
    assert sig["subject"]["digest"] == done.manifest_digest
    assert sig["artifactType"] == signatures.SIGNATURE_ARTIFACT_TYPE
    assert sig["layers"][0]["annotations"][signatures.SIGNER_ANNOTATION] == pub_a.id
    index = oras_client.get_manifest(f"{reg.host}/{repo}:sha256-{done.manifest_digest[7:]}", allowed_media_type=[INDEX])
    assert index["manifests"][0]["digest"] == done.signature_digest
    # Another daemon that trusts A pulls it, and records who vouched for it.
    b = nodes(repo, remote_extra=keys_toml(trusted=(pub_a,)))
    proxy.take()
    got = pull(b, f"{proxy.host}/{repo}:{key}")
    assert got.key == key and got.signer == pub_a.id
    # What the check costs: four small GETs (the referrers API's 404, the
    # fallback index, the signature manifest, its payload), all before the
    # first layer.
    seen = [x.path for x in proxy.take() if x.method == "GET"]
    wanted = ("/referrers/", f"sha256-{done.manifest_digest[7:]}", done.signature_digest, sig["layers"][0]["digest"])
    checks = [i for i, path in enumerate(seen) if any(w in path for w in wanted)]
    layers = {lay["digest"] for lay in oras_client.get_manifest(f"{reg.host}/{repo}:{key}")["layers"]}
    first_layer = min(i for i, path in enumerate(seen) if path.rsplit("/", 1)[-1] in layers)
    before = [i for i in checks if i < first_layer]
    assert len(before) == 4, seen
    # After the commit, two more: the weights' compile artifacts are looked
    # up among the same referrers (the API's 404, the fallback index;
    # hwr_server.remote.companions). None is a compile artifact here.
    assert [seen[i].split("/")[-1][:7] for i in checks if i > first_layer] == ["sha256:", "sha256-"], seen
    with b.client() as c:
        hit = c.resolve(identity(t="signed"), mode="required")
        assert hit.outcome == "LOCAL_HIT" and f"signed by {pub_a.id}" in hit.publisher
        assert f"pulled from {proxy.host}/{repo}@{done.manifest_digest}" in hit.publisher
        hit.lease.close()
    # And on a miss: a required worker on an empty node that trusts A.
    miss = nodes(repo, pull_on_miss=True, remote_extra=keys_toml(trusted=(pub_a, keys["B"][2])))
    with miss.client() as c:
        hit = c.resolve(identity(t="signed"), mode="required")
        assert hit.outcome == "LOCAL_HIT" and pub_a.id in hit.publisher
        hit.lease.close()
    # Pushing again (nothing new to upload) signs again: one more referrer.
    again = push(a, key, f"{proxy.host}/{repo}")
    assert again.manifest_digest == done.manifest_digest and again.signature_digest
    status, body = _http_get(reg.host, f"/v2/{repo}/manifests/sha256-{done.manifest_digest[7:]}", INDEX)
    assert len(json.loads(body)["manifests"]) == (1 if again.signature_digest == done.signature_digest else 2)


def test_unsigned_wrongly_signed_forged_and_replayed_pulls_are_refused(nodes, registry, keys):
    reg, proxy = registry
    repo = "hwr/unsigned"
    path_a, priv_a, pub_a = keys["A"]
    path_b, priv_b, pub_b = keys["B"]
    plain = nodes(repo)  # pushes unsigned
    key = publish(plain, "unsigned")
    done = push(plain, key, f"{proxy.host}/{repo}")
    assert done.signer == "" and done.signature_digest == ""
    wrong = nodes("hwr/wrong", remote_extra=keys_toml(signing=path_b))
    wrong_key = publish(wrong, "wrong")
    assert push(wrong, wrong_key, f"{proxy.host}/hwr/wrong").signer == pub_b.id
    b = nodes(repo, pull_on_miss=True, remote_extra=keys_toml(trusted=(pub_a,)))

    def refused(ref: str, why: str) -> None:
        with pytest.raises(PermissionDenied, match=why):
            pull(b, ref)
        nothing_left(b)  # refused before any layer: nothing visible, no staging, no blob

    refused(f"{proxy.host}/{repo}:{key}", "registry lists none")
    refused(f"{proxy.host}/hwr/wrong:{wrong_key}", "not a trusted key")
    # Pull on a miss is refused the same way: preferred falls back, required fails.
    with b.client() as c:
        assert c.resolve(identity(t="unsigned"), mode="preferred").outcome == "CANONICAL_FALLBACK"
        failed = c.resolve(identity(t="unsigned"), mode="required")
        assert failed.outcome == "FAILED" and isinstance(failed.error, PermissionDenied)
    nothing_left(b)
    client = RegistryClient(reg.host, insecure=True)
    subject = done.manifest_digest
    raw, _ = client.get_manifest(repo, subject, limit=1 << 20)

    def attach(data: bytes, sig: bytes, signer: str) -> None:
        for blob in (signatures.EMPTY, data):
            client.put_bytes_blob(repo, digest_of(blob), blob)
        body = signatures.signature_manifest(subject, len(raw), data, sig, signer)
        assert client.put_referrer(repo, body, MANIFEST_MEDIA_TYPE) is False  # no referrers API here
        signatures.index_in_fallback(client, repo, subject, {
            "mediaType": MANIFEST_MEDIA_TYPE, "digest": digest_of(body), "size": len(body),
            "artifactType": signatures.SIGNATURE_ARTIFACT_TYPE, "annotations": {signatures.SIGNER_ANNOTATION: signer}})

    # Forged: claims to be A's, signed by B.
    data = payload(subject, key, int(time.time()))
    attach(data, priv_b.sign(data), pub_a.id)
    refused(f"{proxy.host}/{repo}:{key}", "does not verify")
    # Replayed: A's genuine signature of another manifest, attached to this one.
    other = payload(digest_of(b"another manifest"), key, int(time.time()))
    attach(other, priv_a.sign(other), pub_a.id)
    refused(f"{proxy.host}/{repo}:{key}", "signs another manifest")
    # A's genuine signature of this manifest, added later: now it pulls.
    signed = signatures.sign(client, repo, subject=raw, key=key, private=priv_a)
    assert signed.signer == pub_a.id
    assert pull(b, f"{proxy.host}/{repo}:{key}").signer == pub_a.id


def test_only_trusted_publishers_artifacts_are_pushed(nodes, registry, keys):
    reg, proxy = registry
    repo = "hwr/untrusted"
    a = nodes(repo, push_after_publish=True, extra=("--socket-group", "nogroup"),
              remote_extra=keys_toml(signing=keys["A"][0]))
    open_to_nobody(a)
    key = publish_as_nobody(a, identity(t="planted-push"))["keys"][0]
    # push_after_publish decides before it answers the publication: not pushed.
    assert f"not pushed, published by uid {NOBODY.pw_uid}" in a.log()
    with pytest.raises(UntrustedPublisher, match="only trusted publishers' artifacts are pushed"):
        push(a, key, f"{proxy.host}/{repo}")
    r = a.cli("push", key, f"{proxy.host}/{repo}")
    assert r.returncode == 4 and "UntrustedPublisher" in r.stderr and "does not trust" in r.stderr
    status, _ = _http_get(reg.host, f"/v2/{repo}/manifests/{key}", MANIFEST_MEDIA_TYPE)
    assert status == 404
    # Root's artifact on the same node is pushed (and signed) after its publication.
    own = publish(a, "root-push")
    deadline = time.monotonic() + 60
    while _http_get(reg.host, f"/v2/{repo}/manifests/{own}", MANIFEST_MEDIA_TYPE)[0] != 200:
        assert time.monotonic() < deadline, a.log()[-2000:]
        time.sleep(0.1)


def test_an_unfit_signing_key_fails_the_push_before_any_upload(nodes, registry, keys, tmp_path):
    reg, proxy = registry
    repo = "hwr/badkey"
    loose = tmp_path / "loose.key"
    loose.write_bytes(open(keys["A"][0], "rb").read())
    loose.chmod(0o644)
    a = nodes(repo, remote_extra=keys_toml(signing=str(loose)))
    key = publish(a, "badkey")
    proxy.take()
    with pytest.raises(Exception, match="mode 0644 lets others read or change it"):
        push(a, key, f"{proxy.host}/{repo}")
    assert not [s for s in proxy.take() if s.method in ("PUT", "POST", "PATCH")]


def test_a_daemon_with_a_bad_trusted_key_refuses_to_start(make_daemon_fixture, tmp_path):
    conf = remote_config(str(tmp_path / "bad.toml"), extra='trusted_keys = ["ssh-rsa AAAAB3NzaC1yc2E= x"]\n')
    d = make_daemon_fixture("--config", conf, start=False)
    d.start(wait=False)
    assert d.proc.wait(60) != 0
    assert "[remote] trusted_keys[0]: expected an OpenSSH Ed25519 public key line" in d.log()


def test_signature_payload_is_bound_to_the_manifest_and_key():
    good = payload("sha256:" + "a" * 64, "k" * 64, 1)
    assert check_payload(good, manifest_digest="sha256:" + "a" * 64, key="k" * 64) == ""
    assert "another manifest" in check_payload(good, manifest_digest="sha256:" + "b" * 64, key="k" * 64)
    assert "another manifest" in check_payload(good, manifest_digest="sha256:" + "a" * 64, key="j" * 64)
    forged = json.dumps({"type": "cosign", "manifest_digest": "sha256:" + "a" * 64, "key": "k" * 64}).encode()
    assert "not of type" in check_payload(forged, manifest_digest="sha256:" + "a" * 64, key="k" * 64)


def test_a_registry_with_the_referrers_api_indexes_the_signature_itself(keys):
    """The referrers API branch (OCI distribution 1.1): no fallback tag is
    written, and the signature is found through the API."""
    reg = ReferrersRegistry()
    try:
        client = RegistryClient(reg.host, insecure=True)
        _, priv_a, pub_a = keys["A"]
        subject = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE}).encode()
        client.put_manifest("hwr/api", "k" * 64, subject, MANIFEST_MEDIA_TYPE)
        signed = signatures.sign(client, "hwr/api", subject=subject, key="k" * 64, private=priv_a)
        assert not any(ref.startswith("sha256-") for ref in reg.manifests)  # indexed by the registry
        found = signatures.find(client, "hwr/api", digest_of(subject))
        assert [d["digest"] for d in found] == [signed.digest] and reg.referrer_gets == 1
        assert signatures.verify(client, "hwr/api", subject_digest=digest_of(subject), key="k" * 64,
                                 trusted={pub_a.id: pub_a}, what="t") == pub_a.id
        with pytest.raises(PermissionDenied, match="not a trusted key"):
            signatures.verify(client, "hwr/api", subject_digest=digest_of(subject), key="k" * 64,
                              trusted={keys["B"][2].id: keys["B"][2]}, what="t")
    finally:
        reg.close()
