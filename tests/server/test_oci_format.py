"""The OCI layout of an artifact (hwr_server.remote.oci) and the registry
client's parsing (references, credentials files, challenges): pure, no
registry."""

from __future__ import annotations

import base64
import json
import tempfile

import pytest

from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_client.core.manifest import Manifest
from hwr_client.local import write_artifact
from hwr_client.tensors import build_plan
from hwr_server.remote import oci as fmt
from hwr_server.remote.names import parse_challenge
from hwr_server.remote.registry import load_credentials, parse_reference
from tests.conftest import identity, sample_tensors


_MANIFESTS: dict[str, Manifest] = {}


def manifest(tag: str = "m") -> Manifest:
    """A real manifest of two or more files (written once per tag by the
    reference writer into a temp directory)."""
    if tag not in _MANIFESTS:
        with tempfile.TemporaryDirectory() as d:
            tensors = sample_tensors(blocks=2)
            _MANIFESTS[tag], _ = write_artifact(d, build_plan(identity(t=tag), tensors, file_target_bytes=1), tensors)
    return _MANIFESTS[tag]


def test_layout_round_trip_and_every_field():
    m = manifest()
    config = m.to_json().encode()
    raw = fmt.build_oci_manifest(m, config)
    doc = json.loads(raw)
    assert doc["schemaVersion"] == 2 and doc["mediaType"] == fmt.MANIFEST_MEDIA_TYPE
    assert doc["artifactType"] == fmt.ARTIFACT_TYPE
    assert doc["config"] == {"mediaType": fmt.CONFIG_MEDIA_TYPE, "digest": fmt.digest_of(config), "size": len(config)}
    assert [(x["digest"], x["size"], x["mediaType"]) for x in doc["layers"]] == [
        ("sha256:" + f.blob, f.size, fmt.LAYER_MEDIA_TYPE) for f in m.files]
    assert len(m.files) > 1
    assert [x["annotations"]["org.cncf.model.filepath"] for x in doc["layers"]] == [f.name for f in m.files]
    ann = doc["annotations"]
    assert ann["org.hwr.key"] == m.key and ann["org.hwr.contract"] == "tiny-dit@1"
    assert ann["org.hwr.layout"] == "tp0of1-sp1-none" and ann["org.hwr.producer"] == "example@1"
    assert ann["org.hwr.content_digest"] == m.content_digest and "org.opencontainers.image.created" in ann
    # Accepted by tag (the key) and by digest; the config gives the manifest back.
    oci = fmt.parse_oci_manifest(raw, what="r", content_type=fmt.MANIFEST_MEDIA_TYPE,
                                 expected_digest=fmt.digest_of(raw))
    assert fmt.check_config(oci, config, what="r", tag=m.key).key == m.key
    assert fmt.build_oci_manifest(m, config) == raw  # deterministic: the same push, the same digest


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(artifactType="application/vnd.other"), "artifactType"),
    (lambda d: d.update(mediaType="application/vnd.docker.distribution.manifest.v2+json"), "schemaVersion 2"),
    (lambda d: d["config"].update(mediaType="application/vnd.oci.image.config.v1+json"), "config: media type"),
    (lambda d: d["layers"][0].update(mediaType="application/vnd.oci.image.layer.v1.tar+gzip"), "layer 0"),
    (lambda d: d["layers"][0].update(digest="sha256:XYZ"), "digest"),
    (lambda d: d["layers"][1].update(size=-1), "size"),
    (lambda d: d.update(layers=[]), "non-empty"),
])
def test_a_manifest_that_is_not_ours_is_refused(change, match):
    m = manifest()
    doc = json.loads(fmt.build_oci_manifest(m, m.to_json().encode()))
    change(doc)
    with pytest.raises(FailedPrecondition, match=match):
        fmt.parse_oci_manifest(json.dumps(doc).encode(), what="r")


def test_config_and_layers_must_be_the_artifact():
    m = manifest()
    config = m.to_json().encode()
    raw = fmt.build_oci_manifest(m, config)
    oci = fmt.parse_oci_manifest(raw, what="r")
    with pytest.raises(FailedPrecondition, match="hash to"):
        fmt.parse_oci_manifest(raw, what="r", expected_digest="sha256:" + "0" * 64)
    with pytest.raises(FailedPrecondition, match="Content-Type"):
        fmt.parse_oci_manifest(raw, what="r", content_type="application/json")
    with pytest.raises(FailedPrecondition, match="config blob"):
        fmt.check_config(oci, config + b" ", what="r")
    other = manifest("other")
    with pytest.raises(FailedPrecondition, match="expected the tag"):
        fmt.check_config(oci, config, what="r", tag=other.key)
    # A config that is not an HWR manifest.
    junk = b'{"architecture": "amd64"}'
    bad = json.loads(raw)
    bad["config"].update(digest=fmt.digest_of(junk), size=len(junk))
    with pytest.raises(FailedPrecondition, match="not an HWR manifest"):
        fmt.check_config(fmt.parse_oci_manifest(json.dumps(bad).encode(), what="r"), junk, what="r")
    # Layers that are not its files.
    bad = json.loads(raw)
    bad["layers"].reverse()
    with pytest.raises(FailedPrecondition, match="layer 0"):
        fmt.check_config(fmt.parse_oci_manifest(json.dumps(bad).encode(), what="r"), config, what="r")
    bad["layers"] = bad["layers"][:1]
    with pytest.raises(FailedPrecondition, match="1 layers"):
        fmt.check_config(fmt.parse_oci_manifest(json.dumps(bad).encode(), what="r"), config, what="r")


def test_references():
    r = parse_reference("reg.example:5000/team/hwr:" + "a" * 64)
    assert (r.host, r.repository, r.tag, r.digest) == ("reg.example:5000", "team/hwr", "a" * 64, "")
    r = parse_reference("127.0.0.1:5000/hwr@sha256:" + "b" * 64)
    assert r.reference == "sha256:" + "b" * 64 and r.tag == ""
    assert parse_reference("localhost/hwr").reference == ""
    for bad in ("nohost", "reg/Upper", "reg/x:bad tag", "reg/x@sha256:short", "/x"):
        with pytest.raises(InvalidArgument):
            parse_reference(bad)


def test_credentials_file_and_challenges(tmp_path):
    path = tmp_path / "config.json"
    path.touch(0o600)  # a secret: other users may not read it (hwr_server.remote.credentials)
    path.write_text(json.dumps({"auths": {
        "a.example:5000": {"auth": base64.b64encode(b"user:pa:ss").decode()},
        "https://b.example": {"username": "u2", "password": "p2"}}}))
    assert load_credentials(str(path), "a.example:5000") == ("user", "pa:ss")
    assert load_credentials(str(path), "b.example") == ("u2", "p2")
    assert load_credentials(str(path), "c.example") is None
    path.write_text(json.dumps({"auths": {"a": {"auth": "!!"}}}))
    with pytest.raises(InvalidArgument, match="base64"):
        load_credentials(str(path), "a")
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_credentials(str(tmp_path / "missing.json"), "a")
    scheme, params = parse_challenge('Bearer realm="https://auth.example/token",service="reg",scope="repository:x:pull"')
    assert scheme == "bearer" and params == {"realm": "https://auth.example/token", "service": "reg",
                                             "scope": "repository:x:pull"}
    assert parse_challenge('Basic realm="r"')[0] == "basic"
