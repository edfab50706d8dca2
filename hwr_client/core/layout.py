"""Final-layout payload files: dtypes, tensor-name rules, the aligned
safetensors layout, and a strict safetensors header parser.

Every payload file is a valid safetensors file (``safetensors.torch.load_file``
reads it). To make every tensor start on an :data:`ALIGN`-byte boundary — so a
block copied into a device buffer can be viewed at any dtype without an
unaligned storage offset — the layout inserts ``U8`` padding tensors named
``__hwr_pad.<n>`` (safetensors forbids holes in the data region) and pads the
header JSON with spaces (which the format allows). Padding tensors are part of
the file, never of the manifest's tensor list.

The daemon computes the layout from a publication plan and sends the offsets
back; the client fills its payload to match. Both call :func:`layout_file`,
so the layout is one function, not two that must agree.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from typing import BinaryIO, Sequence, cast

from hwr_client.core.errors import InvalidArgument

#: Byte alignment of the data region start and of every tensor in it.
ALIGN = 64
#: Largest safetensors header we parse (a header claiming more is rejected
#: before anything is allocated).
MAX_HEADER_BYTES = 100 * 1000 * 1000
#: Largest dimension, element count and byte length of one tensor: int64's
#: maximum, what torch and numpy index with. A larger one cannot be viewed
#: (torch raises "Overflow" at lease time), so it is refused at the plan.
#: The element count is taken over the NON-zero dimensions: torch multiplies
#: the sizes in order, so ``[2**62, 2**62, 0]`` overflows although it holds
#: no element.
MAX_DIM = 2**63 - 1
#: Reserved name prefix for padding tensors.
PAD_PREFIX = "__hwr_pad."

#: safetensors dtype string -> bytes per element. The torch side of the
#: mapping lives in :mod:`hwr_client.tensors`; this module stays torch-free so
#: the daemon can import it.
#: The fp8 *fnuz* variants (finite, no negative zero: AMD's fp8) use the names
#: safetensors gives them (``F8_E4M3FNUZ``, ``F8_E5M2FNUZ``).
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8,
    "F16": 2, "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
}


def check_dtype(name: str) -> str:
    """Returns ``name`` if it is a known safetensors dtype string.

    Raises:
        InvalidArgument: an unknown dtype string.
    """
    if name not in DTYPE_SIZES:
        raise InvalidArgument(f"dtype {name!r}: unknown; expected one of {sorted(DTYPE_SIZES)}")
    return name


def check_tensor_name(name: object) -> str:
    """Returns ``name`` if it is a safe tensor name.

    Safe: a non-empty str of printable characters without NUL, "/" or "\\",
    no "..", not the reserved "__hwr" prefix nor "__metadata__", at most 1024
    UTF-8 bytes.

    Raises:
        InvalidArgument: naming the tensor and the rule it breaks.
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"tensor name {name!r}: expected a non-empty string")
    if "\x00" in name or "/" in name or "\\" in name:
        raise InvalidArgument(f"tensor name {name!r}: must not contain NUL, '/' or '\\'")
    if ".." in name:
        raise InvalidArgument(f"tensor name {name!r}: must not contain '..'")
    if name.startswith("__hwr") or name == "__metadata__":
        raise InvalidArgument(f"tensor name {name!r}: the '__hwr' prefix and '__metadata__' are reserved")
    # A name of at most 256 characters has at most 1024 UTF-8 bytes: only a
    # longer one is worth encoding.
    if not name.isprintable() or (len(name) > 256 and len(name.encode("utf-8")) > 1024):
        raise InvalidArgument(f"tensor name {name!r}: expected printable text of at most 1024 bytes")
    return name


def check_tensor_names(names: Sequence[object]) -> None:
    """:func:`check_tensor_name` for every name, in order; for the thousand
    names of a manifest, a few string operations instead of a thousand calls.

    The joined text vouches for all names only where that implies each one
    passes; otherwise each name is checked, and the first that fails raises.

    Raises:
        InvalidArgument: the first name that :func:`check_tensor_name` refuses.
    """
    if not _names_vouched(names):
        for name in names:
            check_tensor_name(name)


def _names_vouched(names: Sequence[object]) -> bool:
    """True only if every name passes :func:`check_tensor_name` (False says
    nothing). Joined by "/", which no name may contain (hence the count):
    the text is printable exactly when every name is (NUL is not); it has
    no "\\" or ".." (one cannot span a "/") exactly when no name has; "/__hwr"
    finds the reserved prefix at any name's start. Each name is a non-empty
    str (``str.join`` takes nothing else) of at most 256 characters, so of at
    most 1024 UTF-8 bytes.
    """
    if not names:
        return False
    try:
        text = "/" + "/".join(cast("Sequence[str]", names))
    except TypeError:
        return False  # a name that is not a str (join refuses it)
    strs = cast("Sequence[str]", names)
    return (all(strs) and max(map(len, strs)) <= 256 and text.count("/") == len(names) and _printable(text)
            and "\\" not in text and ".." not in text and "/__hwr" not in text and "__metadata__" not in strs)


# The ASCII characters str.isprintable() accepts: space to "~".
_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))


def _printable(text: str) -> bool:
    """``text.isprintable()``, four times faster for ASCII text (the usual
    tensor names): delete the printable bytes and see that none is left."""
    if text.isascii():
        return not text.encode("ascii").translate(None, _PRINTABLE_ASCII)
    return text.isprintable()


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor as planned: name, safetensors dtype string, shape (element
    counts per dimension). Not checked on construction; :meth:`validate`."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of its data: elements × itemsize."""
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def validate(self) -> "TensorSpec":
        """Returns self if name, dtype and shape are valid.

        Raises:
            InvalidArgument: naming the tensor and what is wrong.
        """
        check_tensor_name(self.name)
        check_dtype(self.dtype)
        for dim in self.shape:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
                raise InvalidArgument(f"tensor {self.name!r}: shape {list(self.shape)} must hold integers >= 0")
        check_shape_bound(self.shape, DTYPE_SIZES[self.dtype], what=f"tensor {self.name!r}")
        return self


def check_shape_bound(shape: Sequence[int], itemsize: int, *, what: str) -> None:
    """Refuses a shape whose dimensions, element count or byte length exceed
    :data:`MAX_DIM` (the element count over the non-zero dimensions, see there).

    Args:
        shape: integer dimensions >= 0 (the caller checked their type).
        itemsize: bytes per element of the dtype.
        what: names the tensor in the error.

    Raises:
        InvalidArgument: naming the tensor, its shape and the bound.
    """
    n = itemsize
    for dim in shape:
        if dim:
            n *= dim
        if dim > MAX_DIM or n > MAX_DIM:
            raise InvalidArgument(
                f"{what}: shape {list(shape)} exceeds {MAX_DIM} (2**63 - 1) in a dimension, the element count "
                "or the byte length; no tensor can be that large"
            )


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """Where everything goes in one payload file.

    ``header`` is the 8-byte length prefix plus the padded JSON header;
    ``tensor_offsets`` are RELATIVE to the data region, in plan order
    (absolute file offset = ``data_start + offset``); ``data_size`` is the
    data region's length in bytes, padding included.
    """

    header: bytes
    tensors: tuple[TensorSpec, ...]
    tensor_offsets: tuple[int, ...]
    data_size: int

    @property
    def data_start(self) -> int:
        """Absolute offset of the data region (a multiple of ALIGN)."""
        return len(self.header)

    @property
    def file_size(self) -> int:
        """Length of the whole file in bytes."""
        return len(self.header) + self.data_size

    def padding_ranges(self) -> list[tuple[int, int]]:
        """Ranges ``[begin, end)`` of alignment padding, RELATIVE to the data
        region."""
        out, pos = [], 0
        for spec, off in zip(self.tensors, self.tensor_offsets):
            if off > pos:
                out.append((pos, off))
            pos = off + spec.nbytes
        if self.data_size > pos:
            out.append((pos, self.data_size))
        return out


def _align(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_file(tensors: Sequence[TensorSpec]) -> FileLayout:
    """Computes the aligned layout of one payload file.

    Tensors keep the given order; each starts at a multiple of ALIGN in the
    data region, and the data region starts at a multiple of ALIGN in the file.

    Raises:
        InvalidArgument: no tensors, or a tensor fails validation.
    """
    if not tensors:
        raise InvalidArgument("payload file: expected at least one tensor, got none")
    header: dict[str, object] = {"__metadata__": {"format": "pt", "producer": "hwr"}}
    offsets, pos, pad = [], 0, 0
    for spec in tensors:
        spec.validate()
        start = _align(pos)
        if start > pos:
            header[f"{PAD_PREFIX}{pad}"] = {"dtype": "U8", "shape": [start - pos], "data_offsets": [pos, start]}
            pad += 1
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [start, start + spec.nbytes]}
        offsets.append(start)
        pos = start + spec.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    padded = _align(8 + len(text)) - 8
    text += b" " * (padded - len(text))
    return FileLayout(struct.pack("<Q", len(text)) + text, tuple(tensors), tuple(offsets), pos)


@dataclasses.dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a parsed safetensors header: name, dtype string, shape,
    and its ``data_offsets`` ``[begin, end)``, RELATIVE to the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class ParsedHeader:
    """A safetensors header that :func:`parse_header` checked.

    ``data_start`` is the absolute offset of the data region (8 + header
    length); ``entries`` are sorted by ``begin``, padding tensors included;
    ``metadata`` is the ``__metadata__`` object ({} when absent).
    """

    data_start: int
    entries: tuple[HeaderEntry, ...]
    metadata: dict

    def tensors(self) -> list[HeaderEntry]:
        """Entries without HWR padding tensors."""
        return [e for e in self.entries if not e.name.startswith(PAD_PREFIX)]


def parse_header(f: BinaryIO, file_size: int, *, what: str = "file") -> ParsedHeader:
    """Parses and checks a safetensors header strictly.

    Checks: the length prefix fits the file and is at most MAX_HEADER_BYTES;
    the JSON is an object of known dtypes; shape × itemsize == byte length;
    the data region is covered exactly, without holes or overlaps, and ends
    at the end of the file.

    Raises:
        InvalidArgument: naming ``what`` and the first problem found.
    """
    prefix = f.read(8)
    if len(prefix) < 8:
        raise InvalidArgument(f"{what}: truncated, {file_size} bytes is shorter than the 8-byte safetensors header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise InvalidArgument(f"{what}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > file_size:
        raise InvalidArgument(f"{what}: header length {n} runs past the end of the {file_size}-byte file")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{what}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise InvalidArgument(f"{what}: header must be a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    entries = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise InvalidArgument(f"{what}: tensor {name!r} needs dtype, shape and data_offsets [begin, end]") from None
        if dtype not in DTYPE_SIZES:
            raise InvalidArgument(f"{what}: tensor {name!r} has unknown dtype {dtype!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InvalidArgument(f"{what}: tensor {name!r} has a bad shape {list(shape)}")
        check_shape_bound(shape, DTYPE_SIZES[dtype], what=f"{what}: tensor {name!r}")
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise InvalidArgument(f"{what}: tensor {name!r} has bad data_offsets {[begin, end]}")
        expected = math.prod(shape) * DTYPE_SIZES[dtype]
        if end - begin != expected:
            raise InvalidArgument(
                f"{what}: tensor {name!r} spans {end - begin} bytes, expected {expected} for {dtype} {list(shape)}"
            )
        entries.append(HeaderEntry(name, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise InvalidArgument(f"{what}: tensor {e.name!r} starts at {e.begin}, expected {pos} (holes and overlaps are invalid)")
        pos = e.end
    if 8 + n + pos != file_size:
        raise InvalidArgument(f"{what}: data region ends at {8 + n + pos}, but the file has {file_size} bytes")
    return ParsedHeader(8 + n, tuple(entries), metadata if isinstance(metadata, dict) else {})
