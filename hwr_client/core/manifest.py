"""The artifact manifest (DESIGN §4): one JSON document per published
artifact, written by the daemon, read by everyone.

Everything the daemon needs to rebuild its index comes from manifests, so
:func:`Manifest.from_json` validates every field and cross-reference; a
manifest that fails is treated as corrupt (the artifact is quarantined).

Offsets in ``tensors`` and ``blocks`` are ABSOLUTE file offsets, so a reader
that mapped the whole file indexes it directly. Sizes are in bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import re
from typing import Any, Iterable, TypeVar

from hwr_client.core.annotations import check_annotations
from hwr_client.core.errors import InvalidArgument
from hwr_client.core.identity import Identity
from hwr_client.core.layout import DTYPE_SIZES, MAX_DIM, check_shape_bound, check_tensor_names


#: The manifest document's ``format`` and the ``format_version`` written.
#: Version 2 (this one): a tensor's digest is the xxh3-128 of its bytes,
#: computed in the same pass as its file's SHA-256 (the blob name), so a
#: publication hashes each payload byte with SHA-256 once. Version 1: a
#: tensor's digest is the SHA-256 of its bytes (a second SHA-256 pass).
#: Both are read; see :class:`TensorEntry` for what each proves.
FORMAT = "hwr-manifest"
FORMAT_VERSION = 2
#: The versions :meth:`Manifest.from_json` accepts.
READ_VERSIONS = (1, 2)
# \Z, not $: "$" also matches before a trailing newline, which would let a
# 65-character "digest" through.
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
# A document entry's fields, in the order of the dataclass that holds them.
_TENSOR_FIELDS = {v: operator.itemgetter("name", "file", "dtype", "shape", "offset", "nbytes", key)
                  for v, key in ((1, "sha256"), (2, "xxh3_128"))}
_BLOCK_FIELDS = operator.itemgetter("index", "prefix", "file", "begin", "end", "xxh3_128", "tensors")
_Entry = TypeVar("_Entry")


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One payload file of an artifact (a safetensors file, stored as a blob).

    ``index`` is its position in ``Manifest.files``; ``name`` the label the
    plan gave it; ``blob`` the SHA-256 hex of the whole file, which is the
    blob's name in the store; ``size`` its length in bytes; ``xxh3_128`` the
    fast digest of the whole file (``verify=fast``); ``data_start`` the
    absolute offset where its data region begins (after the header).
    """

    index: int
    name: str
    blob: str
    size: int
    xxh3_128: str
    data_start: int


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of an artifact (padding tensors are never listed).

    ``file`` indexes ``Manifest.files``; ``dtype`` is the safetensors dtype
    string; ``offset`` is the ABSOLUTE byte offset of its first byte in that
    file; ``nbytes`` its length in bytes (itemsize × elements). Its digest is
    exactly one of ``sha256`` (format 1: the SHA-256 hex of those bytes) and
    ``xxh3_128`` (format 2: the xxh3-128 hex of those bytes); the other is "".

    What proves a tensor's bytes is its file's SHA-256, which names the blob
    and covers every byte of the file (header, tensors, padding) in both
    formats; the manifest places the tensor in it. The per-tensor digest
    locates damage (which tensor) and feeds the content digest; a format-2
    digest is not collision-resistant against a chosen input, which nothing
    relies on: every check that must resist one compares file SHA-256s.
    """

    name: str
    file: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    sha256: str
    xxh3_128: str = ""

    @property
    def digest(self) -> str:
        """The tensor's digest hex, whichever its format holds."""
        return self.sha256 or self.xxh3_128

    @property
    def digest_algorithm(self) -> str:
        """``"sha256"`` (format 1) or ``"xxh3_128"`` (format 2)."""
        return "sha256" if self.sha256 else "xxh3_128"


@dataclasses.dataclass(frozen=True)
class BlockEntry:
    """One streamable block: tensors adjacent in one file, copied as one
    byte range (the unit the offload runtime moves).

    ``index`` is its position in ``Manifest.blocks`` (execution order);
    ``prefix`` the name prefix its tensors share (``blocks.3.``); ``begin``
    and ``end`` ABSOLUTE offsets in file ``file``, the range ``[begin, end)``;
    ``xxh3_128`` the fast digest of that range; ``tensors`` the names in
    layout order.
    """

    index: int
    prefix: str
    file: int
    begin: int
    end: int
    xxh3_128: str
    tensors: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        """Length of the block's byte range."""
        return self.end - self.begin


def content_digest(tensors: Iterable[tuple[str, str, Iterable[int], str]]) -> str:
    """Digest over (name, dtype, shape, tensor digest hex), independent of how
    tensors are split into files or ordered: ``sha256:<hex>``. The tensor
    digest is the one of the manifest's format (:class:`TensorEntry`), so the
    same tensors give one content digest per format.

    Raises:
        InvalidArgument: a row that is not strings and integer dims.
    """
    rows = sorted([name, dtype, list(shape), sha] for name, dtype, shape, sha in tensors)
    for row in rows:
        # The rows are strings and integers only; checking that here instead
        # of canonical_json's generic recursive walk keeps manifest parsing
        # (on every warm start) cheap for thousands of tensors. Same bytes.
        if not (type(row[0]) is str and type(row[1]) is str and type(row[3]) is str
                and all(type(d) is int for d in row[2])):
            raise InvalidArgument(f"content digest: tensor row {row!r} must hold strings and integer dims")
    return _digest_sorted_rows(rows)


# json.dumps(rows, **these options) builds this same encoder on every call.
# Rows are flat, so the cycle check (check_circular) has nothing to find:
# skipping it gives the same text, faster.
_DIGEST_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                                   check_circular=False)


def _digest_sorted_rows(rows: list) -> str:
    """The digest of rows already sorted and checked (see content_digest).
    Tuples encode exactly like lists."""
    text = _DIGEST_ENCODER.encode(rows)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A validated artifact manifest. Build with :meth:`from_json` (reading)
    or :func:`build_manifest` (publishing); :meth:`to_json` writes it.

    ``key`` is the identity key; ``content_digest`` is
    :func:`content_digest` of the tensors; ``created_unix`` is seconds since
    the epoch; ``files``, ``tensors`` and ``blocks`` hold the entries in
    order (tensors in layout order, blocks in execution order);
    ``annotations`` the publisher's opaque object
    (:mod:`hwr_client.core.annotations`), None when it gave none (the
    document then has no ``annotations`` field, as before they existed);
    ``format_version`` the document's format (:data:`FORMAT_VERSION` for a
    new one; a read manifest keeps the version it was written in).
    """

    key: str
    identity: Identity
    content_digest: str
    created_unix: int
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    blocks: tuple[BlockEntry, ...]
    annotations: dict[str, Any] | None = None
    format_version: int = FORMAT_VERSION

    @property
    def size_bytes(self) -> int:
        """Bytes the artifact's files hold together."""
        return sum(f.size for f in self.files)

    def tensor(self, name: str) -> TensorEntry:
        """The entry of tensor ``name``.

        Raises:
            KeyError: no tensor has that name.
        """
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_json(self) -> str:
        """The manifest document as the daemon writes it (sorted keys, one
        trailing newline); :meth:`from_json` reads it back equal."""
        doc = {
            "format": FORMAT,
            "format_version": self.format_version,
            "key": self.key,
            "identity": self.identity.document,
            "content_digest": self.content_digest,
            "created_unix": self.created_unix,
            "files": [dataclasses.asdict(f) for f in self.files],
            "tensors": [
                {"name": t.name, "file": t.file, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset,
                 "nbytes": t.nbytes, _DIGEST_KEY[self.format_version]: t.digest}
                for t in self.tensors
            ],
            "blocks": [
                {"index": b.index, "prefix": b.prefix, "file": b.file, "begin": b.begin, "end": b.end,
                 "xxh3_128": b.xxh3_128, "tensors": list(b.tensors)}
                for b in self.blocks
            ],
        }
        if self.annotations is not None:
            doc["annotations"] = self.annotations
        return json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, what: str = "manifest") -> "Manifest":
        """Parses and validates a manifest: every field, every cross-reference
        and the content digest.

        Args:
            text: the manifest's JSON.
            what: names the manifest in errors (``artifact 3f2a… manifest``).

        Raises:
            InvalidArgument: naming ``what`` and the first problem.
        """
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"{what}: not valid JSON ({exc})") from None
        try:
            return _from_doc(doc, what)
        except InvalidArgument:
            raise
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            # A field of the wrong JSON type or a missing one: the operation
            # on it fails, and that is the problem to report.
            raise InvalidArgument(f"{what}: malformed ({type(exc).__name__}: {exc})") from None


# ------------------------------------------------------------------ reading
#
# One validator, fast enough for every warm start (~1000 tensors). The rules
# are check_tensor_name, _HEX64/_HEX32 and the comparisons below, each
# applied to every entry. Speed comes from how the document is walked, never
# from a second set of rules: names and hashes first go through bulk string
# checks that can only vouch (where one does not, the rule itself decides,
# item by item); then one pass over the tensors takes fields by itemgetter,
# makes entries without the dataclass __init__ and writes the digest rows.
# The checks compare the raw JSON values, so a value of another type that
# compares the same (``True`` for 1, ``4.0`` for 4) passes and is kept as
# given, as it always was.


def _from_doc(doc: Any, what: str) -> Manifest:
    """Validates a parsed manifest document and builds the manifest.

    Raises:
        InvalidArgument: naming ``what`` and the first problem; a field of the
            wrong type or a missing one raises TypeError, KeyError, ValueError
            or AttributeError instead, which :meth:`Manifest.from_json` reports.
    """
    version = doc.get("format_version")
    if doc.get("format") != FORMAT or type(version) is not int or version not in READ_VERSIONS:
        raise InvalidArgument(f"{what}: expected format {FORMAT!r} version {' or '.join(map(str, READ_VERSIONS))}")
    identity = Identity.from_dict(doc["identity"])
    if identity.key != doc["key"]:
        raise InvalidArgument(f"{what}: key {doc['key']!r} does not match its identity (expected {identity.key})")
    files = _files(doc["files"], what)
    tensors, names, digest = _tensors(doc["tensors"], files, what, version)
    blocks = _blocks(doc["blocks"], files, names, what)
    if digest != doc["content_digest"]:
        raise InvalidArgument(f"{what}: content_digest {doc['content_digest']!r}, expected {digest} from its tensors")
    created = doc["created_unix"]
    if isinstance(created, bool) or not isinstance(created, int):
        raise InvalidArgument(f"{what}: created_unix must be an integer")
    # Optional (older manifests have none); checked like the plan's, so a
    # manifest the daemon would not have written is refused.
    annotations = None
    if "annotations" in doc:
        annotations = check_annotations(doc["annotations"], what=f"{what}: annotations")
    return Manifest(doc["key"], identity, digest, created, files, tensors, blocks, annotations,
                    format_version=version)


def _files(doc_files: Any, what: str) -> tuple[FileEntry, ...]:
    """The file entries, checked: at least one, in index order, digests in
    lowercase hex, a positive size."""
    files = tuple(FileEntry(**f) for f in doc_files)
    if not files:
        raise InvalidArgument(f"{what}: expected at least one file")
    for i, f in enumerate(files):
        if f.index != i or not _HEX64.match(f.blob) or not _HEX32.match(f.xxh3_128) or f.size <= 0:
            raise InvalidArgument(f"{what}: file {i} entry is malformed: {f}")
    return files


def _tensors(doc_tensors: Any, files: tuple[FileEntry, ...], what: str, version: int,
             ) -> tuple[tuple[TensorEntry, ...], set[str], str]:
    """The tensor entries, checked; the set of their names; their content
    digest (for the caller to compare with the document's).

    Each tensor, after :func:`_names_and_hashes`: a known dtype; an existing
    file; integer dims >= 0; ``nbytes`` = itemsize × elements; its bytes
    inside its file's data region. ``version`` says which digest a tensor
    holds (:class:`TensorEntry`).
    """
    names, seen, plain = _names_and_hashes(doc_tensors, what, version)
    n_files, itemsizes, fields = len(files), DTYPE_SIZES, _TENSOR_FIELDS[version]
    v1 = version == 1
    data_starts, sizes = [f.data_start for f in files], [f.size for f in files]
    new, set_dict = object.__new__, object.__setattr__
    tensors: list[TensorEntry] = []
    rows: list[str] = []
    dims_text: dict[tuple[int, ...], str] = {}
    for t in doc_tensors:
        name, file, dtype, doc_shape, offset, nbytes, sha = fields(t)
        shape = tuple(doc_shape)
        size = itemsizes.get(dtype)
        if size is None or not (0 <= file < n_files):
            raise InvalidArgument(f"{what}: tensor {name!r} entry is malformed")
        for d in shape:
            if type(d) is not int or d < 0:
                raise InvalidArgument(f"{what}: tensor {name!r} shape {list(shape)} must hold integers >= 0")
            size *= d
        if size > MAX_DIM or (not size and shape):
            # The int64 bound of the plan (layout.MAX_DIM); a zero-element
            # shape is checked over its non-zero dimensions, as there.
            check_shape_bound(shape, itemsizes[dtype], what=f"{what}: tensor {name!r}")
        if size != nbytes or offset < data_starts[file] or offset + nbytes > sizes[file]:
            raise InvalidArgument(f"{what}: tensor {name!r} range {offset}+{nbytes} does not fit file {file}")
        # _frozen, inline: a call per tensor would cost a tenth of the pass.
        entry = new(TensorEntry)
        set_dict(entry, "__dict__", {"name": name, "file": file, "dtype": dtype, "shape": shape, "offset": offset,
                                     "nbytes": nbytes, "sha256": sha if v1 else "", "xxh3_128": "" if v1 else sha})
        tensors.append(entry)
        if plain:
            dims = dims_text.get(shape)
            if dims is None:  # a thousand tensors have a few dozen shapes
                dims = dims_text[shape] = str(list(shape)).replace(" ", "")
            rows.append(f'["{name}","{dtype}",{dims},"{sha}"]')
    if not tensors:
        raise InvalidArgument(f"{what}: expected at least one tensor")
    return tuple(tensors), seen, _tensor_digest(names, tensors, rows if plain else None)


def _names_and_hashes(doc_tensors: Any, what: str, version: int) -> tuple[list[str], set[str], bool]:
    """Checks every tensor's name (safe, unique) and digest (lowercase hex of
    its format's length), all at once; returns the names in order, their set, and whether the
    digest rows can be written without JSON escaping.

    The rows can where no string in them needs escaping: valid names are
    printable and have no "\\", so only a '"' would; hashes that are plain
    hex need none. (``_HEX64`` ends in ``\\Z``: a hash with a trailing
    newline is refused, not passed on into a row.)
    """
    names = list(map(_NAME, doc_tensors))
    try:
        check_tensor_names(names)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{what}: {exc}") from None
    seen = set(names)
    if len(seen) != len(names):
        raise InvalidArgument(f"{what}: duplicate tensor {_first_duplicate(names)!r}")
    shas = list(map(_DIGEST[version], doc_tensors))
    width, pattern = (64, _HEX64) if version == 1 else (32, _HEX32)
    plain_shas = _all_hex(shas, width)
    if not plain_shas:
        for name, sha in zip(names, shas):
            if not pattern.match(sha):
                raise InvalidArgument(f"{what}: tensor {name!r} entry is malformed")
    return names, seen, plain_shas and '"' not in "".join(names)


def _tensor_digest(names: list[str], tensors: list[TensorEntry], rows: list[str] | None) -> str:
    """:func:`content_digest` of checked tensors; ``rows``, where given, are
    their JSON rows in tensor order, strings needing no escaping.

    The names are unique and all str, so ordering by name alone is the order
    sorted() gives content_digest's rows, and the types are what it checks.
    A row without escapes is its strings in quotes and its dims as a list of
    ints prints, without spaces: the encoder's bytes, without its per-value cost.
    """
    order = sorted(range(len(names)), key=names.__getitem__)
    if rows is None:
        return _digest_sorted_rows([(t.name, t.dtype, t.shape, t.digest) for t in map(tensors.__getitem__, order)])
    text = "[" + ",".join([rows[i] for i in order]) + "]"
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


_NAME = operator.itemgetter("name")
#: A tensor entry's digest field, by format version.
_DIGEST_KEY = {1: "sha256", 2: "xxh3_128"}
_DIGEST = {v: operator.itemgetter(k) for v, k in _DIGEST_KEY.items()}
_HEX_DIGITS = b"0123456789abcdef"


def _all_hex(texts: list[Any], width: int) -> bool:
    """True only if every text is ``width`` lowercase hex digits (False says
    nothing): each is a str (``str.join`` takes nothing else) of ``width``
    characters, and the whole is ASCII with nothing left once the lowercase
    hex digits are deleted."""
    try:
        joined = "".join(texts)
    except TypeError:
        return False
    return (set(map(len, texts)) == {width} and joined.isascii()
            and not joined.encode("ascii").translate(None, _HEX_DIGITS))


def _first_duplicate(names: list[str]) -> str:
    """The first name in ``names`` that an earlier one repeats."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    raise AssertionError("no duplicate")  # the caller saw one


def _blocks(doc_blocks: Any, files: tuple[FileEntry, ...], names: set[str], what: str) -> tuple[BlockEntry, ...]:
    """The block entries, checked: in index order, a range inside an existing
    file, a lowercase-hex xxh3_128, at least one tensor, all of them known."""
    blocks = []
    for i, b in enumerate(doc_blocks):
        index, prefix, file, begin, end, xxh, doc_tensors = _BLOCK_FIELDS(b)
        tensors = tuple(doc_tensors)
        if index != i or not (0 <= file < len(files)) or not (0 <= begin <= end <= files[file].size):
            raise InvalidArgument(f"{what}: block {i} entry is malformed")
        if not _HEX32.match(xxh) or not tensors or not names.issuperset(tensors):
            raise InvalidArgument(f"{what}: block {i} entry is malformed")
        blocks.append(_frozen(BlockEntry, {"index": index, "prefix": prefix, "file": file, "begin": begin,
                                           "end": end, "xxh3_128": xxh, "tensors": tensors}))
    return tuple(blocks)


def _frozen(cls: type[_Entry], values: dict[str, Any]) -> _Entry:
    """An instance of the frozen dataclass ``cls`` whose fields are
    ``values`` (every field, in field order): what its generated
    ``__init__`` stores, at half the cost (that ``__init__`` goes through
    ``object.__setattr__`` once per field). Used only for the entry classes,
    which have neither ``__post_init__`` nor ``__slots__``."""
    entry = object.__new__(cls)
    # A frozen dataclass's __setattr__ refuses every field; object's does not.
    object.__setattr__(entry, "__dict__", values)
    return entry
