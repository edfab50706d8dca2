"""Manifest parsing: the reference writer's manifest round-trips, and every
field a reader relies on is checked (a bad manifest is corruption)."""

import dataclasses
import hashlib
import json

import pytest

from hwr_client.core.errors import InvalidArgument
from hwr_client.core.identity import canonical_json
from hwr_client.local import write_artifact
from hwr_client.core.manifest import Manifest, content_digest
from hwr_client.tensors import build_plan
from tests.conftest import identity, sample_tensors


@pytest.fixture
def manifest_doc(tmp_path):
    manifest, _ = write_artifact(str(tmp_path), build_plan(identity(t="m"), sample_tensors()), sample_tensors())
    return json.loads(manifest.to_json())


def test_round_trip(manifest_doc):
    m = Manifest.from_json(json.dumps(manifest_doc))
    assert json.loads(m.to_json()) == manifest_doc


def test_content_digest_is_the_canonical_json_digest():
    rows = [("b", "BF16", (2, 3), "a" * 64), ("a", "F32", (), "b" * 64), ("ü", "U8", (0,), "c" * 64)]
    expected = hashlib.sha256(canonical_json(sorted([n, d, list(s), h] for n, d, s, h in rows))).hexdigest()
    assert content_digest(rows) == "sha256:" + expected
    assert content_digest(reversed(rows)) == content_digest(rows)


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d["tensors"][0].update(shape=[float(x) for x in d["tensors"][0]["shape"]]), "integers"),
    (lambda d: d["tensors"][0].update(nbytes=d["tensors"][0]["nbytes"] + 1), "does not fit"),
    (lambda d: d["tensors"][1].update(name=d["tensors"][0]["name"]), "duplicate tensor"),
    (lambda d: d.update(key="0" * 64), "does not match its identity"),
    (lambda d: d.update(content_digest="sha256:" + "0" * 64), "content_digest"),
    (lambda d: d["blocks"][0].update(index=5), "block 0"),
    (lambda d: d["files"][0].update(blob="XYZ"), "file 0"),
    (lambda d: d.update(format_version=3), "format"),
    (lambda d: d["tensors"][0].update(name="a/b"), "^m: tensor name 'a/b'"),
    (lambda d: d["tensors"][0].update(xxh3_128="A" * 32), "^m: tensor .* entry is malformed"),
])
def test_bad_fields_are_rejected(manifest_doc, mutate, needle):
    mutate(manifest_doc)
    with pytest.raises(InvalidArgument, match=needle):
        Manifest.from_json(json.dumps(manifest_doc), what="m")


def test_format_2_and_a_tensor_sha256_plan_round_trip_with_annotations():
    """The default manifest is format 2 (xxh3-128 per tensor); a plan asking
    for ``tensor_sha256`` (over the wire too) builds format 1 (SHA-256 per
    tensor). Both keep the annotations and read back equal."""
    from hwr_client.core.plan import build_manifest, check_plan, from_proto, to_proto

    ann = {"schema_version": 1, "data": {"who": "test"}}
    base = dataclasses.replace(build_plan(identity(t="fmt"), sample_tensors()), annotations=ann)
    for sha, version, width in ((False, 2, 32), (True, 1, 64)):
        plan = from_proto(to_proto(dataclasses.replace(base, tensor_sha256=sha)))
        assert plan.tensor_sha256 is sha
        checked = check_plan(plan)
        digests = {s.name: "ab" * (width // 2) for lay in checked.layouts for s in lay.tensors}
        m = build_manifest(checked, [("0" * 64, "0" * 32)] * len(checked.layouts), digests,
                           ["0" * 32] * len(checked.blocks))
        assert m.format_version == version and all(len(t.digest) == width for t in m.tensors)
        back = Manifest.from_json(m.to_json())
        assert back == m and back.annotations == ann and back.format_version == version
