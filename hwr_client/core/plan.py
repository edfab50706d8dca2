"""Publication plans: which tensors go into which payload file, in what order,
and which tensors form each streamable block.

The client builds a plan from tensors (:func:`hwr_client.tensors.build_plan`,
the torch half), the daemon receives it over the wire (:func:`from_proto`)
and both check it with ONE function (:func:`check_plan`), which also computes
the aligned file layouts and the block byte ranges that end up in the
manifest. This module is torch-free: the daemon imports it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import InvalidArgument
from hwr_client.core.identity import Identity
from hwr_client.core.layout import FileLayout, TensorSpec, layout_file

#: Default size at which block files are split: blocks are packed into files
#: of about this size (a block is never split across files).
FILE_TARGET_BYTES = 512 * 1024 * 1024
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# `blocks.3.`, `layers.3.`, `transformer_blocks.3.`, `single_transformer_blocks.3.`,
# optionally under a module path (`model.layers.3.`).
_BLOCK_NAME = re.compile(r"^((?:.*\.)?(?:blocks|layers|transformer_blocks|single_transformer_blocks|h)\.)(\d+)\.")


@dataclasses.dataclass(frozen=True)
class FileSpec:
    """One payload file as planned: a label, its tensors in layout order,
    and optionally the SHA-256 hex the client expects for the whole file
    (empty when not declared; checked at commit when given)."""

    name: str
    tensors: tuple[TensorSpec, ...]
    declared_sha256: str = ""


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """One streamable block as planned: its position in execution order,
    the name prefix its tensors share (``blocks.3.``) and their names, which
    must be adjacent and in order in one file."""

    index: int
    prefix: str
    tensors: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """A publication plan: which tensors go into which file, in what order,
    and which form each block. Unchecked; :func:`check_plan` checks it.

    ``ordered``: the payload arrives strictly in file and offset order, so
    the daemon hashes while writing (otherwise it hashes by read-back).
    ``declared_content_digest``: the ``sha256:<hex>`` content digest the
    client expects, checked at commit; empty if none.
    """

    identity: Identity
    files: tuple[FileSpec, ...]
    blocks: tuple[BlockSpec, ...]
    ordered: bool = True
    declared_content_digest: str = ""


@dataclasses.dataclass(frozen=True)
class CheckedBlock:
    """A block of a checked plan with its byte range: ``[begin, end)`` are
    ABSOLUTE offsets in file ``file`` (header included), from the first
    tensor's first byte to the last tensor's last."""

    index: int
    prefix: str
    file: int
    begin: int
    end: int
    tensors: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CheckedPlan:
    """A plan that passed :func:`check_plan`, with one aligned layout per
    file (same order as ``plan.files``) and the blocks' byte ranges."""

    plan: PlanSpec
    layouts: tuple[FileLayout, ...]
    blocks: tuple[CheckedBlock, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of all payload files together, headers included."""
        return sum(lay.file_size for lay in self.layouts)


def derive_blocks(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Groups tensor names into blocks by their ``<stack>.<N>.`` prefix.

    Stacks keep the order in which they first appear; within a stack blocks
    are ordered by N numerically. Names that match no stack are not in a block.
    """
    stacks: dict[str, dict[int, list[str]]] = {}
    for name in names:
        m = _BLOCK_NAME.match(name)
        if m:
            stacks.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(name)
    return [(f"{stack}{n}.", group[n]) for stack, group in stacks.items() for n in sorted(group)]


def check_plan(plan: PlanSpec) -> CheckedPlan:
    """Validates a plan and computes its layouts and block ranges.

    Raises:
        InvalidArgument: naming the file, tensor or block at fault.
    """
    if not plan.files:
        raise InvalidArgument("publication plan: expected at least one file, got none")
    where: dict[str, tuple[int, int]] = {}
    layouts = []
    for fi, f in enumerate(plan.files):
        if not f.tensors:
            raise InvalidArgument(f"publication plan: file {fi} ({f.name!r}) has zero tensors")
        if f.declared_sha256 and not _HEX64.match(f.declared_sha256):
            raise InvalidArgument(f"publication plan: file {fi} declared_sha256 must be 64 lowercase hex")
        for ti, t in enumerate(f.tensors):
            if t.name in where:
                raise InvalidArgument(f"publication plan: duplicate tensor name {t.name!r}")
            where[t.name] = (fi, ti)
        layouts.append(layout_file(f.tensors))
    if plan.declared_content_digest and not re.match(r"^sha256:[0-9a-f]{64}$", plan.declared_content_digest):
        raise InvalidArgument("publication plan: declared_content_digest must be 'sha256:<64 hex>'")
    checked: list[CheckedBlock] = []
    owner: dict[str, int] = {}  # tensor name -> the block that holds it
    for bi, b in enumerate(plan.blocks):
        if b.index != bi:
            raise InvalidArgument(f"publication plan: block {bi} has index {b.index}, expected {bi}")
        if not b.tensors:
            raise InvalidArgument(f"publication plan: block {bi} ({b.prefix!r}) names no tensors")
        for n in b.tensors:
            if n not in where:
                raise InvalidArgument(f"publication plan: block {bi} names unknown tensor {n!r}")
            if n in owner:
                raise InvalidArgument(f"publication plan: tensor {n!r} is in blocks {owner[n]} and {bi}")
            owner[n] = bi
        fi, t0 = where[b.tensors[0]]
        for k, n in enumerate(b.tensors):
            if where[n] != (fi, t0 + k):
                raise InvalidArgument(
                    f"publication plan: block {bi} ({b.prefix!r}) tensors must be adjacent and in order in one file; "
                    f"{n!r} is not"
                )
        lay = layouts[fi]
        last = lay.tensors[t0 + len(b.tensors) - 1]
        begin = lay.data_start + lay.tensor_offsets[t0]
        end = lay.data_start + lay.tensor_offsets[t0 + len(b.tensors) - 1] + last.nbytes
        checked.append(CheckedBlock(bi, b.prefix, fi, begin, end, tuple(b.tensors)))
    return CheckedPlan(plan, tuple(layouts), tuple(checked))


def to_proto(plan: PlanSpec) -> pb.PublishPlan:
    """The wire form of ``plan`` (:func:`from_proto` reads it back)."""
    return pb.PublishPlan(
        identity_json=plan.identity.to_json(),
        files=[
            pb.FilePlan(
                name=f.name,
                declared_sha256=f.declared_sha256,
                tensors=[pb.TensorPlan(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in f.tensors],
            )
            for f in plan.files
        ],
        blocks=[pb.BlockPlan(index=b.index, prefix=b.prefix, tensors=list(b.tensors)) for b in plan.blocks],
        ordered=plan.ordered,
        declared_content_digest=plan.declared_content_digest,
    )


def from_proto(msg: pb.PublishPlan) -> PlanSpec:
    """Converts a wire plan; identity and names are validated here, the rest
    by :func:`check_plan`.

    Raises:
        InvalidArgument: bad identity JSON or field.
    """
    identity = Identity.from_json(msg.identity_json)
    files = tuple(
        FileSpec(f.name, tuple(TensorSpec(t.name, t.dtype, tuple(int(d) for d in t.shape)) for t in f.tensors),
                 f.declared_sha256)
        for f in msg.files
    )
    blocks = tuple(BlockSpec(b.index, b.prefix, tuple(b.tensors)) for b in msg.blocks)
    return PlanSpec(identity, files, blocks, msg.ordered, msg.declared_content_digest)
