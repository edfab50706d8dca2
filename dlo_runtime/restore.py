"""Warm restore: bind a module's tensors to a lease's views, proven first.

:func:`plan_restore` checks, without touching the module, that every parameter
and persistent buffer has exactly one artifact tensor with the same name,
shape and dtype, that the artifact has no tensor the module lacks, and that
nothing would be left on the meta device. :func:`commit_restore` then binds
each parameter and buffer to its read-only view: no byte is copied. A plan
that fails raises and leaves the module exactly as it was.

:func:`restore` is plan + commit. :func:`finalize_shared` runs shared
(non-byte-changing) finalization and proves it changed neither the restored
bytes nor their data pointers.

Example:
    >>> with client.acquire(key) as lease:           # doctest: +SKIP
    ...     result = restore(skeleton, lease)
    ...     finalize_shared(skeleton, lambda m: m.eval())
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterator, Sequence

import torch
import xxhash
from torch import nn

from hwr_client.errors import FailedPrecondition

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Binding:
    """One module tensor and the artifact view it will be bound to."""

    name: str  # qualified name in the module (== artifact tensor name)
    owner: str  # qualified name of the owning submodule
    attr: str  # attribute name inside the owner
    is_parameter: bool


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """A proven restore: what to bind, and from which lease (borrowed)."""

    bindings: tuple[Binding, ...]
    nbytes: int
    lease: Any = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What :func:`restore` did. ``copies`` is always 0: tensors are views."""

    tensors: int
    parameters: int
    buffers: int
    nbytes: int
    copies: int = 0


def module_tensors(module: nn.Module) -> Iterator[tuple[str, str, str, torch.Tensor, bool]]:
    """(qualified name, owner, attr, tensor, is_parameter) for every parameter
    and persistent buffer, shared tensors reported once."""
    seen: set[int] = set()
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        prefix = f"{owner_name}." if owner_name else ""
        for attr, p in owner._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield prefix + attr, owner_name, attr, p, True
        for attr, b in owner._buffers.items():
            if b is not None and attr not in owner._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                yield prefix + attr, owner_name, attr, b, False


def _meta_non_persistent(module: nn.Module) -> list[str]:
    out = []
    for owner_name, owner in module.named_modules():
        for attr in owner._non_persistent_buffers_set:
            b = owner._buffers.get(attr)
            if b is not None and b.is_meta:
                out.append(f"{owner_name}.{attr}" if owner_name else attr)
    return out


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
    problems: list[str] = []
    bindings: list[Binding] = []
    nbytes = 0
    names: set[str] = set()
    for name, owner, attr, t, is_param in module_tensors(module):
        names.add(name)
        v = views.get(name)
        if v is None:
            problems.append(f"{name}: missing from the artifact")
            continue
        if tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype:
            problems.append(f"{name}: artifact has {v.dtype} {list(v.shape)}, module expects {t.dtype} {list(t.shape)}")
            continue
        bindings.append(Binding(name, owner, attr, is_param))
        nbytes += v.numel() * v.element_size()
    extra = [n for n in views if n not in names]
    problems += [f"{n}: in the artifact but not a parameter or persistent buffer of the module" for n in extra]
    problems += [f"{n}: non-persistent buffer left on meta (the artifact cannot restore it)"
                 for n in _meta_non_persistent(module)]
    if problems:
        key = getattr(getattr(lease, "manifest", None), "key", "?")
        shown = "; ".join(problems[:10]) + (f"; ... {len(problems) - 10} more" if len(problems) > 10 else "")
        raise FailedPrecondition(f"restore plan for artifact {key[:12]}: {len(problems)} mismatch(es): {shown}")
    return RestorePlan(tuple(bindings), nbytes, lease)


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
        owner = module.get_submodule(b.owner)
        view = views[b.name]
        if b.is_parameter:
            old = owner._parameters[b.attr]
            replaced[id(old)] = nn.Parameter(view, requires_grad=bool(old.requires_grad))
            params += 1
        else:
            replaced[id(owner._buffers[b.attr])] = view
            buffers += 1
    # Every alias of a tensor (tied weights) gets the same replacement.
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for attr, t in table.items():
                if t is not None and id(t) in replaced:
                    table[attr] = replaced[id(t)]
    left = [n for n, _, _, t, _ in module_tensors(module) if t.is_meta]
    if left:
        raise FailedPrecondition(f"restore commit: {len(left)} tensor(s) still on meta after commit: {left[:5]}")
    log.info("restored %d parameters and %d buffers (%d bytes) from artifact %s with 0 copies",
             params, buffers, plan.nbytes, getattr(plan.lease.manifest, "key", "?")[:12])
    return RestoreResult(params + buffers, params, buffers, plan.nbytes, 0)


def restore(module: nn.Module, lease: Any) -> RestoreResult:
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
        >>> result = restore(skeleton, lease)  # doctest: +SKIP
        >>> result.copies
        0
    """
    return commit_restore(module, plan_restore(module, lease))


# -- shared finalization guard -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSnapshot:
    data_ptr: int
    nbytes: int
    digest: int  # xxh3_64 of the bytes


def _digest(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    raw = flat.contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(memoryview(raw))


def _within(ptr: int, nbytes: int, regions: Sequence[Any]) -> bool:
    return any(r.address <= ptr and ptr + nbytes <= r.address + r.length for r in regions)


def snapshot(module: nn.Module, regions: Sequence[Any] = ()) -> dict[str, TensorSnapshot]:
    """Data pointer, size and an xxh3 digest of every parameter and
    persistent buffer.

    Args:
        regions: read-only mapped ranges (``lease.regions()``). A tensor
            inside one is not hashed: the mapping is PROT_READ, so a write
            through it faults, and an unchanged pointer proves unchanged
            bytes. Its digest is recorded as 0.
    """
    out = {}
    for name, _, _, t, _ in module_tensors(module):
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        readonly = t.device.type == "cpu" and _within(ptr, nbytes, regions)
        out[name] = TensorSnapshot(ptr, nbytes, 0 if readonly else _digest(t))
    return out


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
