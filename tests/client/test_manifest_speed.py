"""The warm-start code paths give exactly what the plain rules give.

``Manifest.from_json`` has one validator, written for speed (names and hashes
checked in bulk, entries made without the dataclass ``__init__``, digest rows
written directly). Every document, good or bad, must come out as the plain
full check (:func:`reference_from_doc`, the validator as it was before it was
made fast, kept here as the specification) makes it: the same manifest, or
the same error. ``MappedArtifact.tensors`` builds each view with one
``as_strided`` call: each must be the view the slice construction builds
(same memory, dtype, shape, strides), for every dtype, 0-dim and zero-size
tensors included; anything else takes the slice construction, errors
included.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import pickle
import re

import pytest
import torch

from hwr_client.core.errors import InvalidArgument
from hwr_client.core.identity import Identity
from hwr_client.core.layout import DTYPE_SIZES, check_tensor_name
from hwr_client.tensors import TORCH_DTYPES
from hwr_client.local import write_artifact
from hwr_client.core.manifest import BlockEntry, FileEntry, Manifest, TensorEntry, content_digest
from hwr_client.mapping import MappedArtifact
from hwr_client.tensors import build_plan
from tests.conftest import identity

SHAPES = [(), (0,), (3,), (2, 3), (1, 5), (5, 1), (2, 0, 3), (0, 4), (3, 0), (2, 3, 1, 4), (1, 1), (1, 2, 2, 3)]


def all_dtype_tensors() -> dict[str, torch.Tensor]:
    """Every dtype at every shape in SHAPES, in blocks, plus non-block
    tensors with unusual (valid) names; the first file ends with a
    zero-size tensor."""
    g = torch.Generator().manual_seed(7)
    out = {}

    def make(dtype: torch.dtype, itemsize: int, shape: tuple[int, ...]) -> torch.Tensor:
        raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=g)
        return raw.view(dtype).reshape(shape)

    out["embed.ü weight"] = make(torch.float32, 4, (3, 5))
    out["__embed.😀" * 3] = make(torch.bfloat16, 2, (7,))
    out["x" * 200] = make(torch.uint8, 1, (3,))
    for b, (name, dtype, itemsize) in enumerate((n, TORCH_DTYPES[n], s) for n, s in DTYPE_SIZES.items()):
        for i, shape in enumerate(SHAPES):
            out[f"blocks.{b}.{name.lower()}_{i}"] = make(dtype, itemsize, shape)
    out["final.empty"] = make(torch.float64, 8, (0, 2))
    return out


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tensors = all_dtype_tensors()
    plan = build_plan(identity(t="manifest-speed"), tensors, file_target_bytes=2048)
    manifest, paths = write_artifact(str(tmp_path_factory.mktemp("art")), plan, tensors)
    return manifest, paths


def v1_document(manifest: Manifest, paths: list[str]) -> dict:
    """The same artifact as a format-1 document: each tensor's digest is the
    SHA-256 of its bytes (what daemons wrote before format 2)."""
    doc = json.loads(manifest.to_json())
    doc["format_version"] = 1
    for t in doc["tensors"]:
        with open(paths[t["file"]], "rb") as f:
            f.seek(t["offset"])
            t["sha256"] = hashlib.sha256(f.read(t["nbytes"])).hexdigest()
        del t["xxh3_128"]
    refresh_digest(doc)
    return doc


@pytest.fixture(params=[2, 1], ids=["format-2", "format-1"])
def doc(artifact, request):
    """The artifact's manifest document in each format the reader accepts."""
    return json.loads(artifact[0].to_json()) if request.param == 2 else v1_document(*artifact)


def digest_key(doc: dict) -> str:
    """A tensor entry's digest field in ``doc``'s format."""
    return "sha256" if doc.get("format_version") == 1 else "xxh3_128"


_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")  # \Z: a trailing newline is refused
_HEX32 = re.compile(r"^[0-9a-f]{32}\Z")


def reference_from_doc(doc: dict, what: str) -> Manifest:
    """The full check, one rule at a time (Manifest._from_doc as it was,
    reading format 1 and format 2)."""
    version = doc.get("format_version")
    if doc.get("format") != "hwr-manifest" or type(version) is not int or version not in (1, 2):
        raise InvalidArgument(f"{what}: expected format 'hwr-manifest' version 1 or 2")
    identity = Identity.from_dict(doc["identity"])
    if identity.key != doc["key"]:
        raise InvalidArgument(f"{what}: key {doc['key']!r} does not match its identity (expected {identity.key})")
    files = tuple(FileEntry(**f) for f in doc["files"])
    if not files:
        raise InvalidArgument(f"{what}: expected at least one file")
    for i, f in enumerate(files):
        if f.index != i or not _HEX64.match(f.blob) or not _HEX32.match(f.xxh3_128) or f.size <= 0:
            raise InvalidArgument(f"{what}: file {i} entry is malformed: {f}")
    key, hex_digest = ("sha256", _HEX64) if version == 1 else ("xxh3_128", _HEX32)
    tensors = tuple(
        TensorEntry(t["name"], t["file"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"],
                    t[key] if version == 1 else "", "" if version == 1 else t[key])
        for t in doc["tensors"]
    )
    if not tensors:
        raise InvalidArgument(f"{what}: expected at least one tensor")
    seen = set()
    for t in tensors:
        check_tensor_name(t.name)
        if t.name in seen:
            raise InvalidArgument(f"{what}: duplicate tensor {t.name!r}")
        seen.add(t.name)
        if t.dtype not in DTYPE_SIZES or not (0 <= t.file < len(files)) or not hex_digest.match(t.digest):
            raise InvalidArgument(f"{what}: tensor {t.name!r} entry is malformed")
        if not all(type(d) is int and d >= 0 for d in t.shape):
            raise InvalidArgument(f"{what}: tensor {t.name!r} shape {list(t.shape)} must hold integers >= 0")
        size = DTYPE_SIZES[t.dtype]
        for d in t.shape:
            size *= d
        f = files[t.file]
        if size != t.nbytes or t.offset < f.data_start or t.offset + t.nbytes > f.size:
            raise InvalidArgument(f"{what}: tensor {t.name!r} range {t.offset}+{t.nbytes} does not fit file {t.file}")
    blocks = tuple(
        BlockEntry(b["index"], b["prefix"], b["file"], b["begin"], b["end"], b["xxh3_128"], tuple(b["tensors"]))
        for b in doc["blocks"]
    )
    for i, b in enumerate(blocks):
        if b.index != i or not (0 <= b.file < len(files)) or not (0 <= b.begin <= b.end <= files[b.file].size):
            raise InvalidArgument(f"{what}: block {i} entry is malformed")
        if not _HEX32.match(b.xxh3_128) or not b.tensors or any(n not in seen for n in b.tensors):
            raise InvalidArgument(f"{what}: block {i} entry is malformed")
    digest = content_digest((t.name, t.dtype, t.shape, t.digest) for t in tensors)
    if digest != doc["content_digest"]:
        raise InvalidArgument(f"{what}: content_digest {doc['content_digest']!r}, expected {digest} from its tensors")
    created = doc["created_unix"]
    if isinstance(created, bool) or not isinstance(created, int):
        raise InvalidArgument(f"{what}: created_unix must be an integer")
    return Manifest(doc["key"], identity, digest, created, files, tensors, blocks, format_version=version)


def reference_from_json(text: str, what: str = "m") -> Manifest:
    """Manifest.from_json with the full check of :func:`reference_from_doc`."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{what}: not valid JSON ({exc})") from None
    try:
        return reference_from_doc(doc, what)
    except InvalidArgument:
        raise
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise InvalidArgument(f"{what}: malformed ({type(exc).__name__}: {exc})") from None


def outcome(fn, *args):
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 - the error is the outcome
        return ("error", type(exc), str(exc))
    # repr tells 1 from True and 1.0 where == would not.
    return ("ok", repr(result), result)


def refresh_digest(doc: dict) -> None:
    """Sets content_digest to what the tensors give, where they give one, so
    that a mutation reaches the checks after the digest's."""
    try:
        key = digest_key(doc)
        doc["content_digest"] = content_digest((t["name"], t["dtype"], t["shape"], t[key]) for t in doc["tensors"])
    except Exception:  # noqa: BLE001, S110 - leave it; the mutation fails earlier
        pass


def test_a_valid_manifest_equals_the_full_check(artifact, doc):
    manifest, _ = artifact
    fast = Manifest.from_json(json.dumps(copy.deepcopy(doc)), what="m")
    assert fast is not None
    full = reference_from_doc(copy.deepcopy(doc), "m")
    assert fast == full
    assert fast.format_version == doc["format_version"] and (doc["format_version"] == 1 or fast == manifest)
    assert repr(fast) == repr(full)
    assert fast.to_json() == full.to_json() == json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    assert Manifest.from_json(fast.to_json()) == fast
    for cls, got, want in [(TensorEntry, fast.tensors, full.tensors), (BlockEntry, fast.blocks, full.blocks),
                           (FileEntry, fast.files, full.files)]:
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert type(a) is cls and dataclasses.is_dataclass(a)
            assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
            assert dataclasses.asdict(a) == dataclasses.asdict(b)
            assert list(vars(a)) == list(vars(b)) == [f.name for f in dataclasses.fields(cls)]
            assert [type(v) for v in vars(a).values()] == [type(v) for v in vars(b).values()]
            assert pickle.loads(pickle.dumps(a)) == a
            assert dataclasses.replace(a) == a
            with pytest.raises(dataclasses.FrozenInstanceError):
                a.index = 0  # type: ignore[misc]


def _set(path, value):
    """A mutation setting doc[path...] = value."""
    def mutate(d):
        target = d
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value
    return mutate


def _delete(path):
    def mutate(d):
        target = d
        for p in path[:-1]:
            target = target[p]
        del target[path[-1]]
    return mutate


def _zero_dim(doc: dict) -> dict:
    return next(t for t in doc["tensors"] if t["shape"] == [])


def _tensor_names():
    return ["", "a/b", "a\\b", "a\x00b", "a\nb", "a\tb", "a\x7fb", "a..b", "..", ".a.", "a.", "__hwr.x", "__hwrx",
            "x.__hwr", "__metadata__", "__meta", "_", "x" * 256, "x" * 257, "x" * 1024, "x" * 1025, "é" * 300,
            "é" * 513, "😀" * 256, "😀" * 257, 'q"uote', '"', "sp ace", " ", "ü", "\u2028", "\ud800", "a\u00adb", 5,
            None, ["x"], True, 1.5, {}]


CASES = (
    [(f"name {n!r}"[:40], _set(("tensors", 1, "name"), n)) for n in _tensor_names()]
    + [(f"file {v!r}", _set(("tensors", 1, "file"), v)) for v in [True, False, 1.0, 0.0, -1, 99, "0", None, [0]]]
    + [(f"dtype {v!r}", _set(("tensors", 1, "dtype"), v)) for v in ["F33", "f32", 5, ["F32"], None, True]]
    + [(f"shape {v!r}", _set(("tensors", 0, "shape"), v))
       for v in [[3.0, 5], [3, 5.0], [True, 5], [-3, -5], [15], [5, 3], [3, 5, 1], [[3], 5], "", {}, None, 15, "35"]]
    # Ids by position, not repr: a lambda's repr holds its address, and
    # pytest-xdist needs every worker to collect the same ids.
    + [(f"offset {i}", lambda d, v=v: d["tensors"][0].update(offset=v(d["tensors"][0]["offset"])))
       for i, v in enumerate([float, lambda o: o + 1, lambda o: o + 2, lambda o: -o, lambda o: 0, lambda o: 10**12,
                              str, lambda o: None, lambda o: True])]
    + [(f"nbytes {i}", lambda d, v=v: d["tensors"][0].update(nbytes=v(d["tensors"][0]["nbytes"])))
       for i, v in enumerate([float, lambda n: n + 1, lambda n: 0, str, lambda n: None, lambda n: True])]
    + [(f"digest {i}", lambda d, v=v: d["tensors"][2].update({digest_key(d): v(d["tensors"][2][digest_key(d)])}))
       for i, v in enumerate([str.upper, lambda s: s + "\n", lambda s: s[:-1], lambda s: s + "0",
                              lambda s: "g" + s[1:], lambda s: "é" + s[1:], lambda s: 5, lambda s: None,
                              lambda s: list(s), lambda s: " " + s[1:]])]
    + [("0-dim tensor bool size", lambda d: d["tensors"].__setitem__(
        0, dict(d["tensors"][0], dtype="U8", shape=[], nbytes=True)))]
    + [(f"tensor missing {k}", _delete(("tensors", 3, k)))
       for k in ["name", "file", "dtype", "shape", "offset", "nbytes"]]
    + [("tensor missing digest", lambda d: d["tensors"][3].pop(digest_key(d))),
       ("tensor digest of the other format", lambda d: d["tensors"][3].update(
           {"sha256" if digest_key(d) == "xxh3_128" else "xxh3_128": d["tensors"][3].pop(digest_key(d))}))]
    + [("tensor extra key", _set(("tensors", 3, "extra"), 1)),
       ("tensor is a list", lambda d: d["tensors"].__setitem__(3, list(d["tensors"][3].values()))),
       ("tensor is a str", _set(("tensors", 3), "x")),
       ("tensor is None", _set(("tensors", 3), None)),
       ("duplicate name", lambda d: d["tensors"][5].update(name=d["tensors"][4]["name"])),
       ("duplicate tensor", lambda d: d["tensors"].append(dict(d["tensors"][4]))),
       ("file -1 for the last file", lambda d: next(t for t in d["tensors"] if t["file"] == len(d["files"]) - 1)
        .update(file=-1)),
       ("0-dim shape ''", lambda d: _zero_dim(d).update(shape="")),
       ("0-dim shape {}", lambda d: _zero_dim(d).update(shape={})),
       ("0-dim shape None", lambda d: _zero_dim(d).update(shape=None)),
       ("tensors empty", _set(("tensors",), [])),
       ("tensors a dict", lambda d: d.update(tensors={t["name"]: t for t in d["tensors"]})),
       ("tensors None", _set(("tensors",), None)),
       ("tensors reversed", lambda d: d["tensors"].reverse())]
    + [(f"block {k}={v!r}", _set(("blocks", 1, k), v))
       for k, v in [("index", True), ("index", 1.0), ("index", 5), ("file", True), ("file", 1.0), ("file", 99),
                    ("begin", -1), ("begin", 10**12), ("end", 0), ("end", 10**12), ("begin", 1.5),
                    ("xxh3_128", "A" * 32), ("xxh3_128", "a" * 31), ("xxh3_128", None), ("prefix", 5),
                    ("prefix", None), ("tensors", []), ("tensors", ""), ("tensors", "x"), ("tensors", ["nope"]),
                    ("tensors", [5]), ("tensors", [["x"]]), ("tensors", None), ("tensors", {})]]
    + [("block 0 index True", _set(("blocks", 0, "index"), False)),
       ("block missing tensors", _delete(("blocks", 1, "tensors"))),
       ("block extra key", _set(("blocks", 1, "extra"), 1)),
       ("block is a list", lambda d: d["blocks"].__setitem__(1, list(d["blocks"][1].values()))),
       ("blocks empty", _set(("blocks",), [])),
       ("blocks a dict", _set(("blocks",), {})),
       ("blocks None", _set(("blocks",), None)),
       ("block file -1 for the last file", lambda d: d["blocks"][-1].update(file=-1)),
       ("block names by tensor", lambda d: d["blocks"][0].update(tensors=[d["tensors"][0]["name"]]))]
    + [(f"file {k}={v!r}", _set(("files", 0, k), v))
       for k, v in [("index", 1), ("index", False), ("blob", "X"), ("xxh3_128", "X"), ("size", 0), ("size", 1.5),
                    ("size", True), ("data_start", None), ("data_start", 0), ("data_start", 1.5),
                    ("data_start", 10**12), ("data_start", "0"), ("name", 5), ("extra", 1)]]
    + [("file missing size", _delete(("files", 0, "size"))),
       ("files empty", _set(("files",), [])),
       ("files None", _set(("files",), None)),
       ("file is a list", lambda d: d["files"].__setitem__(0, list(d["files"][0].values())))]
    + [(f"created {v!r}", _set(("created_unix",), v)) for v in [True, 1.0, "1", None, -5, 2**70]]
    + [("no created", _delete(("created_unix",))),
       ("content_digest", _set(("content_digest",), "sha256:" + "0" * 64)),
       ("content_digest None", _set(("content_digest",), None)),
       ("key", _set(("key",), "0" * 64)),
       ("format", _set(("format",), "x")),
       ("format_version", _set(("format_version",), 3)),
       ("format_version other", lambda d: d.update(format_version=3 - d["format_version"])),
       ("format_version True", _set(("format_version",), True)),
       ("format_version 2.0", _set(("format_version",), 2.0)),
       ("identity", _set(("identity",), {})),
       ("extra top-level key", _set(("extra",), 1))]
)


def naive_digest(doc: dict) -> None:
    """Sets content_digest to the digest of rows formatted without escaping
    or type checks (as a forger might): a fast path that skipped a check and
    relied on the digest instead would accept what the full check refuses."""
    try:
        key = digest_key(doc)
        rows = sorted((t["name"], f'["{t["name"]}","{t["dtype"]}",{str(t["shape"]).replace(" ", "")},"{t[key]}"]')
                      for t in doc["tensors"])
        text = "[" + ",".join(r for _, r in rows) + "]"
        doc["content_digest"] = "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    except Exception:  # noqa: BLE001, S110 - leave it; the mutation fails earlier
        pass


@pytest.mark.parametrize("digest", [refresh_digest, naive_digest, None], ids=["digest-refreshed", "digest-naive",
                                                                              "digest-kept"])
@pytest.mark.parametrize("mutate", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_any_document_comes_out_as_the_full_check_makes_it(doc, mutate, digest):
    mutate(doc)
    if digest is not None:
        digest(doc)
    text = json.dumps(doc)
    got, want = outcome(lambda: Manifest.from_json(text, what="m")), outcome(reference_from_json, text)
    assert got[:2] == want[:2]
    if got[0] == "ok":
        assert got[2] == want[2]


def test_non_object_documents_come_out_as_the_full_check_makes_them():
    for text in ["[]", "null", "5", '"x"', "{}", '{"format": "hwr-manifest", "format_version": 1}', "{", b"\xff"]:
        got = outcome(lambda text=text: Manifest.from_json(text, what="m"))
        assert got[:2] == outcome(reference_from_json, text)[:2]


@pytest.mark.parametrize("name", ["sp ace.x", "ü.😀", "😀" * 256, "__x", 'q"uote', "é" * 300])
def test_valid_unusual_names(doc, name):
    """Valid names that the bulk checks vouch for, and ones they leave to
    the rule itself (over 256 characters; a '"', which JSON escapes)."""
    doc["tensors"][1]["name"] = name
    refresh_digest(doc)
    m = Manifest.from_json(json.dumps(doc))
    assert m.tensors[1].name == name and m == reference_from_json(json.dumps(doc))


def test_content_digest_bytes_are_json_dumps_bytes():
    rows = [("b", "BF16", (2, 3), "a" * 64), ("a", "F32", (), "b" * 64), ("ü q\"x", "U8", (0,), "c" * 64),
            ("😀", "F64", [1, 0, 7], "d" * 64)]
    text = json.dumps(sorted([n, d, list(s), h] for n, d, s, h in rows), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False)
    assert content_digest(rows) == "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- mapping


def slice_views(mapped: MappedArtifact) -> dict[str, torch.Tensor]:
    """MappedArtifact.tensors as it was: slice, then view dtype, then shape."""
    out = {}
    for t in mapped.manifest.tensors:
        raw = mapped.file_bytes(t.file)[t.offset : t.offset + t.nbytes]
        out[t.name] = raw.view(TORCH_DTYPES[t.dtype]).view(t.shape)
    return out


def geometry(v: torch.Tensor) -> tuple:
    return (v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), v.data_ptr(), v.untyped_storage().data_ptr(),
            v.untyped_storage().nbytes(), v.is_contiguous(),
            v.dim() == 4 and v.is_contiguous(memory_format=torch.channels_last), v._is_view(), v.requires_grad,
            v.device, v.numel(), v.element_size())


def test_views_are_the_slice_views_for_every_dtype_and_shape(artifact):
    manifest, paths = artifact
    assert {t.dtype for t in manifest.tensors} == set(DTYPE_SIZES)
    assert {t.shape for t in manifest.tensors} >= set(SHAPES)
    # A zero-size tensor that ends its file.
    assert any(t.nbytes == 0 and t.offset == manifest.files[t.file].size for t in manifest.tensors)
    mapped = MappedArtifact(manifest, paths)
    new, old = mapped.tensors(), slice_views(mapped)
    assert list(new) == list(old) == [t.name for t in manifest.tensors]
    tensors = all_dtype_tensors()
    for name in old:
        assert geometry(new[name]) == geometry(old[name]), name
        want = tensors[name].reshape(-1).view(torch.uint8)
        assert torch.equal(new[name].reshape(-1).view(torch.uint8), want), name
    # The views still read the mapped files after the artifact lets go.
    mapped.release()
    del old
    for name, v in new.items():
        assert torch.equal(v.reshape(-1).view(torch.uint8), tensors[name].reshape(-1).view(torch.uint8)), name


def _with(manifest: Manifest, index: int, **changes) -> Manifest:
    tensors = list(manifest.tensors)
    tensors[index] = dataclasses.replace(tensors[index], **changes)
    return dataclasses.replace(manifest, tensors=tuple(tensors))


def _pick(manifest: Manifest, dtype: str, shape: tuple) -> int:
    return next(i for i, t in enumerate(manifest.tensors) if t.dtype == dtype and t.shape == shape)


@pytest.mark.parametrize("change", [
    lambda m, i: {"offset": m.tensors[i].offset + 1},  # not a multiple of the itemsize
    lambda m, i: {"offset": m.tensors[i].offset + 2},
    lambda m, i: {"offset": m.tensors[i].offset + 4},
    lambda m, i: {"offset": float(m.tensors[i].offset)},
    lambda m, i: {"offset": -64},
    lambda m, i: {"offset": m.files[m.tensors[i].file].size},
    lambda m, i: {"offset": m.files[m.tensors[i].file].size - 4},
    lambda m, i: {"nbytes": float(m.tensors[i].nbytes)},
    lambda m, i: {"nbytes": m.tensors[i].nbytes + 8},
    lambda m, i: {"nbytes": 0},
    lambda m, i: {"shape": list(m.tensors[i].shape)},
    lambda m, i: {"shape": (-1, 3)},
    lambda m, i: {"shape": (3, 2)},
    lambda m, i: {"shape": (6,)},
    lambda m, i: {"shape": (2.0, 3)},
    lambda m, i: {"dtype": "F33"},
    lambda m, i: {"dtype": "I64"},
    lambda m, i: {"dtype": "U8", "nbytes": m.tensors[i].nbytes},
    lambda m, i: {"file": len(m.files)},
    lambda m, i: {"file": True},
], ids=lambda c: "")
@pytest.mark.parametrize("dtype,shape", [("F32", (2, 3)), ("I16", (2, 3)), ("F64", (2, 3)), ("U8", (2, 3))])
def test_other_entries_take_the_slice_path(artifact, change, dtype, shape):
    """Hand-built manifests (from_json would refuse some): views or errors
    exactly as the slice construction gives them."""
    manifest, paths = artifact
    i = _pick(manifest, dtype, shape)
    changed = _with(manifest, i, **change(manifest, i))
    mapped = MappedArtifact(changed, paths)
    got, want = outcome(mapped.tensors), outcome(slice_views, mapped)
    assert got[:1] == want[:1] and (got[0] == "ok" or got[1:] == want[1:])
    if got[0] == "ok":
        assert list(got[2]) == list(want[2])
        for name in want[2]:
            assert geometry(got[2][name]) == geometry(want[2][name]), name
