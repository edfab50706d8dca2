"""The loader's host-weight plan: serve a component straight from its
checkpoint's mapping when its runtime layout IS the checkpoint layout.

:func:`preflight` builds one :class:`HostWeightPlan` before any weight is
materialized, reading shard headers only. The direct ``checkpoint-mmap``
plan is accepted only when every required parameter and persistent buffer
has exactly one checkpoint source with the same name, shape and dtype (no
cast, no pack), no custom loader transform (``fuse_qkv``) applies, the
topology is TP1 without HSDP or quantization (``from_pretrained`` offers
neither), and every streamed block is one byte span per shard it touches
with little interleaved waste. Otherwise the plan records the first reasons
and the component loads through HWR or the ordinary loader.

``host_plan="auto"`` takes the cheapest path for the case: checkpoint-mmap
where preflight accepts it (nothing to read but headers, nothing to copy,
no daemon call: a same-dtype checkpoint starts as fast as the library's
own mapped load), else HWR (a warm start maps the final layout the cast or
transform produced once). The report names the path taken: outcome
``CHECKPOINT_MMAP`` and ``host_plan`` ``"checkpoint-mmap"``, or the HWR
outcome with the refusal's reasons in ``host_plan_reason``.

DLO copies a block as ONE host range (:mod:`dlo_runtime.backend`: one
``block_bytes`` tensor, one copy or one staging memcpy per block). A block
cut across shards is made one range without a copy: its pieces' file pages
are mapped back to back (read-only, ``MAP_SHARED`` + ``MAP_FIXED`` into one
reserved range), so the block is contiguous in virtual memory while its
pages stay the page cache's, shared by every worker (:func:`_stitch`).

An accepted plan is handed as is to DLO: :class:`CheckpointMapping` maps
the plan's files read-only (``PROT_READ`` + ``MAP_SHARED`` through the one
safetensors reader, :class:`hwr_client.tensors.SafetensorsFile`), binds each
runtime tensor to a view of its source, and answers the lease API the
backend consumes (blocks, tensors, block bytes, regions), so the backend
neither rescans files nor repeats the decision. Nothing is published; N
workers mapping the same files share their page-cache pages.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import warnings
import weakref
from typing import Sequence

import torch
from torch import nn

from hwr_client.core.errors import FailedPrecondition
from hwr_client.mapping import MappedFileGuard, Region, _readonly_frombuffer
from hwr_client.tensors import TORCH_DTYPES, SafetensorsFile

from dlo_runtime.checkpoint import CheckpointReader
from dlo_runtime.pin_plan import Extent, PinRegion, file_key, page_ceil, page_floor
from dlo_runtime.restore import tensor_slots

#: ``from_pretrained(host_plan=...)`` values.
HOST_PLANS = ("auto", "checkpoint-mmap", "hwr", "ordinary")

#: A block's byte span may hold this much more than its own tensors (other
#: tensors interleaved by the writer's dtype order) and still stream as one
#: range.
MAX_SPAN_WASTE = 0.25


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one runtime tensor comes from: file index, absolute byte
    offset in the file, byte count, dtype, shape."""

    file: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class BlockSpan:
    """A streamed block as one byte span of one shard (lease-block API:
    ``index``, ``prefix``, ``tensors``, ``begin``, ``end``). A block cut
    across shards has ``pieces``: ``(file, begin, end)`` per shard, mapped
    back to back at serving time; then ``file`` is -1 and ``begin``/``end``
    are set by :class:`CheckpointMapping` in the stitched range."""

    index: int
    prefix: str
    tensors: tuple[str, ...]
    file: int
    begin: int
    end: int
    pieces: tuple[tuple[int, int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class HostWeightPlan:
    """The host-weight plan of one component.

    Attributes:
        kind: ``"checkpoint-mmap"`` when accepted, else ``"refused"``.
        reasons: why it was refused (empty when accepted).
        files: the checkpoint shards.
        sources: runtime tensor name -> :class:`Source` (accepted only).
        blocks: the streamed blocks' spans (accepted only).
    """

    kind: str
    reasons: tuple[str, ...]
    files: tuple[str, ...]
    sources: dict[str, Source] = dataclasses.field(default_factory=dict)
    blocks: tuple[BlockSpan, ...] = ()

    @property
    def accepted(self) -> bool:
        return self.kind == "checkpoint-mmap"

    @property
    def reason(self) -> str:
        """The reasons in one line ("" when accepted)."""
        return "; ".join(self.reasons)


def preflight(skeleton: nn.Module, files: Sequence[str], blocks: Sequence[nn.Module], *,
              transforms: Sequence[str] = ()) -> HostWeightPlan:
    """Decides the direct checkpoint-mmap plan from headers only.

    Args:
        skeleton: the runtime skeleton (meta parameters with runtime dtypes).
        files: its safetensors shards.
        blocks: the blocks DLO will stream (each one span per shard it
            touches; a block cut across shards is stitched at serving time).
        transforms: custom loader transforms that apply (``"fuse_qkv"``):
            any refuses the plan.

    Returns:
        The plan: accepted, or refused with the reasons (first 8).
    """
    files = tuple(files)
    reasons: list[str] = [f"custom loader transform {t!r} changes the layout" for t in transforms]
    try:
        reader = CheckpointReader(list(files), mmap=False)  # headers only: nothing mapped, nothing read
    except FailedPrecondition as exc:  # a tensor in two shards: two sources
        return HostWeightPlan("refused", (str(exc),), files)
    with reader:
        where = dict(reader._where)
    walk = tensor_slots(skeleton)
    aliases = set(skeleton.state_dict(keep_vars=True)) - {s.name for s in walk.slots}
    sources: dict[str, Source] = {}
    for s in walk.slots:
        found = where.get(s.name)
        if found is None:
            reasons.append(f"missing key {s.name!r} (no checkpoint source)")
            continue
        i, e = found
        dtype = TORCH_DTYPES.get(e.dtype)
        if tuple(e.shape) != tuple(s.tensor.shape):
            reasons.append(f"{s.name!r}: checkpoint shape {list(e.shape)}, runtime {list(s.tensor.shape)}")
        elif dtype != s.tensor.dtype:
            reasons.append(f"{s.name!r}: checkpoint {e.dtype}, runtime {s.tensor.dtype} (a cast)")
        else:
            sources[s.name] = Source(i, reader._files[i]._data_start + e.begin, e.end - e.begin, dtype, tuple(e.shape))
    unexpected = sorted(n for n in where if n not in sources and n not in aliases and n not in
                        {s.name for s in walk.slots})
    reasons += [f"unexpected checkpoint key {n!r}" for n in unexpected[:3]]
    spans: list[BlockSpan] = []
    if not reasons:
        names = {id(m): n for n, m in skeleton.named_modules()}
        for j, b in enumerate(blocks):
            prefix = names[id(b)] + "."
            members = [prefix + s.name for s in tensor_slots(b).slots]
            src = [sources[n] for n in members]
            if len({x.file for x in src}) > 1:
                if not _CAN_STITCH:
                    reasons.append(f"block {prefix[:-1]!r} spans {len({x.file for x in src})} shards and this "
                                   f"platform cannot map them back to back (no MAP_FIXED)")
                    continue
                pieces = tuple((f, min(x.offset for x in src if x.file == f),
                                max(x.offset + x.nbytes for x in src if x.file == f))
                               for f in sorted({x.file for x in src}))
                own, spread = sum(x.nbytes for x in src), sum(e - b for _, b, e in pieces)
                if spread > (1 + MAX_SPAN_WASTE) * own:
                    reasons.append(f"block {prefix[:-1]!r}: its tensors are spread over {spread} bytes of "
                                   f"{len(pieces)} shards for {own}")
                elif any(_stitched_offset(pieces, x) % x.dtype.itemsize for x in src):
                    reasons.append(f"block {prefix[:-1]!r}: a tensor is not aligned to its dtype inside the "
                                   f"stitched span")
                else:
                    spans.append(BlockSpan(j, prefix, tuple(members), -1, 0, 0, pieces))
                continue
            begin, end = min(x.offset for x in src), max(x.offset + x.nbytes for x in src)
            own = sum(x.nbytes for x in src)
            if end - begin > (1 + MAX_SPAN_WASTE) * own:
                reasons.append(f"block {prefix[:-1]!r}: its tensors are spread over {end - begin} bytes for {own}")
            elif any((x.offset - begin) % x.dtype.itemsize for x in src):
                reasons.append(f"block {prefix[:-1]!r}: a tensor is not aligned to its dtype inside the span")
            else:
                spans.append(BlockSpan(j, prefix, tuple(members), src[0].file if src else 0, begin, end))
    if reasons:
        return HostWeightPlan("refused", tuple(reasons[:8]), files)
    return HostWeightPlan("checkpoint-mmap", (), files, sources, tuple(spans))


_PAGE = mmap.ALLOCATIONGRANULARITY
#: MAP_FIXED: Linux and macOS both use 0x10 (the mmap module does not export it).
_MAP_FIXED = 0x10
_CAN_STITCH = os.name == "posix" and hasattr(mmap, "MAP_ANONYMOUS")


def _piece_pages(begin: int, end: int) -> tuple[int, int]:
    """The page-aligned file offset and length that cover [begin, end)."""
    lo = begin // _PAGE * _PAGE
    return lo, -(-(end - lo) // _PAGE) * _PAGE


def _stitched_offset(pieces: Sequence[tuple[int, int, int]], src: Source) -> int:
    """``src``'s byte offset from the block's first byte in the stitched
    range (each piece's pages follow the previous piece's)."""
    pos = 0
    for f, b, e in pieces:
        lo, length = _piece_pages(b, e)
        if f == src.file:
            return pos + src.offset - lo - (pieces[0][1] - _piece_pages(pieces[0][1], pieces[0][2])[0])
        pos += length
    raise KeyError(src)


def _stitch(parts: Sequence[tuple[str, int, int]]) -> torch.Tensor:
    """Maps ``(path, page-aligned offset, page-multiple length)`` parts
    back to back, read-only and shared, into one reserved range; returns it
    as 1-D uint8. The range is unmapped when the last tensor on it dies
    (the finalizer of the buffer object the tensor holds).

    Raises:
        OSError: the reservation or a mapping failed (nothing left mapped).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    total = sum(n for _, _, n in parts)
    failed = ctypes.c_void_p(-1).value
    # Reserve the whole range first (PROT_NONE, anonymous) so the pieces
    # land in address space nobody else can take between the calls.
    base = libc.mmap(None, total, mmap.PROT_NONE if hasattr(mmap, "PROT_NONE") else 0,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, failed):
        raise OSError(ctypes.get_errno(), f"checkpoint mapping: reserving {total} bytes failed")
    pos = 0
    try:
        for path, offset, length in parts:
            fd = os.open(path, os.O_RDONLY)
            try:
                got = libc.mmap(base + pos, length, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
            finally:
                os.close(fd)  # the mapping holds the file; the descriptor is not needed
            if got != base + pos:
                raise OSError(ctypes.get_errno(), f"checkpoint mapping: mapping {path} at +{offset} failed")
            pos += length
    except BaseException:
        libc.munmap(base, total)
        raise
    buf = (ctypes.c_uint8 * total).from_address(base)
    fin = weakref.finalize(buf, libc.munmap, base, total)
    # Not at interpreter exit: a view still alive then may be read by a
    # late destructor; the process's own exit unmaps it.
    fin.atexit = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)  # holds ``buf``: unmapped after the last view


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    offset: int
    nbytes: int


class _Manifest:
    def __init__(self, tensors: list[_Entry]):
        self.tensors = tensors


class CheckpointMapping:
    """An accepted plan's files mapped read-only, answering the lease API
    :class:`~dlo_runtime.backend.OffloadBackend` consumes (``blocks``,
    ``manifest.tensors``, ``tensors()``, ``block_bytes()``, ``regions()``,
    ``close()``). Closing drops the files; views handed out keep their
    mapping alive (each holds a reference)."""

    def __init__(self, plan: HostWeightPlan):
        if not plan.accepted:
            raise FailedPrecondition(f"checkpoint mapping: the plan was refused ({plan.reason})")
        self.plan = plan
        self._files = [SafetensorsFile(p, mmap=True, writable=False) for p in plan.files]
        self.check_unchanged = MappedFileGuard.open(plan.files).check  # DataLoss once a mapped file changes in place
        # The reader's read-only mapping (PROT_READ: a write faults), whole.
        self._raw = [_readonly_frombuffer(f._mm) if f._mm is not None else torch.empty(0, dtype=torch.uint8)
                     for f in self._files]
        self._views = {n: self._raw[s.file][s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
                       for n, s in plan.sources.items()}
        # Offsets in one address space per file: a block's begin and its
        # tensors' offsets must be comparable.
        entries = {n: _Entry(n, s.offset, s.nbytes) for n, s in plan.sources.items()}
        self.blocks: list[BlockSpan] = []
        #: Blocks cut across shards: their stitched range (1-D uint8), by index.
        self._stitched: dict[int, torch.Tensor] = {}
        for b in plan.blocks:
            if b.pieces:
                # One range for DLO, no copy: the pieces' pages back to back.
                raw = _stitch([(plan.files[f], *_piece_pages(lo, hi)) for f, lo, hi in b.pieces])
                lead = b.pieces[0][1] - _piece_pages(b.pieces[0][1], b.pieces[0][2])[0]
                end = lead
                for n in b.tensors:
                    src = plan.sources[n]
                    off = lead + _stitched_offset(b.pieces, src)
                    # The block's own address space: its begin and its tensors' offsets are comparable.
                    self._views[n] = raw[off:off + src.nbytes].view(src.dtype).view(src.shape)
                    entries[n] = _Entry(n, off, src.nbytes)
                    end = max(end, off + src.nbytes)
                self._stitched[b.index] = raw
                b = dataclasses.replace(b, begin=lead, end=end)
            self.blocks.append(b)
        self.manifest = _Manifest(list(entries.values()))
        self.key = ""
        #: The daemon session registrations are admitted under (set by the
        #: loader when a daemon answers; None: not admission-controlled).
        self.session = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Runtime name -> read-only view of its checkpoint bytes."""
        return self._views

    def block_bytes(self, index: int) -> torch.Tensor:
        """The block's span as 1-D uint8 (one copy range for DLO)."""
        b = next(b for b in self.blocks if b.index == index)
        raw = self._stitched[b.index] if b.pieces else self._raw[b.file]
        return raw[b.begin:b.end]

    def regions(self) -> list[Region]:
        """The mapped files (what a registrar may register read-only)."""
        out = [Region(p, int(r.data_ptr()), int(r.numel())) for p, r in zip(self.plan.files, self._raw) if r.numel()]
        for index, r in self._stitched.items():
            pieces = next(b.pieces for b in self.blocks if b.index == index)
            out.append(Region("+".join(self.plan.files[f] for f, _, _ in pieces), int(r.data_ptr()), int(r.numel())))
        return out

    def registration_regions(self) -> list[PinRegion]:
        """What to register: the blocks' spans, page-rounded, merged per
        file, and each stitched block's range, with the file pages each
        maps (the daemon counts a page a stitched range maps again once).
        Not the whole files: non-block tensors move to the device once."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for b in self.blocks:
            if not b.pieces:
                spans.setdefault(b.file, []).append((page_floor(b.begin), page_ceil(b.end)))
        out = []
        for f, ranges in sorted(spans.items()):
            merged: list[tuple[int, int]] = []
            for lo, hi in sorted(ranges):
                if merged and lo <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
                else:
                    merged.append((lo, hi))
            path, base = self.plan.files[f], int(self._raw[f].data_ptr())
            out += [PinRegion(path, base + lo, hi - lo, (Extent(file_key(path), lo, hi - lo),)) for lo, hi in merged]
        for index, r in self._stitched.items():
            pieces = next(b.pieces for b in self.blocks if b.index == index)
            extents = tuple(Extent(file_key(self.plan.files[f]), *_piece_pages(lo, hi)) for f, lo, hi in pieces)
            out.append(PinRegion("+".join(self.plan.files[f] for f, _, _ in pieces), int(r.data_ptr()),
                                 int(r.numel()), extents))
        return out

    def bind(self, skeleton: nn.Module) -> None:
        """Points every parameter and persistent buffer at its view."""
        from dlo_runtime.pretrained.skeleton import rebind

        replaced: dict[int, torch.Tensor] = {}
        for s in tensor_slots(skeleton).slots:
            v = self._views[s.name]
            replaced[id(s.tensor)] = nn.Parameter(v, requires_grad=False) if s.is_parameter else v
        rebind(skeleton, replaced)

    def close(self) -> None:
        for f in self._files:
            f.close()
        # Stitched ranges are unmapped when their last view dies.
        self._raw, self._stitched = [], {}


def describe(plan: HostWeightPlan | None, chosen: str, asked: str = "") -> str:
    """A report line: the plan taken, what was asked for (``auto``), and
    why."""
    how = f"{chosen} (host_plan={asked!r})" if asked and asked != chosen else chosen
    if chosen == "checkpoint-mmap":
        return (f"{how}: runtime layout equals the checkpoint's (names, shapes, dtypes; TP1; no transform): "
                "served from the checkpoint's own pages, no daemon call, nothing leased or published")
    if plan is not None and not plan.accepted:
        return f"{how}: checkpoint-mmap refused: {plan.reason}"
    return how


__all__ = ["HOST_PLANS", "BlockSpan", "CheckpointMapping", "HostWeightPlan", "Source", "describe", "preflight"]
