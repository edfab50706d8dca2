"""The loader's host-weight plan: serve a component straight from its
checkpoint's mapping when its runtime layout IS the checkpoint layout.

:func:`preflight` builds one :class:`HostWeightPlan` before any weight is
materialized, reading shard headers only. The direct ``checkpoint-mmap``
plan is accepted only when every required parameter and persistent buffer
has exactly one checkpoint source with the same name, shape and dtype (no
cast, no pack), no custom loader transform (``fuse_qkv``) applies, the
topology is TP1 without HSDP or quantization (``from_pretrained`` offers
neither), and every streamed block is one byte span of one shard (DLO
copies a block as one range). Otherwise the plan records the first reasons
and the component loads through HWR or the ordinary loader.

An accepted plan is handed as is to DLO: :class:`CheckpointMapping` maps
the plan's files read-only (``PROT_READ`` + ``MAP_SHARED`` through the one
safetensors reader, :class:`hwr_client.tensors.SafetensorsFile`), binds each
runtime tensor to a view of its source, and answers the lease API the
backend consumes (blocks, tensors, block bytes, regions), so the backend
neither rescans files nor repeats the decision. Nothing is published; N
workers mapping the same files share their page-cache pages.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import nn

from hwr_client.core.errors import FailedPrecondition
from hwr_client.mapping import Region, _readonly_frombuffer
from hwr_client.tensors import TORCH_DTYPES, SafetensorsFile

from dlo_runtime.checkpoint import CheckpointReader
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
    ``index``, ``prefix``, ``tensors``, ``begin``, ``end``)."""

    index: int
    prefix: str
    tensors: tuple[str, ...]
    file: int
    begin: int
    end: int


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
        blocks: the blocks DLO will stream (each must be one span).
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
                reasons.append(f"block {prefix[:-1]!r} spans {len({x.file for x in src})} shards (not one range)")
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
        # The reader's read-only mapping (PROT_READ: a write faults), whole.
        self._raw = [_readonly_frombuffer(f._mm) if f._mm is not None else torch.empty(0, dtype=torch.uint8)
                     for f in self._files]
        self._views = {n: self._raw[s.file][s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
                       for n, s in plan.sources.items()}
        # Offsets in one address space per file: a block's begin and its
        # tensors' offsets must be comparable, and a block never crosses files.
        self.blocks = list(plan.blocks)
        self.manifest = _Manifest([_Entry(n, s.offset, s.nbytes) for n, s in plan.sources.items()])
        self.key = ""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Runtime name -> read-only view of its checkpoint bytes."""
        return self._views

    def block_bytes(self, index: int) -> torch.Tensor:
        """The block's span as 1-D uint8 (one copy range for DLO)."""
        b = next(b for b in self.blocks if b.index == index)
        return self._raw[b.file][b.begin:b.end]

    def regions(self) -> list[Region]:
        """The mapped files (what a registrar may register read-only)."""
        return [Region(p, int(r.data_ptr()), int(r.numel())) for p, r in zip(self.plan.files, self._raw) if r.numel()]

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
        self._raw = []


def describe(plan: HostWeightPlan | None, chosen: str) -> str:
    """A report line: the plan chosen and why."""
    if chosen == "checkpoint-mmap":
        return "checkpoint-mmap: runtime layout equals the checkpoint's (names, shapes, dtypes; TP1; no transform)"
    if plan is not None and not plan.accepted:
        return f"{chosen}: checkpoint-mmap refused: {plan.reason}"
    return chosen


__all__ = ["HOST_PLANS", "BlockSpan", "CheckpointMapping", "HostWeightPlan", "Source", "describe", "preflight"]
