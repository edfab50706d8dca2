"""The first compiled call: where a compile artifact is restored or made.

:func:`compile_model` compiles a module in place, as ``model.compile()``
does (``torch.compile`` of its ``_call_impl``: the object stays the
library's own), behind a one-time wrapper. The key needs the first call's
arguments (shapes, dtypes), so the wrapper runs the sequence there:

1. Key: model source, toolchain, device, options, inputs (:mod:`.key`).
2. Resolve it through the daemon (``verify="full"``: every byte re-hashed
   against the manifest; pull on a miss when the daemon has a remote).
3. Hit: restore the entries into this process's own cache folder
   (:mod:`.payload`, :mod:`.folder`), release the lease (the entries are
   copies now), report ``hit``.
4. The compiled call: on a hit torch finds every entry it needs in its
   folder; on a miss it compiles.
5. Miss in preferred mode: torch's mega-cache is taken on this thread
   (torch's own state), the folder is read and published by the
   :class:`~dlo_runtime.compile.background.Publisher`; the output is
   returned at once.
6. Later calls go straight to torch's compiled callable.

Modes as for weights: ``disabled`` compiles without HWR; ``preferred``
treats a miss, an unusable artifact or an unreachable daemon as "compile
here" (and publishes when a daemon listens); ``required`` raises at the
first call instead of compiling (the error says how to populate the store).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping

import torch
from torch import nn

from hwr_client.core.annotations import ANNOTATIONS_SCHEMA_VERSION
from hwr_client.core.compile_link import ANNOTATION_KEY, figures_of
from hwr_client.core.errors import FailedPrecondition, HwrError, Unavailable
from hwr_client.core.identity import Identity
from hwr_client.resolve import Mode, parse_mode

from dlo_runtime.compile import folder as cache_folder
from dlo_runtime.compile import key as compile_key
from dlo_runtime.compile import payload
from dlo_runtime.compile.background import Publisher, ThreadPublisher
from dlo_runtime.compile.records import BYPASSED, HIT, MISS, CompileReport, ModelSource
from dlo_runtime.compile.settings import CompileSettings, parse_compile

log = logging.getLogger(__name__)


class _FirstCall:
    """Stands in ``model._compiled_call_impl`` until the first call is done."""

    def __init__(self, model: nn.Module, compiled: Callable[..., Any], settings: CompileSettings,
                 source: ModelSource, *, mode: Mode, socket: str | None, report: CompileReport,
                 publisher: Publisher, tools: Mapping[str, str] | None):
        self.model, self.compiled, self.settings, self.source = model, compiled, settings, source
        self.mode, self.socket, self.report, self.publisher, self.tools = mode, socket, report, publisher, tools
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:  # two threads' first calls: one restores or compiles, the other then runs warm
            if self.model._compiled_call_impl is not self:
                return self.compiled(*args, **kwargs)
            out = self._first(args, kwargs)
            self.model._compiled_call_impl = self.compiled
            return out

    # -- the sequence ------------------------------------------------------------------

    def _first(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        report = self.report
        if self.mode is Mode.DISABLED or not self.settings.cached:
            report.status = BYPASSED
            report.reason = ("HWR disabled" if self.mode is Mode.DISABLED else
                             f"backend {self.settings.backend!r} leaves no kernel cache to store")
            return self._timed_call(args, kwargs, settle=True)
        try:
            folder = cache_folder.worker_folder()
        except FailedPrecondition as exc:
            if self.mode is Mode.REQUIRED:
                raise
            report.status, report.reason = BYPASSED, str(exc)
            log.warning("compile %s: %s; compiling without HWR", self.source.name, exc)
            return self._timed_call(args, kwargs, settle=True)
        identity = self._identity(args, kwargs)  # 1.
        report.key = identity.key
        import hwr_client

        client = hwr_client.connect(self.socket)
        try:
            res = client.resolve(identity, mode=self.mode, verify="full")  # 2.
            if res.outcome == "FAILED":
                assert res.error is not None
                raise res.error
            cold_s = self._restore(res, folder.path) if res.hit else None  # 3.
            out = self._timed_call(args, kwargs, settle=False)  # 4.
        except BaseException:
            client.close()
            raise
        if res.hit or isinstance(res.error, Unavailable):
            if cold_s is not None:
                self._hit_seconds(cold_s)
            elif not res.hit:
                report.status, report.reason = MISS, res.reason
                report.publish = "skipped: no HWR daemon answered"
            client.close()
            report.settle()
            return out
        report.status, report.reason = MISS, res.reason
        self._publish_later(client, identity, folder.path)  # 5.
        return out

    def _identity(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Identity:
        device = compile_key.device_of(self.model, args, kwargs)
        return compile_key.compile_identity(
            self.source, self.settings, tools=self.tools or compile_key.toolchain(),
            device=compile_key.device_document(device),
            inputs=compile_key.input_document(self.model, args, kwargs, dynamic=self.settings.dynamic),
            inductor_config=compile_key.inductor_config_digest())

    def _restore(self, res: Any, folder: str) -> float | None:
        """Writes the leased artifact's entries; the cold first output its
        publisher measured (seconds), or None when it could not be used."""
        report = self.report
        t = time.perf_counter()
        lease = res.lease
        try:
            restored = payload.restore_lease(lease, folder)
            figures = figures_of(lease.manifest.annotations)
        except (FailedPrecondition, OSError) as exc:
            if self.mode is Mode.REQUIRED:
                raise FailedPrecondition(f"HWR required: compile artifact {res.key[:12]} cannot be restored: "
                                         f"{exc}") from None
            # Not corrupt by its digests (verify passed) but refused by the
            # restore's rules: every worker would refuse it; the operator removes it.
            report.status, report.reason = MISS, (f"compile artifact {res.key[:12]} not restored: {exc}; "
                                                  f"`hwr rm {res.key}` removes it")
            report.publish = "skipped: the store holds this key"
            log.warning("compile %s: %s; compiling here", self.source.name, report.reason)
            return None
        finally:
            lease.close()  # the entries are copies in this process's folder now
        report.status, report.reason = HIT, res.reason
        report.files, report.bytes = restored.files + restored.present, restored.bytes
        if restored.present:
            report.notes.append(f"{restored.present} entries were already in the cache folder")
        report.seconds["restore"] = round(time.perf_counter() - t, 6)
        ms = figures.get("first_output_ms")
        return ms / 1000 if isinstance(ms, int) and not isinstance(ms, bool) and ms >= 0 else -1.0

    def _timed_call(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, settle: bool) -> Any:
        t = time.perf_counter()
        out = self.compiled(*args, **kwargs)
        self.report.seconds["first_call"] = round(time.perf_counter() - t, 6)
        self.report.seconds["first_output"] = round(self.report.seconds.get("restore", 0.0)
                                                    + self.report.seconds["first_call"], 6)
        if settle:
            self.report.settle()
        return out

    def _hit_seconds(self, cold_s: float) -> None:
        seconds = self.report.seconds
        if cold_s >= 0:
            seconds["cold_first_output"] = round(cold_s, 3)
            seconds["saved"] = round(cold_s - seconds["first_output"], 3)
        log.info("compile %s: hit %s, first output in %.2f s (cold %s)", self.source.name, self.report.key[:12],
                 seconds["first_output"], f"{cold_s:.2f} s" if cold_s >= 0 else "not recorded")

    def _publish_later(self, client: Any, identity: Identity, folder: str) -> None:
        report = self.report
        if self.mode is not Mode.PREFERRED:
            client.close()
            report.settle()
            return
        mega = _mega_cache()
        first_ms = int(report.seconds["first_output"] * 1000)
        report.publish = "scheduled"

        def job() -> None:
            t = time.perf_counter()
            try:
                tensors = payload.to_tensors(cache_folder.capture(folder), mega)
                report.files, report.bytes = payload.summary(tensors)
                annotations = {"schema_version": ANNOTATIONS_SCHEMA_VERSION, "data": {ANNOTATION_KEY: {
                    "first_output_ms": first_ms, "files": report.files, "mega_cache": mega is not None}}}
                rep = client.publish(identity, tensors, blocks=[], annotations=annotations)
                report.publish = "already_published" if rep.already_published else "published"
            except Exception as exc:  # noqa: BLE001 - background work: reported, never raised into serving
                report.publish = f"failed: {type(exc).__name__}: {exc}"
                log.warning("compile %s: publication of %s failed: %s", self.source.name, identity.key[:12],
                            report.publish, exc_info=not isinstance(exc, HwrError))
            finally:
                report.seconds["publish"] = round(time.perf_counter() - t, 6)
                client.close()
                report.settle()

        self.publisher.submit(f"hwr-compile-publish-{identity.key[:8]}", job)


def _mega_cache() -> bytes | None:
    """torch's portable cache artifacts of this process so far (its own
    state: taken on the compiling thread)."""
    try:
        saved = torch.compiler.save_cache_artifacts()
    except Exception:  # noqa: BLE001 - the folder entries serve without it
        log.debug("torch.compiler.save_cache_artifacts() failed", exc_info=True)
        return None
    return saved[0] if saved else None


def compile_model(model: nn.Module, compile: Any = True, *, source: ModelSource, mode: Mode | str = "preferred",
                  socket: str | None = None, publisher: Publisher | None = None,
                  toolchain: Mapping[str, str] | None = None) -> CompileReport:
    """Compiles ``model`` in place with a compile artifact from HWR when the
    store has one, and publishes one when it had none (module doc).

    Args:
        model: the module (``model.compile()`` semantics: the same object,
            its calls compiled).
        compile: True or a dict of ``torch.compile`` arguments
            (:func:`~dlo_runtime.compile.settings.parse_compile`).
        source: what the model is (the model half of the key).
        mode: ``"preferred"``, ``"required"`` or ``"disabled"``.
        socket: the daemon's runtime socket (default: the client's).
        publisher: where publication runs (default: a plain thread).
        toolchain: the toolchain the key is computed for (default: this
            process's; a seam for tests and tools).

    Returns:
        The :class:`~dlo_runtime.compile.records.CompileReport`, filled in
        at the first call.

    Raises:
        InvalidArgument: bad ``compile``/``mode`` (now); at the first call,
        in required mode: NotFound (no artifact), FailedPrecondition
        (unusable artifact or cache folder), Unavailable (no daemon).

    Example:
        >>> report = compile_model(model, {"dynamic": False}, source=src)   # doctest: +SKIP
        >>> out = model(x); report.status                                   # doctest: +SKIP
        'hit'
    """
    settings = parse_compile(compile)
    mode = parse_mode(mode)
    report = CompileReport()
    if settings is None:
        report.status, report.reason = BYPASSED, "compile=False"
        report.settle()
        return report
    compiled = torch.compile(model._call_impl, **settings.torch_kwargs())
    model._compiled_call_impl = _FirstCall(model, compiled, settings, source, mode=mode, socket=socket,
                                           report=report, publisher=publisher or ThreadPublisher(),
                                           tools=toolchain)
    return report


__all__ = ["compile_model"]
