"""A streamed block's bytes on the host, in the artifact's aligned layout
(every tensor 64-byte aligned, :mod:`hwr_client.core.layout`): matched to a
lease's block, packed from ordinary tensors, or cut into this rank's
AllGather shard. The backend (:mod:`dlo_runtime.backend`) moves each
:class:`HostBlock` to the device in one copy and binds :class:`Member` views.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import nn

import dlo_runtime.allgather as ag
from dlo_runtime.restore import Slot
from hwr_client.core.errors import FailedPrecondition
from hwr_client.core.layout import ALIGN


@dataclasses.dataclass(frozen=True, eq=False)
class Member:
    owner: nn.Module
    attr: str
    is_parameter: bool
    offset: int  # from the block's first byte
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    host: torch.Tensor  # the host view the tensor points at between uses


@dataclasses.dataclass(frozen=True, eq=False)
class HostBlock:
    name: str
    module: nn.Module
    host_bytes: torch.Tensor  # 1-D uint8: the block's contiguous bytes on host
    members: tuple[Member, ...]

    @property
    def nbytes(self) -> int:
        return int(self.host_bytes.numel())


def check_mapped(lease: Any) -> None:
    """The backend's check before each block copy and each forward: raises
    DataLoss when a file under the lease's mapping was rewritten or
    truncated in place since it was mapped, before the changed bytes are
    used or a page past a new end is touched (SIGBUS). One fstat per mapped
    file (:class:`hwr_client.mapping.MappedFileGuard`); no lease, no check."""
    if lease is not None:
        lease.check_unchanged()


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def set_tensor(owner: nn.Module, attr: str, is_parameter: bool, tensor: torch.Tensor) -> None:
    if is_parameter:
        param = owner._parameters[attr]
        assert param is not None, f"{attr}: a streamed parameter slot is never None"
        param.data = tensor  # keeps the Parameter object (hooks, references)
    else:
        owner._buffers[attr] = tensor


def member_view(raw: torch.Tensor, m: Member) -> torch.Tensor:
    return raw[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape)


def lease_blocks(streamed: Sequence[tuple[str, nn.Module, list[Slot]]], lease: Any) -> list[HostBlock]:
    """Matches each streamed module to its manifest block by name prefix and
    checks that its tensors are bound to the lease's views.

    Args:
        streamed: (qualified name, module, its tensor slots) per block.

    Raises:
        FailedPrecondition: a block absent from the artifact, a tensor set
            that differs, or a tensor not bound to the lease (restore first).
    """
    by_prefix = {b.prefix: b for b in lease.blocks}
    entries = {t.name: t for t in lease.manifest.tensors}
    views = lease.tensors()
    out = []
    for qual, blk, slots in streamed:
        entry = by_prefix.get(qual + ".")
        if entry is None:
            raise FailedPrecondition(f"offload block {qual!r}: artifact has no block with prefix {qual + '.'!r}")
        local = {qual + "." + s.name: s for s in slots}
        if len(local) != len(entry.tensors) or not all(n in local for n in entry.tensors):
            diff = sorted(set(local) ^ set(entry.tensors))[:5]
            raise FailedPrecondition(f"offload block {qual!r}: tensors differ from artifact block {entry.index}: {diff}")
        members = []
        for name in entry.tensors:
            s, view = local[name], views[name]
            t = s.tensor
            if t.data_ptr() != view.data_ptr():
                raise FailedPrecondition(f"offload block {qual!r}: {name} is not bound to the lease; call restore_model() first")
            te = entries[name]
            members.append(Member(s.module, s.attr, s.is_parameter, te.offset - entry.begin, te.nbytes,
                                   t.dtype, tuple(t.shape), view))
        out.append(HostBlock(qual, blk, lease.block_bytes(entry.index), tuple(members)))
    return out


def pack_layout(qual: str, slots: list[Slot]) -> tuple[list[tuple[nn.Module, str, bool, int, torch.Tensor]], int]:
    """Each tensor's offset in the block's aligned layout, and the size."""
    rows, pos = [], 0
    for s in slots:
        t = s.tensor
        if t.is_meta:
            raise FailedPrecondition(f"offload block {qual!r}: {s.name} is on meta; load the model first")
        pos = align(pos)
        rows.append((s.module, s.attr, s.is_parameter, pos, t))
        pos += t.numel() * t.element_size()
    return rows, pos


def pack_block(qual: str, blk: nn.Module, slots: list[Slot], *, out: torch.Tensor) -> HostBlock:
    """Packs a block's tensors into ``out`` (1-D uint8 of the size
    :func:`pack_layout` gives, pinned or not: the backend's choice) with the
    aligned layout and repoints them at it (the ordinary transport's one
    extra host copy; the original storage is released once nothing else
    references it)."""
    rows, pos = pack_layout(qual, slots)
    if out.numel() != pos:
        raise FailedPrecondition(f"offload block {qual!r}: packed buffer of {out.numel()} bytes, expected {pos}")
    host = out
    members = []
    for owner, attr, isp, off, t in rows:
        n = t.numel() * t.element_size()
        host[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        m = Member(owner, attr, isp, off, n, t.dtype, tuple(t.shape), host[:0])
        m = dataclasses.replace(m, host=member_view(host, m))
        set_tensor(owner, attr, isp, m.host)
        members.append(m)
    return HostBlock(qual, blk, host[:pos], tuple(members))


def shard_block(qual: str, blk: nn.Module, slots: list[Slot], lease_block: HostBlock | None, size: int, rank: int,
                 out: torch.Tensor) -> tuple[HostBlock, ag.ShardPlan]:
    """AllGather: writes this rank's shard of a block into ``out`` and
    points the block's tensors at placeholders (see
    :mod:`dlo_runtime.allgather`). The bytes come from the lease's block
    (``lease_block``) or, without one, straight from each tensor's bytes in
    the aligned layout (no full packed copy is made)."""
    if lease_block is not None:
        plan = ag.ShardPlan.of(lease_block.nbytes, size, rank)
        members = lease_block.members
        n = max(0, min(plan.shard, plan.nbytes - plan.begin))
        out[:n].copy_(lease_block.host_bytes[plan.begin : plan.begin + n])
        out[n:].zero_()
    else:
        rows, pos = pack_layout(qual, slots)
        plan = ag.ShardPlan.of(pos, size, rank)
        out.zero_()  # alignment gaps and padding
        members = []
        for owner, attr, isp, off, t in rows:
            nbytes = t.numel() * t.element_size()
            cut = plan.overlap(off, nbytes)
            if cut is not None:
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
                dst = off + cut[0] - plan.begin
                out[dst : dst + cut[1]].copy_(raw[cut[0] : cut[0] + cut[1]])
            members.append(Member(owner, attr, isp, off, nbytes, t.dtype, tuple(t.shape), t))
    held = tuple(dataclasses.replace(m, host=ag.placeholder(m.dtype, m.shape)) for m in members)
    for m in held:
        # The rank's full copy of the block is dropped here: the tensor
        # (a lease view or an ordinary tensor) is no longer referenced.
        set_tensor(m.owner, m.attr, m.is_parameter, m.host)
    return HostBlock(qual, blk, out[:0], held), plan
