import json

import pytest

from hwr_client.core.errors import InvalidArgument
from hwr_client.core.identity import Identity, canonical_json
from tests.conftest import SAMPLE_IDENTITY

DOC = ('{"contract": {"name": "tiny-dit", "version": 1}, "sources": [{"name": "model.safetensors", '
       '"content_id": "sha256:' + "0" * 64 + '"}], "representation": {"dtype": "bfloat16"}, "layout": '
       '{"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"}, "producer": {"id": "example", '
       '"version": "1"}, "extra": {}}')


def test_issue_document_is_accepted_as_is():
    ident = Identity.from_json(DOC)
    assert len(ident.key) == 64
    assert Identity.from_dict(json.loads(DOC)).key == ident.key


def test_key_is_sha256_of_canonical_json():
    import hashlib

    ident = Identity.from_dict(SAMPLE_IDENTITY)
    assert ident.key == hashlib.sha256(canonical_json(ident.document)).hexdigest()
    assert b" " not in ident.canonical


def test_source_order_does_not_change_key():
    a = dict(SAMPLE_IDENTITY, sources=[{"name": "a", "content_id": "sha256:" + "1" * 64},
                                       {"name": "b", "content_id": "sha256:" + "2" * 64}])
    b = dict(a, sources=list(reversed(a["sources"])))
    assert Identity.from_dict(a).key == Identity.from_dict(b).key


@pytest.mark.parametrize("field,value", [
    ("layout", {"tp_rank": 1, "tp_size": 2, "sp_size": 1, "sp_backend": "none"}),
    ("representation", {"dtype": "float16"}),
    ("producer", {"id": "example", "version": "2"}),
    ("extra", {"quant": "none"}),
    ("contract", {"name": "tiny-dit", "version": 2}),
])
def test_every_byte_relevant_field_changes_key(field, value):
    assert Identity.from_dict(dict(SAMPLE_IDENTITY, **{field: value})).key != Identity.from_dict(SAMPLE_IDENTITY).key


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d.update(unknown=1), "unknown field"),
    (lambda d: d["contract"].update(version="1"), "contract.version"),
    (lambda d: d["contract"].update(version=True), "contract.version"),
    (lambda d: d["layout"].update(dp_rank=0), "unknown field"),
    (lambda d: d["layout"].update(tp_rank=1), "tp_rank"),
    (lambda d: d["sources"][0].update(content_id="sha256:XYZ"), "content_id"),
    (lambda d: d["extra"].update(scale=0.5), "floats"),
    (lambda d: d["representation"].update(dtype="bf16"), "representation.dtype"),
    (lambda d: d.pop("producer"), "missing field"),
    (lambda d: d.update(sources=[]), "non-empty list"),
])
def test_bad_documents_name_the_field(mutate, needle):
    doc = json.loads(json.dumps(SAMPLE_IDENTITY))
    mutate(doc)
    with pytest.raises(InvalidArgument, match=needle):
        Identity.from_dict(doc)


def test_nan_and_garbage_json_rejected():
    with pytest.raises(InvalidArgument):
        Identity.from_json(DOC.replace('"extra": {}', '"extra": {"x": NaN}'))
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        Identity.from_json("{")
