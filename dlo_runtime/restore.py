"""Warm restore: bind a module's tensors to a lease's views, proven first.

:func:`plan_restore` checks, without touching the module, that every parameter
and persistent buffer has exactly one artifact tensor with the same name,
shape and dtype, that the artifact has no tensor the module lacks, and that
nothing would be left on the meta device. :func:`commit_restore` then binds
each parameter and buffer to its read-only view: no byte is copied. A plan
that fails raises and leaves the module exactly as it was.

:func:`restore_model` is plan + commit. :func:`finalize_shared` runs shared
(non-byte-changing) finalization and proves it changed neither the restored
bytes nor their data pointers.

Example:
    >>> with client.acquire(key) as lease:           # doctest: +SKIP
    ...     result = restore_model(skeleton, lease)
    ...     finalize_shared(skeleton, lambda m: m.eval())
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
import xxhash
from torch import nn

from hwr_client.core.errors import FailedPrecondition

log = logging.getLogger(__name__)


class Binding(NamedTuple):
    """One module tensor and the artifact view it will be bound to."""

    name: str  # qualified name in the module (== artifact tensor name)
    owner: str  # qualified name of the owning submodule
    attr: str  # attribute name inside the owner
    is_parameter: bool
    module: nn.Module  # the owning submodule itself (commit binds without a lookup)


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """A proven restore: what to bind, and from which lease (borrowed).

    ``aliased``: some tensor has more than one owner (tied weights), so the
    commit must rebind every alias, not just the first owner.
    """

    bindings: tuple[Binding, ...]
    nbytes: int
    lease: Any = dataclasses.field(repr=False, compare=False)
    aliased: bool = False


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What :func:`restore_model` did. ``copies`` is always 0: tensors are views."""

    tensors: int
    parameters: int
    buffers: int
    nbytes: int
    copies: int = 0


class Slot(NamedTuple):
    """Where one parameter or persistent buffer lives in a module tree."""

    name: str  # qualified name
    owner: str  # qualified name of the owning submodule
    module: nn.Module  # the owning submodule
    attr: str
    tensor: torch.Tensor
    is_parameter: bool


@dataclasses.dataclass
class TensorSlots:
    """One walk over a module tree: every parameter and persistent buffer
    (a tensor with several owners is listed once, under its first name),
    plus what a restore must also know about the rest of the tree."""

    slots: list[Slot]
    aliased: bool  # a tensor has two owners (tied weights); a shared
    # submodule is not aliasing: its one table serves every name
    meta_non_persistent: list[str]  # non-persistent buffers still on meta


def tensor_slots(module: nn.Module) -> TensorSlots:
    """Walks ``module`` once (see :class:`TensorSlots`).

    This is the warm start's inner loop: it runs a few times per start over
    every tensor of the model, so it touches each module's tables directly
    instead of going through ``named_parameters``/``named_buffers``.
    """
    seen: set[int] = set()
    slots: list[Slot] = []
    meta_np: list[str] = []
    aliased = False
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        prefix = owner_name + "." if owner_name else ""
        for attr, p in owner._parameters.items():
            if p is None:
                continue
            if id(p) in seen:
                aliased = True
                continue
            seen.add(id(p))
            slots.append(Slot(prefix + attr, owner_name, owner, attr, p, True))
        if not owner._buffers:
            continue
        non_persistent = owner._non_persistent_buffers_set
        for attr, b in owner._buffers.items():
            if b is None:
                continue
            if attr in non_persistent:
                if b.is_meta:
                    meta_np.append(prefix + attr)
                continue
            if id(b) in seen:
                aliased = True
                continue
            seen.add(id(b))
            slots.append(Slot(prefix + attr, owner_name, owner, attr, b, False))
    return TensorSlots(slots, aliased, sorted(set(meta_np)))


def module_tensors(module: nn.Module) -> Iterator[tuple[str, str, str, torch.Tensor, bool]]:
    """(qualified name, owner, attr, tensor, is_parameter) for every parameter
    and persistent buffer, shared tensors reported once."""
    for s in tensor_slots(module).slots:
        yield s.name, s.owner, s.attr, s.tensor, s.is_parameter


def plan_restore(module: nn.Module, lease: Any) -> RestorePlan:
    """Proves that ``lease`` restores ``module`` exactly; touches nothing.

    Args:
        module: the skeleton (usually on the meta device).
        lease: any object with the MappedArtifact API.

    Returns:
        The plan (it borrows the lease; the caller still owns it).

    Raises:
        FailedPrecondition: naming every missing, extra or mismatching tensor.
    """
    views = lease.tensors()
    walk = tensor_slots(module)
    problems: list[str] = []
    bindings: list[Binding] = []
    nbytes = 0
    for s in walk.slots:
        v = views.get(s.name)
        if v is None:
            problems.append(f"{s.name}: missing from the artifact")
            continue
        t = s.tensor
        if v.shape != t.shape or v.dtype != t.dtype:
            problems.append(f"{s.name}: artifact has {v.dtype} {list(v.shape)}, module expects {t.dtype} {list(t.shape)}")
            continue
        bindings.append(Binding(s.name, s.owner, s.attr, s.is_parameter, s.module))
        nbytes += v.nbytes
    if len(bindings) != len(views):
        # Every binding matched a distinct view name, so equal counts mean
        # no extras; only a mismatch needs the set difference.
        names = {s.name for s in walk.slots}
        problems += [f"{n}: in the artifact but not a parameter or persistent buffer of the module"
                     for n in views if n not in names]
    problems += [f"{n}: non-persistent buffer left on meta (the artifact cannot restore it)"
                 for n in walk.meta_non_persistent]
    if problems:
        key = getattr(getattr(lease, "manifest", None), "key", "?")
        shown = "; ".join(problems[:10]) + (f"; ... {len(problems) - 10} more" if len(problems) > 10 else "")
        raise FailedPrecondition(f"restore plan for artifact {key[:12]}: {len(problems)} mismatch(es): {shown}")
    return RestorePlan(tuple(bindings), nbytes, lease, walk.aliased)


def commit_restore(module: nn.Module, plan: RestorePlan) -> RestoreResult:
    """Binds every planned tensor to its lease view (no copy).

    Parameters are replaced by new ``nn.Parameter`` objects over the views
    (a meta tensor cannot take CPU data in place), keeping ``requires_grad``.

    Raises:
        FailedPrecondition: a bound tensor is still on meta afterwards.
    """
    views = plan.lease.tensors()
    replaced: dict[int, torch.Tensor] = {}  # id(old tensor) -> its replacement
    params = buffers = 0
    for b in plan.bindings:
        view = views[b.name]
        if b.is_parameter:
            table = b.module._parameters
            old = table[b.attr]
            new = nn.Parameter(view, requires_grad=bool(old.requires_grad))
            params += 1
        else:
            table = b.module._buffers
            old, new = table[b.attr], view
            buffers += 1
        if plan.aliased:
            replaced[id(old)] = new
        else:
            table[b.attr] = new
    if plan.aliased:
        # Every alias of a tensor (tied weights) gets the same replacement.
        for mod in module.modules():
            for table in (mod._parameters, mod._buffers):
                for attr, t in table.items():
                    if t is not None and id(t) in replaced:
                        table[attr] = replaced[id(t)]
        left = [s.name for s in tensor_slots(module).slots if s.tensor.is_meta]
    else:
        # The plan bound every slot of the tree (else it failed): checking
        # what was bound is the whole check, without a second walk.
        left = [b.name for b in plan.bindings
                if (b.module._parameters if b.is_parameter else b.module._buffers)[b.attr].is_meta]
    if left:
        raise FailedPrecondition(f"restore commit: {len(left)} tensor(s) still on meta after commit: {left[:5]}")
    log.info("restored %d parameters and %d buffers (%d bytes) from artifact %s with 0 copies",
             params, buffers, plan.nbytes, getattr(plan.lease.manifest, "key", "?")[:12])
    return RestoreResult(params + buffers, params, buffers, plan.nbytes, 0)


def restore_model(module: nn.Module, lease: Any) -> RestoreResult:
    """Plans, then commits, a warm restore of ``module`` from ``lease``.

    Args:
        module: skeleton module (meta or any device).
        lease: object with the MappedArtifact API; borrowed, not closed.

    Returns:
        Counts; ``copies`` is 0.

    Raises:
        FailedPrecondition: the plan failed (module untouched) or a tensor
            stayed on meta.

    Example:
        >>> result = restore_model(skeleton, lease)  # doctest: +SKIP
        >>> result.copies
        0
    """
    return commit_restore(module, plan_restore(module, lease))


# -- shared finalization guard -------------------------------------------------


class TensorSnapshot(NamedTuple):
    """One tensor before or after shared finalization: where it lives and
    a digest of its bytes."""

    data_ptr: int
    nbytes: int
    digest: int  # xxh3_64 of the bytes (0: inside a read-only mapping)


def _digest(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    raw = flat.contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(memoryview(raw))


def snapshot(module: nn.Module, regions: Sequence[Any] = ()) -> dict[str, TensorSnapshot]:
    """Data pointer, size and an xxh3 digest of every parameter and
    persistent buffer.

    Args:
        regions: read-only mapped ranges (``lease.regions()``). A tensor
            inside one is not hashed: the mapping is PROT_READ, so a write
            through it faults, and an unchanged pointer proves unchanged
            bytes. Its digest is recorded as 0.
    """
    spans = [(r.address, r.address + r.length) for r in regions]
    out = {}
    for s in tensor_slots(module).slots:
        t = s.tensor
        ptr, nbytes = t.data_ptr(), t.nbytes
        readonly = False
        if t.is_cpu:
            for a, b in spans:  # a plain loop: this runs per tensor on every warm start
                if a <= ptr and ptr + nbytes <= b:
                    readonly = True
                    break
        out[s.name] = TensorSnapshot(ptr, nbytes, 0 if readonly else _digest(t))
    return out


def snapshot_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSnapshot]:
    """:func:`snapshot` of named tensors that need not belong to one module
    (what a background publication reads); every tensor's bytes are hashed."""
    return {name: TensorSnapshot(t.data_ptr(), t.nbytes, _digest(t)) for name, t in tensors.items()}


def compare_snapshots(before: dict[str, TensorSnapshot], after: dict[str, TensorSnapshot]) -> list[str]:
    """Names (with what changed) of tensors that differ between snapshots."""
    out = [f"{n}: removed" for n in before if n not in after]
    out += [f"{n}: added" for n in after if n not in before]
    for n, b in before.items():
        a = after.get(n)
        if a is None:
            continue
        if a.data_ptr != b.data_ptr:
            out.append(f"{n}: data pointer moved")
        elif a.digest != b.digest or a.nbytes != b.nbytes:
            out.append(f"{n}: bytes changed")
    return out


def finalize_shared(module: nn.Module, finalize: Callable[[nn.Module], Any], *,
                    regions: Sequence[Any] = ()) -> None:
    """Runs shared (non-byte-changing) finalization and proves it neutral.

    Args:
        module: the restored module.
        finalize: validation, eval(), hook installation, bookkeeping...
        regions: the lease's read-only mapped ranges; tensors inside them are
            proven by pointer alone (see :func:`snapshot`), so a warm start
            hashes nothing it restored.

    Raises:
        FailedPrecondition: ``finalize`` changed restored bytes or moved a
            data pointer (byte-changing work belongs to the cold path only).
    """
    before = snapshot(module, regions)
    finalize(module)
    changed = compare_snapshots(before, snapshot(module, regions))
    if changed:
        raise FailedPrecondition(
            f"shared finalization is not byte- and pointer-neutral after warm restore: {changed[:10]}; "
            "move byte-changing work to the cold (canonical) path"
        )
