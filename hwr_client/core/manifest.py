"""The artifact manifest (DESIGN §4): one JSON document per published
artifact, written by the daemon, read by everyone.

Everything the daemon needs to rebuild its index comes from manifests, so
:func:`Manifest.from_json` validates every field and cross-reference; a
manifest that fails is treated as corrupt (the artifact is quarantined).

Offsets in ``tensors`` and ``blocks`` are ABSOLUTE file offsets, so a reader
that mapped the whole file indexes it directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import re
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from hwr_client.core.errors import InvalidArgument
from hwr_client.core.identity import Identity
from hwr_client.core.layout import DTYPE_SIZES, check_tensor_name

if TYPE_CHECKING:
    from hwr_client.core.plan import CheckedPlan

FORMAT = "hwr-manifest"
FORMAT_VERSION = 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")

# For Manifest._from_doc_fast.
_ITEMSIZES = DTYPE_SIZES
_TENSOR_FIELDS = operator.itemgetter("name", "file", "dtype", "shape", "offset", "nbytes", "sha256")
_BLOCK_FIELDS = operator.itemgetter("index", "prefix", "file", "begin", "end", "xxh3_128", "tensors")
_HEX_DIGITS = b"0123456789abcdef"


@dataclasses.dataclass(frozen=True)
class FileEntry:
    index: int
    name: str  # label from the plan
    blob: str  # SHA-256 hex of the whole file; the blob's name in the store
    size: int
    xxh3_128: str
    data_start: int


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    file: int
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute offset in the file
    nbytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class BlockEntry:
    index: int
    prefix: str
    file: int
    begin: int  # absolute offsets, [begin, end)
    end: int
    xxh3_128: str
    tensors: tuple[str, ...]  # names in layout order

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def content_digest(tensors: Iterable[tuple[str, str, Iterable[int], str]]) -> str:
    """Digest over (name, dtype, shape, tensor sha256), independent of how
    tensors are split into files or ordered: ``sha256:<hex>``."""
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
_DIGEST_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _digest_sorted_rows(rows: list) -> str:
    """The digest of rows already sorted and checked (see content_digest).
    Tuples encode exactly like lists."""
    text = _DIGEST_ENCODER.encode(rows)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class Manifest:
    key: str
    identity: Identity
    content_digest: str
    created_unix: int
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    blocks: tuple[BlockEntry, ...]

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "key": self.key,
            "identity": self.identity.document,
            "content_digest": self.content_digest,
            "created_unix": self.created_unix,
            "files": [dataclasses.asdict(f) for f in self.files],
            "tensors": [
                {"name": t.name, "file": t.file, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset,
                 "nbytes": t.nbytes, "sha256": t.sha256}
                for t in self.tensors
            ],
            "blocks": [
                {"index": b.index, "prefix": b.prefix, "file": b.file, "begin": b.begin, "end": b.end,
                 "xxh3_128": b.xxh3_128, "tensors": list(b.tensors)}
                for b in self.blocks
            ],
        }
        return json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, what: str = "manifest") -> "Manifest":
        """Parses and validates a manifest.

        Raises:
            InvalidArgument: naming ``what`` and the first problem.
        """
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"{what}: not valid JSON ({exc})") from None
        try:
            # The fast path vouches only for manifests the full check accepts,
            # with the same result; for anything else (a problem, or a value
            # it does not handle) the full check runs and says what is wrong.
            manifest = cls._from_doc_fast(doc)
            return manifest if manifest is not None else cls._from_doc(doc, what)
        except InvalidArgument:
            raise
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise InvalidArgument(f"{what}: malformed ({type(exc).__name__}: {exc})") from None

    @classmethod
    def _from_doc_fast(cls, doc: Any) -> "Manifest | None":
        """:meth:`_from_doc` for well-formed manifests (every warm start): one
        pass over the tensors, names and hashes checked all at once, entries
        made without the frozen dataclasses' per-field ``__init__``.

        Args:
            doc: what ``json.loads`` returned.

        Returns the manifest :meth:`_from_doc` would return, or None where
        :meth:`_from_doc` might reject the document or where a value falls
        outside the plain cases handled here (a shape that is not a list of
        ints, a name of over 256 characters or with a '"', ...). It never
        raises; on None the caller runs :meth:`_from_doc`, which accepts or
        reports the first problem exactly as it always has.
        """
        try:
            return cls._from_doc_fast_unchecked(doc)
        except Exception:  # noqa: BLE001 - anything unexpected: let the full check decide
            return None

    @classmethod
    def _from_doc_fast_unchecked(cls, doc: Any) -> "Manifest | None":
        if type(doc) is not dict or doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
            return None
        identity = Identity.from_dict(doc["identity"])
        key = doc["key"]
        if identity.key != key:
            return None
        doc_files, doc_tensors, doc_blocks = doc["files"], doc["tensors"], doc["blocks"]
        if type(doc_files) is not list or type(doc_tensors) is not list or type(doc_blocks) is not list:
            return None
        if not doc_files or not doc_tensors:
            return None
        files = tuple(FileEntry(**f) for f in doc_files)
        for i, f in enumerate(files):
            if f.index != i or not _HEX64.match(f.blob) or not _HEX32.match(f.xxh3_128) or f.size <= 0:
                return None
        n_files = len(files)
        data_starts = [f.data_start for f in files]
        sizes = [f.size for f in files]

        new, setattr_, itemsizes, fields = object.__new__, object.__setattr__, _ITEMSIZES, _TENSOR_FIELDS
        tensors, names, shas, rows = [], [], [], []
        for t in doc_tensors:
            name, file, dtype, shape, offset, nbytes, sha = fields(t)
            # The same operations on the same values as in _from_doc, except
            # where noted; names and hashes are checked together below.
            size = itemsizes.get(dtype)
            if size is None or type(shape) is not list or not (0 <= file < n_files):
                return None
            for d in shape:
                if type(d) is not int or d < 0:
                    return None
                size *= d
            if size != nbytes or offset < data_starts[file] or offset + nbytes > sizes[file]:
                return None
            entry = new(TensorEntry)
            # What the dataclass __init__ stores, in field order.
            setattr_(entry, "__dict__", {"name": name, "file": file, "dtype": dtype, "shape": tuple(shape),
                                          "offset": offset, "nbytes": nbytes, "sha256": sha})
            tensors.append(entry)
            names.append(name)
            shas.append(sha)
            # The content digest's JSON row as its encoder writes it, given
            # int dims (list repr "[2, 3]") and the names and hashes checked
            # below: JSON escapes none of their characters.
            rows.append(f'["{name}","{dtype}",{str(shape).replace(" ", "")},"{sha}"]')
        # check_tensor_name for every name at once: each is a non-empty str
        # (str.join takes nothing else) of at most 256 characters, so of at
        # most 1024 UTF-8 bytes. Joined by "/", which no name may contain
        # (hence the count), the text is printable (NUL is not) and has no
        # "\\" or ".." (one cannot span a "/") exactly when every name
        # qualifies; "/__hwr" finds the reserved prefix at any name's start.
        # A '"' is allowed, but JSON escapes it: the full check takes those.
        joined = "/" + "/".join(names)
        if (max(map(len, names)) > 256 or not all(names) or joined.count("/") != len(names)
                or not joined.isprintable() or "\\" in joined or ".." in joined or "/__hwr" in joined
                or '"' in joined):
            return None
        seen = set(names)
        if len(seen) != len(names) or "__metadata__" in seen:
            return None  # a duplicate or reserved name
        # _HEX64 for every hash at once: 64 characters each (str.join takes
        # only str), all of them ASCII and, deleting hex digits, none left.
        if set(map(len, shas)) != {64} or "".join(shas).encode("ascii").translate(None, _HEX_DIGITS):
            return None

        blocks = []
        hex32 = _HEX32.match
        for i, b in enumerate(doc_blocks):
            index, prefix, file, begin, end, xxh, block_names = _BLOCK_FIELDS(b)
            if index != i or not (0 <= file < n_files) or not (0 <= begin <= end <= sizes[file]):
                return None
            block_names = tuple(block_names)
            if not hex32(xxh) or not block_names or not seen.issuperset(block_names):
                return None
            entry = new(BlockEntry)
            setattr_(entry, "__dict__", {"index": index, "prefix": prefix, "file": file, "begin": begin, "end": end,
                                          "xxh3_128": xxh, "tensors": block_names})
            blocks.append(entry)

        # content_digest's text, byte for byte: names are unique, so ordering
        # by name alone is the order sorted() gives its rows.
        order = sorted(range(len(names)), key=names.__getitem__)
        text = "[" + ",".join([rows[i] for i in order]) + "]"
        digest = "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
        if digest != doc["content_digest"]:
            return None
        created = doc["created_unix"]
        if type(created) is not int:
            return None
        return cls(key, identity, digest, created, files, tuple(tensors), tuple(blocks))

    @classmethod
    def _from_doc(cls, doc: dict[str, Any], what: str) -> "Manifest":
        if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
            raise InvalidArgument(f"{what}: expected format {FORMAT!r} version {FORMAT_VERSION}")
        identity = Identity.from_dict(doc["identity"])
        if identity.key != doc["key"]:
            raise InvalidArgument(f"{what}: key {doc['key']!r} does not match its identity (expected {identity.key})")
        files = tuple(FileEntry(**f) for f in doc["files"])
        if not files:
            raise InvalidArgument(f"{what}: expected at least one file")
        for i, f in enumerate(files):
            if f.index != i or not _HEX64.match(f.blob) or not _HEX32.match(f.xxh3_128) or f.size <= 0:
                raise InvalidArgument(f"{what}: file {i} entry is malformed: {f}")
        tensors = tuple(
            TensorEntry(t["name"], t["file"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"], t["sha256"])
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
            if t.dtype not in DTYPE_SIZES or not (0 <= t.file < len(files)) or not _HEX64.match(t.sha256):
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
        digest = content_digest((t.name, t.dtype, t.shape, t.sha256) for t in tensors)
        if digest != doc["content_digest"]:
            raise InvalidArgument(f"{what}: content_digest {doc['content_digest']!r}, expected {digest} from its tensors")
        created = doc["created_unix"]
        if isinstance(created, bool) or not isinstance(created, int):
            raise InvalidArgument(f"{what}: created_unix must be an integer")
        return cls(doc["key"], identity, digest, created, files, tensors, blocks)


def build_manifest(
    checked: CheckedPlan,
    file_digests: Sequence[tuple[str, str]],
    tensor_digests: Mapping[str, str],
    block_xxh: Sequence[str],
    *,
    created_unix: int | None = None,
) -> Manifest:
    """Assembles the manifest from a checked plan and the computed digests:
    the one builder the daemon's publication and the reference writer share.

    Args:
        file_digests: per file (sha256 hex, xxh3_128 hex).
        tensor_digests: tensor name -> sha256 hex.
        block_xxh: per block xxh3_128 hex.
    """
    plan = checked.plan
    files = tuple(
        FileEntry(i, f.name, file_digests[i][0], lay.file_size, file_digests[i][1], lay.data_start)
        for i, (f, lay) in enumerate(zip(plan.files, checked.layouts))
    )
    tensors = tuple(
        TensorEntry(spec.name, fi, spec.dtype, spec.shape, lay.data_start + off, spec.nbytes, tensor_digests[spec.name])
        for fi, lay in enumerate(checked.layouts)
        for spec, off in zip(lay.tensors, lay.tensor_offsets)
    )
    blocks = tuple(BlockEntry(b.index, b.prefix, b.file, b.begin, b.end, block_xxh[b.index], b.tensors) for b in checked.blocks)
    digest = content_digest((t.name, t.dtype, t.shape, t.sha256) for t in tensors)
    created = int(time.time()) if created_unix is None else created_unix
    return Manifest(plan.identity.key, plan.identity, digest, created, files, tensors, blocks)
