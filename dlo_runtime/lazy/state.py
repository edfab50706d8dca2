"""The non-tensor state of a loaded component, for the mutation check.

A release is correct only if a reload comes back the same. The tensor
snapshot (:func:`dlo_runtime.restore.snapshot`) proves the weights did not
change; this module covers what a method call changes besides them:
``vae.enable_tiling()`` sets ``use_tiling``, ``set_attn_processor`` swaps
processor objects, ``fuse_qkv_projections`` replaces submodules. A reload
would silently drop each of those, so a component whose state differs at
release from its state after load is refused for deferral (kept resident).
"""

from __future__ import annotations

from typing import Any

from torch import nn

_PLAIN = (bool, int, float, str, type(None))
_MISSING = object()
#: torch's own bookkeeping (hook dicts, state-dict hooks): left out. Hooks are
#: installed at call time by the libraries themselves (transformers' output
#: capturing on the first call with ``output_hidden_states``) and by DLO at
#: load, and a reload installs them again.
_TORCH_BOOKKEEPING = frozenset(vars(nn.Module())) - {"training"}
#: A hook registry with no hook: what diffusers' ``cache_context`` adds on a
#: first call (FLUX), and a fresh reload builds again.
EMPTY = "<empty>"


def _value(v: Any) -> Any:
    """What is compared of one attribute: plain values (and tuples of them)
    by value, a hook registry by its hook names, any other object by its
    type (a processor swapped for another class shows; a dict of hooks
    filled by DLO at load does not)."""
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(e, _PLAIN) for e in v):
        return tuple(v)
    hooks = getattr(v, "hooks", None) if not isinstance(v, (dict, list, tuple, set)) else None
    if isinstance(hooks, dict):  # diffusers' HookRegistry: caches, group offload, layerwise casting
        return (type(v).__qualname__, *sorted(map(str, hooks))) if hooks else EMPTY
    return type(v).__qualname__


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """Per ``<module path>.<attribute>``: the module's class and each plain
    attribute of its ``__dict__`` (tensors and submodules excluded: the
    tensor snapshot and the module paths cover them)."""
    out: dict[str, Any] = {}
    for path, mod in model.named_modules():
        out[f"{path}:class"] = type(mod).__qualname__
        for key, v in vars(mod).items():
            if key in _TORCH_BOOKKEEPING or isinstance(v, nn.Module):
                continue
            if hasattr(v, "data_ptr"):  # a tensor held as a plain attribute (a cache)
                continue
            out[f"{path}.{key}"] = _value(v)
    return out


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs, as ``<key>: <before> -> <after>`` (``-`` for absent).

    Counted: an attribute present at load that changed or went, a submodule
    added, a hook registry that gained hooks. Not counted: any other
    attribute a call added (libraries mark lazily done housekeeping so:
    transformers' ``_output_capturing_hooks_installed``); a reload starts
    without it and the library adds it again.
    """
    def counted(k: str) -> bool:
        if k in before:
            return before[k] != after.get(k, _MISSING)
        v = after[k]
        return k.endswith(":class") or (isinstance(v, tuple) and v[:1] == ("HookRegistry",))

    return [f"{k}: {before.get(k, '-')!r} -> {after.get(k, '-')!r}" for k in dict.fromkeys([*before, *after])
            if counted(k)]

