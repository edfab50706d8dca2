"""The proxy that stands in for a pipeline component until its first use
(:class:`LazyComponent`), and the narrow interface of the pipeline it
answers to (:class:`ProxyOwner`), so the proxy never imports the pipeline.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import nn

#: Methods that return the module itself: on the proxy they return the proxy,
#: so ``pipe.vae = pipe.vae.to(device)`` keeps it releasable.
_SELF_RETURNING = ("to", "eval", "train", "requires_grad_", "cpu", "cuda", "float", "half", "bfloat16")

#: Methods a released component can answer without loading: a fresh reload
#: has no state to reset.
_STATELESS_WHEN_RELEASED = ("_reset_stateful_cache",)


class ProxyOwner(Protocol):
    """What a :class:`LazyComponent` asks of the pipeline that owns it
    (:class:`dlo_runtime.lazy.pipeline.LazyPipeline`)."""

    def _before_use(self, proxy: "LazyComponent") -> None: ...
    def _load(self, proxy: "LazyComponent") -> nn.Module: ...
    def _release(self, proxy: "LazyComponent", how: str = "") -> bool: ...
    def _refuse(self, proxy: "LazyComponent", why: str) -> None: ...
    def _wrap_use(self, proxy: "LazyComponent", method: Any) -> Callable[..., Any]: ...
    def _apply_recorded(self, proxy: "LazyComponent", method: str, args: Any, kwargs: Any) -> None: ...
    def _device_of(self) -> torch.device: ...


class LazyComponent:
    """A pipeline component that loads on first use (see the module doc).

    ``isinstance(proxy, ComponentClass)`` is True (``__class__`` is
    forwarded); ``to``/``eval``/``requires_grad_``... return the proxy;
    config-only reads load nothing. Built by :func:`lazy_pipeline`.
    """

    def __init__(self, owner: ProxyOwner, name: str, cls: type, shell: nn.Module):
        d = object.__getattribute__(self, "__dict__")
        d.update(_lazy_owner=owner, _lazy_name=name, _lazy_cls=cls, _lazy_shell=shell,
                 _lazy_loaded=None, _lazy_real=None, _lazy_snapshot=None, _lazy_state=None, _lazy_regions=(),
                 _lazy_pending=[], _lazy_refused="")
        # diffusers records a component's (library, class) from __module__.
        d["__module__"] = cls.__module__

    # -- identity ---------------------------------------------------------------

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D401 - isinstance stays honest (FSDP / compile checks branch on it)
        return object.__getattribute__(self, "_lazy_cls")

    def __repr__(self) -> str:
        state = "loaded" if self._lazy_real is not None else "released"
        return f"<LazyComponent {self._lazy_name}: {self._lazy_cls.__name__} ({state})>"

    @property
    def is_loaded(self) -> bool:
        """Whether the component is in memory now."""
        return self._lazy_real is not None

    # -- loading and release ----------------------------------------------------

    def _lazy_materialize(self) -> nn.Module:
        real = self._lazy_real
        if real is None:
            # A load starts a use: what its stage ends goes first, so the
            # two are never loaded together.
            self._lazy_owner._before_use(self)
            real = self._lazy_owner._load(self)
        return real

    def _lazy_release(self) -> bool:
        """Releases the loaded component unless it changed after load.

        Returns:
            True when released; False when nothing was loaded or it was
            refused for deferral (kept resident).
        """
        return self._lazy_owner._release(self)

    # -- attribute access -------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_lazy_"):
            raise AttributeError(name)
        real = self._lazy_real
        if real is None:
            if name in _STATELESS_WHEN_RELEASED and hasattr(self._lazy_shell, name):
                return lambda *a, **k: None
            if name == "device":
                return self._lazy_owner._device_of()
            # Config-only reads: the meta skeleton has the config, the dtypes
            # and every plain attribute its constructor set; no weight.
            value = getattr(self._lazy_shell, name)  # AttributeError: the real one lacks it too
            if name in ("config", "dtype") or not (callable(value) or isinstance(value, (torch.Tensor, nn.Module))):
                return value
            real = self._lazy_materialize()
        value = getattr(real, name)
        if callable(value) and not isinstance(value, (torch.Tensor, nn.Module)) and hasattr(value, "__self__"):
            return self._lazy_owner._wrap_use(self, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # A stage that writes into a component makes a reload come back
        # different: from now on it stays resident.
        real = self._lazy_materialize()
        self._lazy_owner._refuse(self, f"attribute {name!r} set through the proxy after load")
        setattr(real, name, value)

    def __delattr__(self, name: str) -> None:
        real = self._lazy_materialize()
        self._lazy_owner._refuse(self, f"attribute {name!r} deleted through the proxy after load")
        delattr(real, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._lazy_owner._wrap_use(self, None)(*args, **kwargs)

    def __dir__(self) -> list[str]:
        return dir(self._lazy_real if self._lazy_real is not None else self._lazy_shell)

    def _lazy_self_returning(self, method: str, *args: Any, **kwargs: Any) -> "LazyComponent":
        # Recorded whether loaded or not (the last call per method): a reload
        # must come back where the caller put it. Applied now when loaded.
        pending = [p for p in self._lazy_pending if p[0] != method] + [(method, args, kwargs)]
        object.__getattribute__(self, "__dict__")["_lazy_pending"] = pending
        if self._lazy_real is not None:
            self._lazy_owner._apply_recorded(self, method, args, kwargs)
        return self

    def to(self, *args: Any, **kwargs: Any) -> "LazyComponent":
        """``module.to(...)``; returns the proxy (applied on every load)."""
        return self._lazy_self_returning("to", *args, **kwargs)

    def eval(self) -> "LazyComponent":
        """``module.eval()``; returns the proxy."""
        return self._lazy_self_returning("eval")

    def train(self, mode: bool = True) -> "LazyComponent":
        """``module.train(mode)``; returns the proxy."""
        return self._lazy_self_returning("train", mode)

    def requires_grad_(self, requires_grad: bool = True) -> "LazyComponent":
        """``module.requires_grad_(...)``; returns the proxy."""
        return self._lazy_self_returning("requires_grad_", requires_grad)

    def cpu(self) -> "LazyComponent":
        """``module.cpu()``; returns the proxy."""
        return self._lazy_self_returning("cpu")

    def cuda(self, device: Any = None) -> "LazyComponent":
        """``module.cuda(device)``; returns the proxy."""
        return self._lazy_self_returning("cuda", device)
