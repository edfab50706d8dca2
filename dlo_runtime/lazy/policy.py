"""What a lazy pipeline may defer and what it reports: a pipeline class's
use order (derived from diffusers' ``model_cpu_offload_seq``, or declared
here where that string says less than the class's ``__call__``), the plan
that decides per component whether it defers and why, and the per-component
report (the release policy itself is the :mod:`dlo_runtime.lazy` doc)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Collection, Mapping, Sequence

from hwr_client.core.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class CheckedPipeline:
    """A pipeline class's use order: what a lazy pipeline releases by.

    Attributes:
        components: the components the order names (each once), present in
            the pipeline folder and not excluded from offload: the ones that
            defer by default.
        use_order: the components in the order one call uses them; a
            component may appear more than once (img2img's VAE encodes, then
            decodes). A use (a call, a method, any load) moves the call to
            the next stage naming the component, and entering a stage
            releases every component whose last stage lies before it: the
            first call's release points, before any use was counted.
        source: where the order comes from (the class's
            ``model_cpu_offload_seq`` or :data:`DECLARED_USE_ORDERS`).
    """

    components: tuple[str, ...]
    use_order: tuple[str, ...]
    source: str = ""

    def last_stage(self, name: str) -> int | None:
        """Index of the last stage naming ``name`` (None: not declared)."""
        found = [i for i, st in enumerate(self.use_order) if st == name]
        return found[-1] if found else None

    def next_stage(self, name: str, current: int) -> int | None:
        """The first stage at or after ``current`` naming ``name`` (None:
        this use is not on the declared path)."""
        return next((i for i in range(current, len(self.use_order)) if self.use_order[i] == name), None)


#: Use orders declared here because they say more than the class's
#: ``model_cpu_offload_seq`` (read from ``__call__`` in diffusers 0.42). The
#: offload string names each component once; img2img's VAE encodes the input
#: image before denoising and decodes after, so its VAE appears twice. (The
#: derived order releases at the same points there, the VAE's only stage
#: being its last; the declaration documents the real path.) Only the
#: diffusers class itself takes an entry, not a subclass.
DECLARED_USE_ORDERS: dict[str, tuple[str, ...]] = {
    "FluxImg2ImgPipeline": ("text_encoder", "text_encoder_2", "vae", "transformer", "vae"),
}


def offload_seq(cls: type) -> tuple[str, ...]:
    """The class's ``model_cpu_offload_seq`` split at ``->`` (empty: none)."""
    seq = getattr(cls, "model_cpu_offload_seq", None)
    if not isinstance(seq, str):
        return ()
    return tuple(s.strip() for s in seq.split("->") if s.strip())


def use_order_of(cls: type, present: Collection[str]) -> CheckedPipeline | None:
    """The use order ``cls`` declares, limited to the ``present`` components.

    The order diffusers' own ``enable_model_cpu_offload`` chains its hooks
    by: ``model_cpu_offload_seq``, less ``_exclude_from_cpu_offload`` (kept on
    the device there); :data:`DECLARED_USE_ORDERS` where it has the class.

    Returns:
        None when the class declares no order (diffusers' model offload
        refuses such a class too).
    """
    seq = offload_seq(cls)
    declared = DECLARED_USE_ORDERS.get(cls.__name__) if cls.__module__.startswith("diffusers.") else None
    if declared is not None:
        order, source = declared, f"declared for {cls.__name__} (its model_cpu_offload_seq names the VAE once)"
    elif seq:
        order, source = seq, f"{cls.__name__}.model_cpu_offload_seq {'->'.join(seq)!r}"
    else:
        return None
    excluded = set(getattr(cls, "_exclude_from_cpu_offload", None) or ())
    order = tuple(n for n in order if n in present and n not in excluded)
    return CheckedPipeline(tuple(dict.fromkeys(order)), order, source)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether one component defers, and why (the report's ``why``)."""

    name: str
    deferred: bool
    why: str


def module_class(entry: Any) -> type | None:
    """The class a ``model_index.json`` entry (``[library, class]``) names,
    or None when it names none or the library lacks it."""
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
        return None
    library, name = entry
    for path in (library, f"diffusers.pipelines.{library}"):
        try:
            found = getattr(importlib.import_module(path), name, None)
        except ImportError:
            continue
        if isinstance(found, type):
            return found
    return None


def plan_components(cls: type, index: Mapping[str, Any], *, requested: Sequence[str] | None,
                    passed: Collection[str], order: CheckedPipeline | None,
                    is_module: Callable[[Any], bool]) -> list[Decision]:
    """Which components of the pipeline defer, with the reason for each.

    Args:
        cls: the pipeline class.
        index: ``model_index.json``.
        requested: the caller's ``components=`` (None: every component the
            use order names).
        passed: components the caller passes to the pipeline's own
            ``from_pretrained``.
        order: the class's use order (:func:`use_order_of`).
        is_module: whether a ``model_index.json`` entry names a torch module.

    Returns:
        One decision per torch-module component present in the folder, and
        per requested one.

    Raises:
        InvalidArgument: a requested component that cannot defer, naming it
            and why (not a component of the pipeline, absent from the
            folder, passed by the caller too, excluded from offload, not a
            torch module, or a class that declares no use order).
    """
    expected = _expected_modules(cls)
    name = cls.__name__
    excluded = set(getattr(cls, "_exclude_from_cpu_offload", None) or ())
    if requested is not None:
        for comp in requested:
            why = _refusal(cls, index, comp, passed, excluded, order, is_module)
            if why:
                raise InvalidArgument(f"lazy_pipeline {name}: component {comp!r} cannot defer: {why}")
    modules = [k for k, v in index.items() if not k.startswith("_") and (not expected or k in expected)
               and isinstance(v, (list, tuple)) and v and v[0] is not None and is_module(v)]
    decisions = []
    for comp in dict.fromkeys([*modules, *(requested or ())]):
        if requested is not None:
            if comp not in requested:
                why = "passed by the caller (pipeline_kwargs)" if comp in passed else "not in components="
                decisions.append(Decision(comp, False, f"loads normally: {why}"))
                continue
            where = ("released on leaving its last stage in the use order" if order and comp in order.use_order
                     else "not in the use order: released when a call ends, then after its counted last use")
            decisions.append(Decision(comp, True, f"requested (components=); {where}"))
            continue
        why = _refusal(cls, index, comp, passed, excluded, order, is_module)
        if not why and order is not None and comp not in order.use_order:
            why = (f"not in {name}'s use order ({order.source}); diffusers offloads it outside the chain; "
                   "pass components= to defer it")
        decisions.append(Decision(comp, not why, f"loads normally: {why}" if why else
                                  f"in the use order ({order.source if order else ''})"))
    return decisions


def _refusal(cls: type, index: Mapping[str, Any], comp: str, passed: Collection[str], excluded: set[str],
             order: CheckedPipeline | None, is_module: Callable[[Any], bool]) -> str:
    """Why ``comp`` cannot defer ("" when it can)."""
    expected = _expected_modules(cls)
    if comp.startswith("_") or comp not in index or (expected and comp not in expected):
        have = sorted(k for k in index if not k.startswith("_") and (not expected or k in expected))
        return f"not a component of {cls.__name__} in this folder (its components: {have})"
    if comp in passed:
        return "passed by the caller (pipeline_kwargs): a component is either passed or deferred"
    entry = index[comp]
    if not isinstance(entry, (list, tuple)) or not entry or entry[0] is None:
        return f"absent from the folder (model_index.json has {entry!r})"
    if comp in excluded:
        return f"excluded from offload by {cls.__name__}._exclude_from_cpu_offload (diffusers keeps it on the device)"
    if not is_module(entry):
        return f"{entry[0]}.{entry[1]} is not a torch module (nothing to load or release)"
    if order is None:
        return (f"{cls.__name__} declares no model_cpu_offload_seq (no use order to release by; diffusers' "
                "enable_model_cpu_offload refuses it too)")
    return ""


def _expected_modules(cls: type) -> set[str]:
    """The components the class's constructor takes (diffusers' own rule)."""
    keys = getattr(cls, "_get_signature_keys", None)
    if keys is None:
        return set()
    expected, _ = keys(cls)
    return set(expected)


@dataclasses.dataclass
class ComponentReport:
    """One component of a :class:`LazyPipeline`.

    Attributes:
        name: the pipeline attribute (``"transformer"``).
        deferred: loaded on first use and released after its last use.
        why: why it is (or is not) deferred.
        plan: the load path: ``<outcome> (<placement>)`` of the last load.
        loads: completed loads (the first and every reload).
        load_seconds: wall seconds of each load, in order.
        bytes_materialized: private bytes each load allocated (0 on a warm
            reload).
        outcomes: the :func:`from_pretrained` outcome of each load.
        resident_bytes: tensor bytes the loaded component holds (its peak
            memory contribution while loaded: private plus mapped pages).
        streamed_blocks: blocks DLO streams in the last load (0: resident,
            no host offload).
        uses_per_call: uses counted in the last completed call (the release
            point of the next one).
        unplanned_reloads: reloads inside a call after a release in the
            same call (declared or counted).
        release: the release point the next call uses.
        notes: anything worth a look.
    """

    name: str
    deferred: bool
    why: str
    plan: str = ""
    loads: int = 0
    load_seconds: list[float] = dataclasses.field(default_factory=list)
    bytes_materialized: list[int] = dataclasses.field(default_factory=list)
    outcomes: list[str] = dataclasses.field(default_factory=list)
    resident_bytes: int = 0
    streamed_blocks: int = 0
    uses_per_call: int | None = None
    unplanned_reloads: int = 0
    release: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
