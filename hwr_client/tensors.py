"""The torch half of publication: torch dtypes, plans built from tensors,
and the payload bytes of CPU tensors.

The torch-free half (plan records, :func:`~hwr_client.core.plan.check_plan`,
the wire conversion) is :mod:`hwr_client.core.plan`, which the daemon uses.
"""

from __future__ import annotations

import io
import mmap as _mmap
import os
from typing import Any, Iterator, Mapping, Sequence

import torch

from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_client.core.identity import Identity
from hwr_client.core.layout import DTYPE_SIZES, FileLayout, HeaderEntry, TensorSpec, parse_header
from hwr_client.core.plan import FILE_TARGET_BYTES, BlockSpec, FileSpec, PlanSpec, derive_blocks

#: safetensors dtype string -> torch dtype (sizes: core.layout.DTYPE_SIZES).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
assert TORCH_DTYPES.keys() == DTYPE_SIZES.keys()
_BY_TORCH = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors dtype string of a torch dtype.

    Raises:
        InvalidArgument: a dtype safetensors cannot store.
    """
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise InvalidArgument(f"dtype {dtype}: not storable; expected one of {sorted(map(str, _BY_TORCH))}") from None


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a safetensors dtype string.

    Raises:
        InvalidArgument: an unknown dtype string.
    """
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise InvalidArgument(f"dtype {name!r}: unknown; expected one of {sorted(TORCH_DTYPES)}") from None


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The planned form (name, dtype string, shape) of a tensor."""
    return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def build_plan(
    identity: Identity | Mapping | str,
    tensors: Mapping[str, torch.Tensor],
    *,
    blocks: Sequence[Sequence[str]] | None = None,
    ordered: bool = True,
    file_target_bytes: int = FILE_TARGET_BYTES,
) -> PlanSpec:
    """Arranges tensors into payload files.

    Non-block tensors go into the first file; blocks follow in execution
    order, packed into files of about ``file_target_bytes``.

    Args:
        identity: Identity, its dict document or its JSON text.
        tensors: name -> CPU tensor.
        blocks: name groups in execution order; None derives them from names.
            A group may be a ``(prefix, names)`` pair: the module prefix of
            the block (``encoder.block.0.``), for a block whose tensors all
            sit deeper than it (T5's ``block.0.layer.*``), where the names'
            common prefix would not be the module the DLO backend streams.
        ordered: whether the payload will be sent strictly sequentially.
        file_target_bytes: split block files at about this size.

    Raises:
        InvalidArgument: empty mapping, unknown names in blocks, bad names.
    """
    identity = Identity.coerce(identity)
    if not tensors:
        raise InvalidArgument("publication: expected at least one tensor, got none")
    groups = [_group(g) for g in blocks] if blocks is not None else derive_blocks(list(tensors))
    in_block = {n for _, g in groups for n in g}
    unknown = in_block - set(tensors)
    if unknown:
        raise InvalidArgument(f"publication: block tensors {sorted(unknown)[:5]} are not in the tensor mapping")
    spec = {name: spec_of(name, t) for name, t in tensors.items()}
    files: list[FileSpec] = []
    base = [spec[n] for n in tensors if n not in in_block]
    if base:
        files.append(FileSpec("base.safetensors", tuple(base)))
    current: list[TensorSpec] = []
    for _, group in groups:
        size = sum(spec[n].nbytes for n in group)
        if current and sum(s.nbytes for s in current) + size > file_target_bytes:
            files.append(FileSpec(f"blocks-{len(files):03d}.safetensors", tuple(current)))
            current = []
        current.extend(spec[n] for n in group)
    if current:
        files.append(FileSpec(f"blocks-{len(files):03d}.safetensors", tuple(current)))
    block_specs = tuple(BlockSpec(i, prefix, tuple(g)) for i, (prefix, g) in enumerate(groups))
    return PlanSpec(identity, tuple(files), block_specs, ordered)


def _group(group: Any) -> tuple[str, list[str]]:
    """``(prefix, names)`` of a block group: an explicit pair, or a name list
    whose common prefix is the block's."""
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], str) and not isinstance(group[1], str):
        prefix, names = group[0], list(group[1])
        bad = [n for n in names if not n.startswith(prefix)]
        if not names or bad or (prefix and not prefix.endswith(".")):
            raise InvalidArgument(f"publication: block prefix {prefix!r} must end in '.' and prefix every tensor of "
                                  f"its group, got {bad[:3] or 'no tensors'}")
        return prefix, names
    return _common_prefix(group), list(group)


def _common_prefix(names: Sequence[str]) -> str:
    if not names:
        raise InvalidArgument("publication: a block must name at least one tensor")
    first, last = min(names), max(names)
    i = 0
    while i < min(len(first), len(last)) and first[i] == last[i]:
        i += 1
    prefix = first[:i]
    return prefix[: prefix.rfind(".") + 1] if "." in prefix else prefix


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (contiguous copy only when needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        raise InvalidArgument(f"tensor on {t.device}: publication takes CPU tensors")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def iter_payload(
    layout: FileLayout, tensors: Mapping[str, torch.Tensor], chunk_bytes: int
) -> Iterator[tuple[int, memoryview]]:
    """Yields (data-region offset, bytes) chunks of one file's data region in
    order, padding included, each at most ``chunk_bytes``.

    Raises:
        InvalidArgument: a tensor whose dtype/shape differ from the layout.
    """
    zeros = memoryview(bytes(64))
    pos = 0
    for spec, off in zip(layout.tensors, layout.tensor_offsets):
        t = tensors[spec.name]
        if spec_of(spec.name, t) != spec:
            raise InvalidArgument(f"tensor {spec.name!r}: is {t.dtype} {list(t.shape)}, planned {spec.dtype} {list(spec.shape)}")
        if off > pos:
            yield pos, zeros[: off - pos]
        data = tensor_bytes(t)
        for i in range(0, len(data), chunk_bytes):
            yield off + i, data[i : i + chunk_bytes]
        pos = off + len(data)
    if layout.data_size > pos:
        yield pos, zeros[: layout.data_size - pos]


class SafetensorsFile:
    """One safetensors file: the header parsed strictly, the tensors handed
    out one at a time, either as views of a mapping or read into buffers of
    their own. The one safetensors reader of the client and the runtime.

    The header is parsed first (:func:`hwr_client.core.layout.parse_header`),
    so a truncated file, a garbage header or a header length over the limit
    is a clear error naming the file, before anything is allocated.

    Args:
        path: the file.
        mmap: True maps the file and hands out zero-copy views; False reads
            each tensor with ``readinto`` into a buffer of its own and never
            maps the file.
        writable: with ``mmap``, map copy-on-write (a write to a view stays
            in this process); False maps read-only, so a write faults
            instead of reaching the pages other processes share.

    Raises:
        InvalidArgument: naming ``path`` and the problem.

    Example:
        >>> with SafetensorsFile("model.safetensors", mmap=False) as f:   # doctest: +SKIP
        ...     weights = {e.name: f.tensor(e) for e in f.entries}
    """

    def __init__(self, path: str, *, mmap: bool = True, writable: bool = False):
        self.path = path
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise InvalidArgument(f"{path}: cannot open ({exc.strerror})") from None
        try:
            size = os.fstat(f.fileno()).st_size
            header = parse_header(f, size, what=path)
            self._mm: _mmap.mmap | None = None
            if mmap and size > header.data_start:
                access = _mmap.ACCESS_COPY if writable else _mmap.ACCESS_READ
                self._mm = _mmap.mmap(f.fileno(), 0, access=access)
        except BaseException:
            f.close()
            raise
        self._data_start = header.data_start
        self._closed = False
        #: Tensor entries in file order (HWR padding left out).
        self.entries: list[HeaderEntry] = header.tensors()
        # The mapping holds its own reference to the file: only readinto
        # needs the file object open.
        self._file: io.BufferedReader | None = None if mmap else f
        if mmap:
            f.close()
        self.mmap = mmap

    def tensor(self, e: HeaderEntry) -> torch.Tensor:
        """The tensor of entry ``e`` (a view of the mapping, or a fresh
        buffer).

        Raises:
            FailedPrecondition: a short read (the file changed underneath).
        """
        dtype = TORCH_DTYPES[e.dtype]
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=dtype)
        if self._closed:
            raise FailedPrecondition(f"{self.path}: read of tensor {e.name!r} after close; expected an open file")
        if self.mmap:
            assert self._mm is not None  # mapped whenever a tensor has bytes
            raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=e.end - e.begin, offset=self._data_start + e.begin)
            return raw.view(dtype).reshape(e.shape)
        assert self._file is not None
        buf = torch.empty(e.end - e.begin, dtype=torch.uint8)
        self._file.seek(self._data_start + e.begin)
        got = self._file.readinto(buf.numpy().data)
        if got != e.end - e.begin:
            raise FailedPrecondition(f"{self.path}: short read of tensor {e.name!r}, {got} of {e.end - e.begin} "
                                     "bytes; expected an unchanged file")
        return buf.view(dtype).view(e.shape)

    def close(self) -> None:
        """Closes the file. Views already handed out keep the mapping alive
        (each holds a reference to it); the mapping goes with the last one."""
        f, self._file, self._mm, self._closed = self._file, None, None, True
        if f is not None:
            f.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Maps a safetensors file read-only and returns zero-copy tensors.

    Raises:
        InvalidArgument: naming ``path`` and the problem (see
            :class:`SafetensorsFile`).
    """
    with SafetensorsFile(path) as f:
        return {e.name: f.tensor(e) for e in f.entries}
