"""Skeletons real models accept, and the module-structure helpers the
contract and the start share: parameters on meta with buffers real
(:func:`parameters_on_meta`), tied-weight-preserving rebinding
(:func:`rebind`), the check that nothing stayed on meta
(:func:`check_loaded`), block discovery (:func:`find_blocks`) and the
artifact's block groups (:func:`publish_groups`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch
from torch import nn

from hwr_client.core.errors import FailedPrecondition, InvalidArgument

from dlo_runtime.restore import tensor_slots

#: Share of the parameters an automatically found block stack must hold.
AUTO_BLOCK_MIN_SHARE = 0.10


_PATCH_LOCK = threading.RLock()  # re-entrant: a constructor may build a nested skeleton


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers
    stay where their module built them (accelerate's
    ``init_empty_weights(include_buffers=False)`` convention).

    Patches ``nn.Module.register_parameter`` (``self.weight = Parameter(...)``
    goes through it), process-wide for the duration: a lock keeps two
    builds from unpatching each other.
    """
    with _PATCH_LOCK:
        original = nn.Module.register_parameter

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original(module, name, param)
            if param is not None and not param.is_meta:
                p = module._parameters[name]
                assert p is not None
                # The parameter's class and attributes survive (as accelerate keeps them).
                kwargs = dict(p.__dict__)
                kwargs["requires_grad"] = p.requires_grad
                module._parameters[name] = type(p)(p.data.to("meta"), **kwargs)

        nn.Module.register_parameter = register  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """The model is constructed under the target dtype, as both libraries'
    ``from_pretrained`` construct it (buffers made without an explicit dtype
    then match)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def dtype_of(name: str) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise InvalidArgument(f"dtype {name!r}: expected a floating torch dtype name (bfloat16, float16, float32)")
    return value


def rebind(model: nn.Module, replaced: dict[int, torch.Tensor]) -> None:
    """Puts ``replaced[id(old)]`` in place of ``old`` in every module that
    holds it, so tied weights stay one tensor."""
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for attr, t in table.items():
                if t is not None and id(t) in replaced:
                    table[attr] = replaced[id(t)]


def check_loaded(model: nn.Module, what: str) -> None:
    """Raises if any parameter or buffer (persistent or not) is on meta.

    Raises:
        FailedPrecondition: naming the tensors and why.
    """
    walk = tensor_slots(model)
    left = [s.name for s in walk.slots if s.tensor.is_meta]
    if left:
        raise FailedPrecondition(f"{what}: {left[:5]} still on meta after the load; the checkpoint does not hold "
                                 "them and the model does not compute them")
    if walk.meta_non_persistent:
        raise FailedPrecondition(f"{what}: non-persistent buffers {walk.meta_non_persistent[:5]} are on meta; "
                                 "the model built them on meta, so neither the checkpoint nor the artifact has them")


# -- blocks ---------------------------------------------------------------------------


def nparams(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, names: str | Sequence[str] = "auto") -> list[nn.Module]:
    """The blocks to stream, in execution order.

    ``"auto"``: the outermost ``nn.ModuleList``s whose children are two or
    more modules of one class and which hold at least
    :data:`AUTO_BLOCK_MIN_SHARE` of the parameters, in registration order
    (FLUX: ``transformer_blocks`` then ``single_transformer_blocks``; Llama:
    ``model.layers``; T5: ``encoder.block``). Otherwise module names: a
    ``ModuleList`` streams each child, any other module streams itself.

    Raises:
        InvalidArgument: a name that is not a submodule.
    """
    modules = dict(model.named_modules())
    if names != "auto":
        if isinstance(names, str):
            names = [names]
        out: list[nn.Module] = []
        for n in names:
            if n not in modules or n == "":
                raise InvalidArgument(f"blocks: {n!r} is not a submodule of {type(model).__name__}; expected one "
                                      f"of its module names, e.g. {[k for k in modules if k][:3]}")
            m = modules[n]
            out += list(m) if isinstance(m, nn.ModuleList) else [m]
        return out
    total = max(nparams(model), 1)
    chosen: list[str] = []
    for name, m in modules.items():
        if not isinstance(m, nn.ModuleList) or len(m) < 2 or len({type(c) for c in m}) != 1:
            continue
        if any(name.startswith(c + ".") for c in chosen):
            continue  # inside a stack already chosen
        if nparams(m) >= AUTO_BLOCK_MIN_SHARE * total:
            chosen.append(name)
    return [c for name in chosen for c in modules[name]]


def publish_groups(model: nn.Module, blocks: Sequence[nn.Module]) -> list[tuple[str, list[str]]]:
    """The artifact's block groups: one ``(prefix, names)`` per block, so
    each streamed block is one contiguous range of the artifact (what the
    DLO backend copies in one go)."""
    names = {id(m): n for n, m in model.named_modules()}
    groups = []
    for b in blocks:
        prefix = names[id(b)] + "."
        # The prefix travels with the group: T5's tensors all sit under
        # block.N.layer., deeper than the module the backend streams.
        groups.append((prefix, [prefix + s.name for s in tensor_slots(b).slots]))
    return groups
