"""Annotations: the opaque, versioned, size-limited object a plan carries
into its manifest (hwr_client.core.annotations), checked on the client, by
the real daemon on the wire, and when a manifest is read."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.annotations import MAX_ANNOTATIONS_BYTES, MAX_ANNOTATIONS_DEPTH, check_annotations
from hwr_client.core.errors import InvalidArgument
from hwr_client.core.manifest import Manifest
from hwr_client.core.plan import check_plan, from_proto, planned_manifest_bytes, to_proto
from hwr_client.tensors import build_plan
from tests.conftest import identity, sample_tensors
from tests.support.raw_publish import COMMIT, StatusCode, chunks, raw_publish

GOOD = {"schema_version": 1, "data": {"engine": {"kinds": {"a": ["parameter", "weight"]}, "n": 3, "ok": True,
                                                  "none": None, "text": "0.5"}}}


def _plan(annotations, tag="a"):
    return dataclasses.replace(build_plan(identity(t=tag), sample_tensors(blocks=1)), annotations=annotations)


@pytest.mark.parametrize(("doc", "field"), [
    ({"schema_version": 2, "data": {}}, "annotations.schema_version"),
    ({"schema_version": True, "data": {}}, "annotations.schema_version"),
    ({"schema_version": "1", "data": {}}, "annotations.schema_version"),
    ({"schema_version": 1}, "annotations: fields"),
    ({"schema_version": 1, "data": {}, "extra": 1}, "annotations: fields"),
    ({"schema_version": 1, "data": []}, "annotations.data"),
    ({"schema_version": 1, "data": {"x": {"y": 0.5}}}, "annotations.data.x.y"),
    ({"schema_version": 1, "data": {"x": [1, float("nan")]}}, "annotations.data.x[1]"),
    ({"schema_version": 1, "data": {"x": b"raw"}}, "annotations.data.x"),
    ([], "annotations: expected an object"),
])
def test_each_rule_is_refused_naming_the_field(doc, field):
    with pytest.raises(InvalidArgument, match=field.replace("[", r"\[").replace("]", r"\]")):
        check_annotations(doc)


def test_depth_and_size_limits_are_exact():
    deep = {"schema_version": 1, "data": {}}
    node = deep["data"]
    for _ in range(MAX_ANNOTATIONS_DEPTH - 1):
        node["k"] = {}
        node = node["k"]
    check_annotations(deep)  # exactly the limit
    node["k"] = {}
    with pytest.raises(InvalidArgument, match=f"deeper than {MAX_ANNOTATIONS_DEPTH}"):
        check_annotations(deep)
    envelope = len(json.dumps({"schema_version": 1, "data": {"s": ""}}, separators=(",", ":")))
    at_limit = {"schema_version": 1, "data": {"s": "x" * (MAX_ANNOTATIONS_BYTES - envelope)}}
    check_annotations(at_limit)
    over = {"schema_version": 1, "data": {"s": "x" * (MAX_ANNOTATIONS_BYTES - envelope + 1)}}
    with pytest.raises(InvalidArgument, match=f"exceeds the limit {MAX_ANNOTATIONS_BYTES}"):
        check_annotations(over)


def test_plan_carries_them_over_the_wire_into_the_manifest():
    plan = _plan(GOOD)
    msg = to_proto(plan)
    assert json.loads(msg.annotations_json) == GOOD
    assert from_proto(msg).annotations == GOOD
    checked = check_plan(plan)
    # The size estimate of the daemon's manifest counts them (exact, as before).
    from hwr_client.core.plan import build_manifest

    sha, xxh = "0" * 64, "0" * 32
    manifest = build_manifest(checked, [(sha, xxh)] * len(checked.layouts),
                              {s.name: xxh for lay in checked.layouts for s in lay.tensors},
                              [xxh] * len(checked.blocks))
    assert manifest.annotations == GOOD
    assert planned_manifest_bytes(checked) == len(manifest.to_json().encode("utf-8"))
    assert Manifest.from_json(manifest.to_json()) == manifest
    # No annotations: no field at all, the document is what it always was.
    bare = dataclasses.replace(manifest, annotations=None)
    assert "annotations" not in json.loads(bare.to_json())
    assert to_proto(dataclasses.replace(plan, annotations=None)).annotations_json == ""


def test_a_manifest_with_bad_annotations_is_refused():
    plan = _plan(GOOD)
    checked = check_plan(plan)
    from hwr_client.core.plan import build_manifest

    sha, xxh = "0" * 64, "0" * 32
    doc = json.loads(build_manifest(checked, [(sha, xxh)] * len(checked.layouts),
                                    {s.name: xxh for lay in checked.layouts for s in lay.tensors},
                                    [xxh] * len(checked.blocks)).to_json())
    for bad, field in (({"schema_version": 9, "data": {}}, "annotations.schema_version"),
                       (None, "annotations: expected an object")):
        doc["annotations"] = bad
        with pytest.raises(InvalidArgument, match=f"m: {field}"):
            Manifest.from_json(json.dumps(doc), what="m")


def test_the_daemon_stores_them_and_the_client_reads_them_back(daemon):
    tensors = sample_tensors(blocks=2)
    client = daemon.client()
    report = client.publish(identity(t="stored"), tensors, annotations=GOOD)
    assert report.manifest.annotations == GOOD
    assert client.lookup(report.key).annotations == GOOD
    with client.acquire(report.key) as lease:
        assert lease.manifest.annotations == GOOD
    # They are neither identity nor content: the content digest equals an
    # unannotated publication's of the same tensors.
    plain = client.publish(identity(t="plain"), tensors)
    assert plain.manifest.annotations is None
    assert plain.manifest.content_digest == report.manifest.content_digest


@pytest.mark.parametrize(("text", "field"), [
    ('{"schema_version":2,"data":{}}', "annotations.schema_version"),
    ('{"schema_version":1,"data":{"ratio":0.5}}', "annotations.data.ratio"),
    ('{"schema_version":1,"data":' + '{"k":' * 40 + "{}" + "}" * 41, "deeper than"),
    ("not json", "annotations: not valid JSON"),
    ('{"schema_version":1,"data":{"s":"' + "x" * MAX_ANNOTATIONS_BYTES + '"}}', "annotations"),
])
def test_the_daemon_refuses_bad_annotations_at_the_plan(daemon, text, field):
    plan = build_plan(identity(t=f"bad-{len(text)}-{text[:30]}"), sample_tensors(blocks=1))
    msg = to_proto(plan)
    msg.annotations_json = text  # past the client's own check: the daemon must refuse it too
    code, details = raw_publish(daemon.client(), [pb.PublishRequest(plan=msg), *chunks(plan, sample_tensors(blocks=1), 4096),
                                                  COMMIT])
    assert code is StatusCode.INVALID_ARGUMENT, details
    assert "publication plan: annotations" in details and field in details
    client = daemon.client()
    assert client.call(client.reader.ListArtifacts, pb.ListArtifactsRequest()).artifacts == []


def test_the_client_refuses_them_before_dialing(tmp_path):
    import hwr_client

    client = hwr_client.connect(str(tmp_path / "no-daemon.sock"))
    with pytest.raises(InvalidArgument, match="publication plan: annotations.schema_version"):
        client.publish(identity(t="x"), sample_tensors(blocks=1), annotations={"schema_version": 0, "data": {}})
