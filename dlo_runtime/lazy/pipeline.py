"""The lazy pipeline at run time: :class:`LazyPipeline` loads, counts,
checks and releases the :class:`~dlo_runtime.lazy.proxy.LazyComponent`
proxies that :func:`dlo_runtime.lazy.build.lazy_pipeline` put in place of
the deferred components, at the call boundary (policy: the
:mod:`dlo_runtime.lazy` doc)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch
from torch import nn

from dlo_runtime.lazy.policy import CheckedPipeline, ComponentReport
from dlo_runtime.lazy.proxy import LazyComponent
from dlo_runtime.lazy.state import changes, fingerprint
from dlo_runtime.placement import OffloadDecision
from hwr_client.core.errors import FailedPrecondition

log = logging.getLogger(__name__)


def _tensor_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in model.state_dict(keep_vars=True).values():
        if t.is_meta:
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def _teardown(real: nn.Module, loaded: Any) -> None:
    """Closes a loaded component, then points its tensors at meta.

    1. ``loaded.close()``: with DLO (``device=``) the backend drains, removes
       its hooks and points every streamed parameter back at its host view
       through the Parameter objects it recorded, then closes the lease.
       Meta first would replace those Parameters, and the backend's restore
       would then write a host tensor into a meta one (``set_data`` refuses:
       incompatible tensor type).
    2. Meta, even when the close failed: a stray reference to the module (a
       generator frame, a context manager still open) then fails loudly
       instead of reading the closed lease. Nothing reads in between, and
       the views keep their mapping alive until they are dropped here.
    """
    from dlo_runtime.transaction import discard_model

    try:
        loaded.close()
    finally:
        discard_model(real)


class LazyPipeline:
    """What :func:`lazy_pipeline` returns: ``pipe`` (the diffusers
    pipeline, called as usual), ``components`` (the proxies), ``report``,
    ``close()``."""

    def __init__(self, pipe_dir: str, *, mode: str, dtype: str, decision: OffloadDecision, socket: str | None,
                 host_plan: str | None):
        self.pipe: Any = None
        self.pipeline_name = ""
        self.pipe_dir, self.mode, self.dtype = pipe_dir, mode, dtype
        self.decision, self.socket, self.host_plan = decision, socket, host_plan
        self.components: dict[str, LazyComponent] = {}
        self.compile: dict[str, Any] = {}  # name -> from_pretrained's compile= (dlo_runtime.compile)
        self.reports: dict[str, ComponentReport] = {}
        self.notes: list[str] = []
        self.calls = 0
        self._held: dict[str, Any] = {}  # name -> LoadedModel while loaded
        self._uses: dict[str, int] = {}  # uses in the current call
        self._problems: list[str] = []  # releases that failed in the current call
        self.checked: CheckedPipeline | None = None
        self._released_in_call: dict[str, str] = {}  # name -> "declared" | "counted"
        self._declared_off: set[str] = set()  # declared release proved too early: counts only
        self._early: set[str] = set()  # reloaded after a declared release in the current call
        self._stage = 0  # the current call's position in the declared use order
        self._in_call = False
        self._closed = False
        #: (seconds since the pipeline was made, resident component bytes)
        #: at every load and release: the peak is the largest set at once.
        self.timeline: list[tuple[float, str, int]] = []
        self._t0 = time.perf_counter()

    # -- loading ------------------------------------------------------------------

    def _device_of(self) -> torch.device:
        """Where every component computes (one device per lazy pipeline)."""
        return torch.device(self.decision.device or "cpu")

    def _load(self, proxy: LazyComponent) -> nn.Module:
        from dlo_runtime.pretrained import from_pretrained

        name = proxy._lazy_name
        rep = self.reports[name]
        if self._closed:
            raise FailedPrecondition(f"lazy pipeline {self.pipe_dir}: {name} used after close()")
        t = time.perf_counter()
        kwargs: dict[str, Any] = {}
        if self.host_plan is not None:
            kwargs["host_plan"] = self.host_plan
        if name in self.compile:
            kwargs["compile"] = self.compile[name]
        device = self.decision.device if self.decision.offload else None
        loaded = from_pretrained(self.pipe_dir, subfolder=name, mode=self.mode, dtype=self.dtype,
                                 device=device, socket=self.socket, progress=False, **kwargs)
        try:
            real = loaded.model
            if self.decision.device is not None and not self.decision.offload:
                real.to(self.decision.device)  # resident on the device (unified memory: the same pool)
            for method, args, kw in proxy._lazy_pending:
                getattr(real, method)(*args, **kw)
            regions = loaded.lease.regions() if loaded.lease is not None else ()
        except BaseException:
            loaded.close()
            raise
        d = object.__getattribute__(proxy, "__dict__")
        d.update(_lazy_real=real, _lazy_loaded=loaded, _lazy_regions=regions)
        self._take_state(proxy)
        self._held[name] = loaded
        how = self._released_in_call.pop(name, None) if self._in_call else None
        if how is not None:
            # Used after its release in this call: the call took a path the
            # declared order or the previous call's counts did not foresee.
            rep.unplanned_reloads += 1
            note = f"used after its {how} release in a call: reloaded"
            if note not in rep.notes:
                rep.notes.append(note)
            log.warning("lazy pipeline: %s %s", name, note)
            if how == "declared":
                self._early.add(name)
        rep.loads += 1
        rep.load_seconds.append(round(time.perf_counter() - t, 6))
        rep.bytes_materialized.append(int(loaded.report.bytes_materialized))
        rep.outcomes.append(loaded.outcome.value)
        placement = self.decision.reason
        host = getattr(loaded.report, "host_plan", None)
        rep.plan = f"{loaded.outcome.value}{f' / host plan {host}' if host else ''} ({placement})"
        rep.resident_bytes = _tensor_bytes(real)
        rep.streamed_blocks = len(loaded.report.blocks) if loaded.backend is not None else 0
        self._mark(f"load {name}")
        return real

    def _take_state(self, proxy: LazyComponent) -> None:
        """Snapshots the loaded component (tensors, then the rest of its
        state): taken after load, proven at release, since a reload must not
        come back different. Taken again after a ``to()``/``eval()``... the
        proxy records, because every reload replays those."""
        from dlo_runtime.restore import snapshot

        real = proxy._lazy_real
        d = object.__getattribute__(proxy, "__dict__")
        d.update(_lazy_snapshot=snapshot(real, proxy._lazy_regions), _lazy_state=fingerprint(real))

    def _apply_recorded(self, proxy: LazyComponent, method: str, args: Any, kwargs: Any) -> None:
        """Applies a recorded ``to()``/``eval()``... to the loaded component.
        Every reload replays it, so the state after it is the one a release
        must prove; what changed before it is judged first."""
        changed = self._changed(proxy) if self.reports[proxy._lazy_name].deferred else ""
        if changed:
            self._refuse(proxy, changed)
        getattr(proxy._lazy_real, method)(*args, **kwargs)
        self._take_state(proxy)

    def _changed(self, proxy: LazyComponent) -> str:
        """What changed in the loaded component since :meth:`_take_state`
        ("" when nothing did)."""
        from dlo_runtime.restore import compare_snapshots, snapshot

        real = proxy._lazy_real
        tensors = compare_snapshots(proxy._lazy_snapshot, snapshot(real, proxy._lazy_regions))
        if tensors:
            return f"its tensors changed after load ({tensors[:3]})"
        state = changes(proxy._lazy_state, fingerprint(real))
        if state:
            return f"its state changed after load, which a reload would drop ({state[:3]})"
        return ""

    def _mark(self, what: str) -> None:
        total = sum(self.reports[n].resident_bytes for n in self._held)
        self.timeline.append((round(time.perf_counter() - self._t0, 6), what, total))

    @property
    def peak_component_bytes(self) -> int:
        """The largest sum of loaded components' tensor bytes seen at once."""
        return max((b for _, _, b in self.timeline), default=0)

    def _refuse(self, proxy: LazyComponent, why: str) -> None:
        rep = self.reports[proxy._lazy_name]
        if rep.deferred:
            rep.deferred = False
            rep.why = f"refused for deferral: {why}; kept resident so it never reloads different"
            log.warning("lazy pipeline: %s %s", proxy._lazy_name, rep.why)

    def _release(self, proxy: LazyComponent, how: str = "") -> bool:
        name = proxy._lazy_name
        loaded = self._held.get(name)
        if loaded is None:
            return False
        rep = self.reports[name]
        if rep.deferred:
            changed = self._changed(proxy)
            if changed:
                self._refuse(proxy, changed)
        if not rep.deferred:
            return False
        d = object.__getattribute__(proxy, "__dict__")
        real = d["_lazy_real"]
        d.update(_lazy_real=None, _lazy_loaded=None, _lazy_snapshot=None, _lazy_state=None, _lazy_regions=())
        del self._held[name]
        if how and self._in_call:
            self._released_in_call[name] = how
        try:
            _teardown(real, loaded)
        finally:
            del real
            self._mark(f"release {name}")
        return True

    # -- the call boundary -----------------------------------------------------------

    def _wrap_use(self, proxy: LazyComponent, method: Any) -> Callable[..., Any]:
        name = proxy._lazy_name

        def use(*args: Any, **kwargs: Any) -> Any:
            counted = method is None or not method.__name__.startswith("_")
            if counted:
                self._before_use(proxy)
            fn: Any = method if method is not None else proxy._lazy_materialize()
            if proxy._lazy_real is None:
                fn = getattr(proxy._lazy_materialize(), fn.__name__)  # released since the read: reload
            out = fn(*args, **kwargs)
            if self._in_call and counted:
                self._uses[name] = self._uses.get(name, 0) + 1
                planned = self.reports[name].uses_per_call
                if planned is not None and self._uses[name] == planned:
                    self._try_release(proxy, "counted")  # its last use in the previous call
            return out

        return use

    def _try_release(self, proxy: LazyComponent, how: str) -> None:
        try:
            self._release(proxy, how)
        except Exception as exc:  # noqa: BLE001 - the use succeeded; reported when the call ends
            log.error("lazy pipeline: releasing %s failed: %s", proxy._lazy_name, exc)
            self._problems.append(f"{proxy._lazy_name}: {exc}")

    def _declared(self, name: str) -> int | None:
        """The component's last declared stage, unless it proved too early."""
        if self.checked is None or name in self._declared_off:
            return None
        return self.checked.last_stage(name)

    def _before_use(self, proxy: LazyComponent) -> None:
        """A use of ``proxy`` starts: moves the call to the next stage naming
        it and releases every loaded component whose declared last stage
        lies before that stage."""
        if not self._in_call or self.checked is None:
            return
        stage = self.checked.next_stage(proxy._lazy_name, self._stage)
        if stage is None:
            return  # off the declared path (an earlier stage again): nothing moves
        self._stage = stage
        for other in self.components.values():
            if other is proxy or other._lazy_real is None:
                continue
            last = self._declared(other._lazy_name)
            if last is not None and last < stage:
                self._try_release(other, "declared")

    def _call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._in_call:  # a nested call (a pipeline calling itself): one boundary
            return call(*args, **kwargs)
        self._in_call, self._uses, self._problems = True, {}, []
        self._released_in_call, self._early, self._stage = {}, set(), 0
        ok = False
        try:
            out = call(*args, **kwargs)
            ok = True
            return out
        except BaseException as exc:
            for problem in self._problems + self._release_all():
                exc.add_note(f"lazy pipeline: releasing after the failure also failed: {problem}")
            raise
        finally:
            self._in_call = False
            if ok:
                self.calls += 1
                for n in self._early - self._declared_off:
                    # The declared point was too early for this workload:
                    # from the next call on only the counted one applies.
                    self._declared_off.add(n)
                    self.reports[n].notes.append("declared release dropped: it was too early in a call; "
                                                 "released after the counted last use only")
                for n, rep in self.reports.items():
                    if rep.deferred:
                        rep.uses_per_call = self._uses.get(n, 0)
                        declared = self._declared(n)
                        rep.release = f"after use {rep.uses_per_call} of a call (counted)" + (
                            f", or on leaving its declared last stage ({declared})" if declared is not None else "")
                        unused = "deferred but not used in a call: nothing to release"
                        if rep.uses_per_call == 0 and unused not in rep.notes:
                            # Deferral that never acts is worth a look, not silence.
                            rep.notes.append(unused)
                problems = self._problems + self._release_all()
                if problems:
                    raise FailedPrecondition(f"lazy pipeline {self.pipe_dir}: release failed: {problems}")

    def _release_all(self) -> list[str]:
        problems = []
        for proxy in self.components.values():
            try:
                proxy._lazy_release()
            except Exception as exc:  # noqa: BLE001 - collected; the caller decides what to raise
                log.error("lazy pipeline: releasing %s failed: %s", proxy._lazy_name, exc)
                problems.append(f"{proxy._lazy_name}: {exc}")
        return problems

    # -- reporting and teardown ----------------------------------------------------

    @property
    def report(self) -> dict[str, Any]:
        """Per component (plan and why, load seconds, bytes materialized,
        resident bytes), the use order and where it came from, the placement
        decision, the completed calls and the notes."""
        order = self.checked
        return {"pipeline": self.pipeline_name, "calls": self.calls,
                "use_order": list(order.use_order) if order else None,
                "use_order_source": order.source if order else "",
                "placement": dataclasses.asdict(self.decision), "notes": list(self.notes),
                "peak_component_bytes": self.peak_component_bytes,
                "components": {n: dataclasses.asdict(r) for n, r in self.reports.items()}}

    def close(self) -> None:
        """Releases every loaded component, refused ones too. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for name in list(self._held):
            loaded = self._held.pop(name)
            proxy = self.components[name]
            d = object.__getattribute__(proxy, "__dict__")
            real, d["_lazy_real"], d["_lazy_loaded"] = d["_lazy_real"], None, None
            _teardown(real, loaded)
        self.pipe = None

    def __enter__(self) -> "LazyPipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LazyPipeline"]
