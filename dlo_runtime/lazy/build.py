"""Building a lazy pipeline: :func:`lazy_pipeline` reads the folder's
``model_index.json``, decides per component whether it defers
(:func:`dlo_runtime.lazy.policy.plan_components`), logs and reports each
decision, and builds the library's own pipeline with
:class:`~dlo_runtime.lazy.proxy.LazyComponent` proxies in place of the
deferred components and a call boundary on its class."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

import torch
from torch import nn

from dlo_runtime.compile.settings import per_component
from dlo_runtime.lazy.pipeline import LazyPipeline
from dlo_runtime.lazy.policy import ComponentReport, Decision, module_class, plan_components, use_order_of
from dlo_runtime.lazy.proxy import LazyComponent
from dlo_runtime.placement import host_offload
from hwr_client.core.errors import FailedPrecondition, HwrError, InvalidArgument, NotFound

log = logging.getLogger(__name__)


def _lazy_class(cls: type, owner: LazyPipeline) -> type:
    """The pipeline class with a call boundary: same name, a subclass, so
    ``isinstance(pipe, cls)`` and diffusers' own bookkeeping hold."""
    call = cls.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return owner._call(call, self, *args, **kwargs)

    attrs: dict[str, Any] = {"__call__": __call__, "__module__": cls.__module__, "__doc__": cls.__doc__}
    if owner.components:
        def _execution_device(self: Any) -> torch.device:
            # diffusers' own walks every component's modules() to look for
            # group offload hooks, which would load them all; a lazy
            # pipeline has none.
            return owner._device_of()

        attrs["_execution_device"] = property(_execution_device)
    return type(cls.__name__, (cls,), attrs)


def _shell(pipe_dir: str, name: str, dtype: str) -> tuple[type, nn.Module]:
    """The component's class and meta skeleton (config, dtypes, structure;
    no weight read)."""
    from dlo_runtime.pretrained import PretrainedContract, model_files, resolve_class

    files = model_files(pipe_dir, name)
    cls = resolve_class(files)
    return cls, PretrainedContract(files, cls, dtype=dtype).build_skeleton()


def _dtype_mismatches(shell: nn.Module, dtype: str) -> list[str]:
    """Parameters of a transformers skeleton not in the dtype the library's
    ``from_pretrained(dtype=...)`` gives them: ``dtype``, or float32 where
    the model's own dtype plan keeps it (``_get_dtype_plan``, the rule the
    library applies). A skeleton that disagrees would make HWR's load
    differ from the library's; the component then loads normally."""
    get_plan: Any = getattr(shell, "_get_dtype_plan", None)
    plan = get_plan(getattr(torch, dtype)) if callable(get_plan) else None
    if plan is None:
        return []  # diffusers: the skeleton casts every floating tensor by one rule
    pattern = None
    if plan:
        from transformers.core_model_loading import build_glob_alternation

        pattern = build_glob_alternation(list(plan))[0]
    return [f"{n}: {p.dtype}" for n, p in shell.named_parameters()
            if p.is_floating_point() and p.dtype != getattr(torch, dtype)
            and not (pattern is not None and pattern.search(n))]


def _is_module(entry: Any) -> bool:
    cls = module_class(entry)
    return cls is not None and issubclass(cls, nn.Module)


def _read_index(pipe_dir: str) -> tuple[str, dict[str, Any]]:
    index_path = os.path.join(pipe_dir, "model_index.json")
    if not os.path.isdir(pipe_dir):
        from dlo_runtime.pretrained.hub import missing_directory

        raise missing_directory(pipe_dir, "pipeline directory")
    if not os.path.isfile(index_path):
        raise NotFound(f"pipeline directory {pipe_dir}: no model_index.json; expected a diffusers pipeline")
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{index_path}: not a JSON pipeline index ({exc})") from None
    if not isinstance(index, dict):
        raise InvalidArgument(f"{index_path}: expected a JSON object")
    return index_path, index


def _pipeline_class(index_path: str, index: dict[str, Any]) -> type:
    import diffusers

    cls = getattr(diffusers, str(index.get("_class_name")), None)
    if not isinstance(cls, type):
        raise InvalidArgument(f"{index_path}: class {index.get('_class_name')!r} is not in diffusers "
                              f"{diffusers.__version__}; pass pipeline_class=")
    return cls


def _defer(lazy: LazyPipeline, decision: Decision, *, explicit: bool) -> Decision:
    """Puts a proxy in place of a deferred component; a component whose
    skeleton cannot be built loads normally (with the reason) unless the
    caller asked for it by name (then the error, naming it)."""
    try:
        cls, shell = _shell(lazy.pipe_dir, decision.name, lazy.dtype)
        wrong = _dtype_mismatches(shell, lazy.dtype)
        if wrong:
            # Seen: CLIPTextModelWithProjection builds its text model with
            # _from_config, which takes the saved config's dtype, not the
            # requested one; the library's load casts it.
            raise FailedPrecondition(f"HWR's skeleton of {cls.__name__} disagrees with the library's dtypes at "
                                     f"{lazy.dtype} ({len(wrong)} parameters, e.g. {wrong[:2]})")
    except HwrError as exc:
        if explicit:
            raise type(exc)(f"lazy_pipeline: component {decision.name!r} cannot defer: {exc}") from None
        log.warning("lazy pipeline: %s loads normally: %s", decision.name, exc)
        return Decision(decision.name, False, f"loads normally: {exc}")
    lazy.components[decision.name] = LazyComponent(lazy, decision.name, cls, shell)
    return decision


def _release_point(lazy: LazyPipeline, name: str) -> str:
    last = lazy._declared(name)
    if lazy.checked is not None and last is not None:
        return f"on leaving its declared last stage ({last} of {list(lazy.checked.use_order)})"
    return "at the end of the first call, then after its counted last use"


def _log_plan(lazy: LazyPipeline, name: str) -> None:
    deferred = [n for n, r in lazy.reports.items() if r.deferred]
    log.info("lazy pipeline %s (%s): deferred %s; use order %s", name, lazy.pipe_dir, deferred or "nothing",
             list(lazy.checked.use_order) if lazy.checked else "none")
    for n, r in lazy.reports.items():
        log.info("lazy pipeline %s: %s %s: %s", name, n, "deferred" if r.deferred else "not deferred", r.why)


def _to_device(lazy: LazyPipeline, pipe: Any, decisions: Sequence[Decision], passed: dict[str, Any]) -> None:
    """Components the pipeline loaded itself (not deferred, not the
    caller's) compute on the lazy pipeline's device too: its
    ``_execution_device`` puts every input there."""
    device = lazy.decision.device
    if device is None or torch.device(device).type == "cpu":
        return
    for d in decisions:
        module = getattr(pipe, d.name, None)
        if not d.deferred and d.name not in passed and isinstance(module, nn.Module):
            module.to(device)


def lazy_pipeline(
    pipe_dir: str | os.PathLike[str],
    *,
    pipeline_class: Any = None,
    components: Sequence[str] | None = None,
    mode: str = "preferred",
    dtype: str = "bfloat16",
    device: str | torch.device | None = None,
    offload: bool | None = None,
    socket: str | None = None,
    host_plan: str | None = None,
    compile: Any = None,
    **pipeline_kwargs: Any,
) -> LazyPipeline:
    """A diffusers pipeline whose components load on first use through
    :func:`dlo_runtime.from_pretrained` and release after their last use in
    a call (policy: the :mod:`dlo_runtime.lazy` doc).

    Args:
        pipe_dir: a pipeline directory (``model_index.json``).
        pipeline_class: default: the class ``model_index.json`` names.
        components: the components to defer. None: every component in the
            class's use order (its ``model_cpu_offload_seq``, less
            ``_exclude_from_cpu_offload``) present in the folder and not
            passed in ``pipeline_kwargs``.
        mode, dtype, socket: as for :func:`from_pretrained`.
        device: compute device; None: resident on the CPU.
        offload: DLO host offload (None: auto, see
            :func:`dlo_runtime.placement.host_offload`; unified memory turns
            it off).
        host_plan: passed to :func:`from_pretrained` when given.
        compile: ``from_pretrained``'s ``compile=`` for the deferred
            components: True or a dict of ``torch.compile`` arguments (each
            of them), or ``{component: True | {...}}``
            (:func:`dlo_runtime.compile.per_component`); needs host
            offload off (``offload=False`` on a GPU).
        **pipeline_kwargs: to the pipeline class's own ``from_pretrained``
            (``text_encoder=None``...).

    Returns:
        The :class:`LazyPipeline`; close it (or use ``with``).

    Raises:
        NotFound: no pipeline there.
        InvalidArgument: a class not in diffusers, or a component in
            ``components`` that cannot defer (the message names it and why).

    Example:
        >>> with lazy_pipeline("/models/sd3", socket=sock) as lazy:        # doctest: +SKIP
        ...     image = lazy.pipe(prompt="a photo of a cat").images[0]
    """
    pipe_dir = os.fspath(pipe_dir)
    index_path, index = _read_index(pipe_dir)
    if pipeline_class is None:
        pipeline_class = _pipeline_class(index_path, index)
    if isinstance(components, str):
        raise InvalidArgument(f"lazy_pipeline {pipe_dir}: components={components!r}: expected a sequence of "
                              "component names, not one string")
    present = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v and v[0]]
    order = use_order_of(pipeline_class, present)
    decisions = plan_components(pipeline_class, index, requested=None if components is None else list(components),
                                passed=set(pipeline_kwargs), order=order, is_module=_is_module)
    decision = host_offload(device, offload)
    lazy = LazyPipeline(pipe_dir, mode=mode, dtype=dtype, decision=decision, socket=socket, host_plan=host_plan)
    lazy.checked = order
    passed = dict(pipeline_kwargs)
    final = [_defer(lazy, d, explicit=components is not None) if d.deferred else d for d in decisions]
    lazy.compile = per_component(compile, [d.name for d in final if d.deferred])
    if lazy.compile and decision.offload:
        raise InvalidArgument(f"lazy_pipeline {pipe_dir}: compile= with host offload on {decision.device}: pass "
                              "offload=False (torch.compile would trace the offload hooks)")
    for d in final:
        lazy.reports[d.name] = ComponentReport(d.name, d.deferred, d.why,
                                               release=_release_point(lazy, d.name) if d.deferred else "")
        if d.deferred:
            passed[d.name] = lazy.components[d.name]
    if order is None:
        lazy.notes.append(f"{pipeline_class.__name__}: declares no model_cpu_offload_seq; every component loads "
                          "normally (resident, the pipeline's own from_pretrained)")
    if decision.unified_memory:
        lazy.notes.append(decision.reason)
    _log_plan(lazy, pipeline_class.__name__)
    pipe = pipeline_class.from_pretrained(pipe_dir, dtype=getattr(torch, dtype), local_files_only=True, **passed)
    _to_device(lazy, pipe, final, pipeline_kwargs)
    # Always a call boundary: calls are counted even when nothing defers.
    pipe.__class__ = _lazy_class(type(pipe), lazy)
    lazy.pipe, lazy.pipeline_name = pipe, pipeline_class.__name__
    return lazy


__all__ = ["lazy_pipeline"]
