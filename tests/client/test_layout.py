"""The shared layout and plan modules: aligned safetensors files, strict
header parsing, block derivation and plan checks."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from hwr_client.core.errors import InvalidArgument
from hwr_client.core.layout import (
    ALIGN, MAX_HEADER_BYTES, TensorSpec, _printable, check_tensor_name, check_tensor_names, layout_file, parse_header,
)
from hwr_client.local import write_artifact
from hwr_client.core.plan import BlockSpec, check_plan, derive_blocks
from hwr_client.tensors import build_plan
from tests.conftest import identity, sample_tensors


def test_every_tensor_is_aligned_and_the_file_is_valid_safetensors(tmp_path):
    tensors = sample_tensors(blocks=3)
    plan = build_plan(identity(t="layout"), tensors, file_target_bytes=3000)
    manifest, paths = write_artifact(str(tmp_path), plan, tensors)
    for f, path in zip(manifest.files, paths):
        assert f.data_start % ALIGN == 0
        loaded = load_file(path)
        for t in manifest.tensors:
            if t.file == f.index:
                assert t.offset % ALIGN == 0
                assert torch.equal(loaded[t.name], tensors[t.name])
        with open(path, "rb") as fh:
            header = parse_header(fh, f.size)
        assert {e.name for e in header.tensors()} == {t.name for t in manifest.tensors if t.file == f.index}
    for b in manifest.blocks:
        assert manifest.tensor(b.tensors[0]).offset == b.begin


def test_padding_ranges_cover_the_gaps():
    lay = layout_file([TensorSpec("a", "U8", (3,)), TensorSpec("b", "F32", (5,)), TensorSpec("c", "BF16", (1,))])
    assert lay.tensor_offsets == (0, 64, 128)
    assert lay.padding_ranges() == [(3, 64), (84, 128)]
    assert lay.data_size == 130 and lay.data_start % ALIGN == 0


def _header_file(header: dict, data: bytes = b"") -> tuple[io.BytesIO, int]:
    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw)) + raw + data
    return io.BytesIO(blob), len(blob)


@pytest.mark.parametrize(
    "header, data, fragment",
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "expected 8"),
        ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, "unknown dtype"),
        ({"w": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3, "holes and overlaps"),
        ({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 5, "data region ends"),
        ({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, b"", "bad shape"),
        ({"w": {"shape": [2]}}, b"", "needs dtype"),
    ],
)
def test_parse_header_is_strict(header, data, fragment):
    f, size = _header_file(header, data)
    with pytest.raises(InvalidArgument, match=fragment):
        parse_header(f, size, what="x.safetensors")


def test_parse_header_refuses_huge_and_truncated_lengths():
    f = io.BytesIO(struct.pack("<Q", MAX_HEADER_BYTES + 1))
    with pytest.raises(InvalidArgument, match="limit"):
        parse_header(f, 8, what="big")
    with pytest.raises(InvalidArgument, match="truncated"):
        parse_header(io.BytesIO(b"\1\2"), 2, what="tiny")
    with pytest.raises(InvalidArgument, match="past the end"):
        parse_header(io.BytesIO(struct.pack("<Q", 50) + b"{}"), 10, what="short")


def test_blocks_are_derived_from_names_in_numeric_order():
    names = ["embed", "layers.10.w", "layers.2.w", "layers.2.b", "transformer_blocks.0.x", "norm"]
    assert derive_blocks(names) == [
        ("layers.2.", ["layers.2.w", "layers.2.b"]), ("layers.10.", ["layers.10.w"]),
        ("transformer_blocks.0.", ["transformer_blocks.0.x"]),
    ]


def test_plan_keeps_non_block_tensors_apart_and_blocks_whole():
    tensors = sample_tensors(blocks=4)
    plan = build_plan(identity(t="p"), tensors, file_target_bytes=2500)
    checked = check_plan(plan)
    assert plan.files[0].name == "base.safetensors"
    assert {t.name for t in plan.files[0].tensors} == {"embed.weight", "final_norm.weight"}
    for b in checked.blocks:
        names = {t.name for t in plan.files[b.file].tensors}
        assert set(b.tensors) <= names


def test_plan_rejects_a_block_split_across_positions():
    tensors = sample_tensors(blocks=2)
    plan = build_plan(identity(t="split"), tensors)
    b0 = plan.blocks[0]
    broken = BlockSpec(0, b0.prefix, (b0.tensors[0], plan.blocks[1].tensors[0]))
    import dataclasses

    with pytest.raises(InvalidArgument, match="adjacent"):
        check_plan(dataclasses.replace(plan, blocks=(broken,)))


# Names each rule of check_tensor_name refuses, and valid ones near them.
TRICKY_NAMES = [
    "", "a/b", "a\\b", "a\x00b", "a\nb", "a\x7fb", "a..b", "..", "a.", ".a", "__hwr.x", "__hwrx", "x.__hwr",
    "__metadata__", "__metadata__x", "_", "x" * 256, "x" * 257, "x" * 1024, "x" * 1025, "é" * 512, "é" * 513,
    "😀" * 256, "😀" * 257, 'q"uote', "sp ace", "ü", "\u2028", "\ud800", "a\u00adb", 5, None, b"x", ["x"],
]


def _verdict(fn, arg):
    try:
        fn(arg)
    except InvalidArgument as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("position", [0, 1, 3])
@pytest.mark.parametrize("odd", TRICKY_NAMES, ids=lambda n: repr(n)[:30])
def test_check_tensor_names_is_check_tensor_name_for_each(odd, position):
    """The bulk check accepts a list exactly when every name passes the rule,
    and otherwise raises the rule's error for the first name that fails."""
    names = ["blocks.0.w", "blocks.0.b", "final.norm"]
    names.insert(position, odd)
    first_bad = next((v for v in map(lambda n: _verdict(check_tensor_name, n), names) if v is not None), None)
    assert _verdict(check_tensor_names, names) == first_bad


def test_printable_is_isprintable():
    for c in range(0x3000):
        text = f"ab{chr(c)}cd"
        assert _printable(text) == text.isprintable(), hex(c)
    assert _printable("") and _printable("plain.ascii name~") and not _printable("a\x7f")


def _header(entries: dict) -> io.BytesIO:
    text = json.dumps(entries).encode()
    return io.BytesIO(struct.pack("<Q", len(text)) + text)


@pytest.mark.parametrize("shape, ok", [
    ([2**63 - 1, 0], True), ([2**63, 0], False), ([0, 2**62, 2**62], False), ([2**62, 1], True),
])
def test_shapes_are_bounded_by_int64_at_plan_and_in_headers(shape, ok):
    """Each dimension, the element count over the non-zero
    dimensions and the byte length are at most 2**63 - 1 (U8 here: bytes ==
    elements), in a plan and in a parsed header alike."""
    spec = TensorSpec("w", "U8", tuple(shape))
    nbytes = spec.nbytes
    f = _header({"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, nbytes]}})
    size = len(f.getvalue()) + nbytes
    if ok:
        assert spec.validate() is spec
        assert parse_header(f, size).entries[0].shape == tuple(shape)
    else:
        with pytest.raises(InvalidArgument, match=r"2\*\*63 - 1"):
            spec.validate()
        with pytest.raises(InvalidArgument, match=r"2\*\*63 - 1"):
            parse_header(f, size)
    # One byte per element more (U16) crosses the byte bound at 2**62 elements.
    with pytest.raises(InvalidArgument, match="byte length"):
        TensorSpec("w", "U16", (2**62,)).validate()
