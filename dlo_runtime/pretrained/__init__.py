"""Real models through HWR and DLO with one call: :func:`from_pretrained`.

A diffusers model directory (``config.json`` with ``_class_name``,
``diffusion_pytorch_model*.safetensors``), a transformers one (``config.json``
with ``architectures``, ``model*.safetensors``), a pipeline component
(``subfolder="transformer"``) or a hub cache snapshot becomes a
:class:`PretrainedContract`: the same :class:`~dlo_runtime.contracts.Contract`
seam the reference model uses, filled in from the library class instead of
written by hand. The start then runs the one start-up decision path every
worker runs: :func:`hwr_client.resolve.resolve` decides (hit / miss / failure
per mode), :class:`~dlo_runtime.transaction.StartupTransaction` restores or
loads canonically and hands the lease to the DLO backend, and a preferred
miss publishes for the next start.

What the contract decides, and why:

- **identity**: every weight shard and ``config.json`` (the config decides the
  architecture); contract ``<library>:<Class>``; representation = dtype and
  the library's fp32-kept policy; producer = HWR's, the library's and torch's
  versions (an upgrade may change load transforms, so it gets a new key);
  ``fuse_qkv`` in ``extra``.
- **skeleton**: the model's own constructor under the target default dtype
  (what both libraries' ``from_pretrained`` do) with parameters put on meta
  as they are registered and buffers built for real on the CPU (accelerate's
  ``init_empty_weights(include_buffers=False)`` convention, ~20 lines here
  instead of a dependency), so non-persistent buffers (rotary tables,
  position ids) equal the ordinary load's; persistent buffers go to meta and
  come from the artifact or the checkpoint.
- **dtype policy**: the library's own: diffusers casts every floating tensor
  to the dtype except those under a ``_keep_in_fp32_modules`` name
  component; transformers keeps the constructed dtype except its dtype plan
  (``_keep_in_fp32_modules`` for fp16, ``_keep_in_fp32_modules_strict``
  for fp16 and bf16). Outputs then equal the library's ``from_pretrained``
  bit for bit (the tests prove it).
- **blocks**: ``"auto"`` finds the outermost ``nn.ModuleList`` stacks of
  same-class modules holding a tenth or more of the parameters, in
  registration order (the parity tests prove it is the execution order for
  the shipped families).

- **loading semantics**: the library's own, so a warm start equals the
  library's ``from_pretrained``: the weight files ``variant=`` and
  ``use_safetensors=`` pick (``.bin`` included), and one key plan
  (renames, ``base_model_prefix``, ignore lists, tied names) that the
  identity, the canonical load and hence publication all read. What HWR
  cannot represent loads with the library in preferred mode, decided
  before any daemon call.

Modules: :mod:`~dlo_runtime.pretrained.files` (what a directory holds, the
class it names, the weight files), :mod:`~dlo_runtime.pretrained.weights`
(safetensors and ``.bin`` behind one reader),
:mod:`~dlo_runtime.pretrained.keys` (the key plan),
:mod:`~dlo_runtime.pretrained.eligibility` (what falls back, and how the
report says so), :mod:`~dlo_runtime.pretrained.skeleton` (meta parameters,
real buffers, blocks), :mod:`~dlo_runtime.pretrained.contract` (the
contract), :mod:`~dlo_runtime.pretrained.publishing` (the publication
after a cold start, in the background); this one holds the call.

Example::

    with dlo_runtime.from_pretrained("models/flux/transformer", device="cuda:0") as loaded:
        out = loaded.model(**inputs)          # LOCAL_HIT from the second start on
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

import hwr_client
import hwr_client.client  # noqa: F401 - connect's module: imported with the runtime, not under a start's clock
from hwr_client.core.errors import FailedPrecondition, HwrError, InvalidArgument, Unavailable
from hwr_client.resolve import Mode, Outcome, Resolution, parse_mode
from hwr_client.sources import canonical_sources
from hwr_client.start import resolve_start

from dlo_runtime.background import running, wait_for_key
from dlo_runtime.compile import attach_to_pretrained, settings_for_pretrained
from dlo_runtime.contracts import private_bytes
from dlo_runtime.pretrained.contract import PretrainedContract
from dlo_runtime.pretrained.eligibility import (daemon_absent, decide, direct_map_refusal, no_daemon_message,
                                                 unused_keys_note, warn_fallback)
from dlo_runtime.pretrained.files import ModelFiles, hwr_version, import_library, model_files, resolve_class
from dlo_runtime.pretrained.loaded import LoadedModel, PretrainedReport, block_report
from dlo_runtime.pretrained.hostplan import HOST_PLANS, CheckpointMapping, HostWeightPlan, describe, preflight
from dlo_runtime.pretrained.publishing import publish_in_background
from dlo_runtime.pretrained.skeleton import (check_loaded, dtype_of, find_blocks, parameters_on_meta,
                                              publish_groups)

log = logging.getLogger(__name__)

# Read once with the runtime (it is part of every identity): looking it up
# scans sys.path, a few ms that would otherwise fall on a fresh worker's
# first start.
hwr_version()


def _library_load(files: ModelFiles, cls: Any, dtype: torch.dtype) -> nn.Module:
    """The library's own ``from_pretrained`` (what ``mode="disabled"`` is),
    with the ``variant=`` / ``use_safetensors=`` the caller gave."""
    kwargs: dict[str, Any] = {"torch_dtype" if files.library == "diffusers" else "dtype": dtype}
    if files.variant is not None:
        kwargs["variant"] = files.variant
    if files.use_safetensors is not None:
        kwargs["use_safetensors"] = files.use_safetensors
    return cls.from_pretrained(files.directory, **kwargs, local_files_only=True)


def _step(what: str, note: str) -> str:
    """A trail line. The transaction's ``published`` only means the model
    was handed to the publisher (publication runs after the start), so
    the report says ``publish_scheduled``; the publication's own result
    follows as its own line."""
    if what == "published":
        what = "publish_scheduled"
    return f"{what}: {note}" if note else what


def from_pretrained(
    model_dir: str | os.PathLike[str],
    *,
    subfolder: str | None = None,
    model_class: Any = None,
    mode: Mode | str = "preferred",
    dtype: str = "bfloat16",
    device: str | torch.device | None = None,
    blocks: str | Sequence[str] = "auto",
    resident_blocks: int = 0,
    fuse_qkv: bool = False,
    socket: str | None = None,
    progress: bool | Callable[[int, int], None] = True,
    host_plan: str = "hwr",
    variant: str | None = None,
    use_safetensors: bool | None = None,
    compile: bool | Mapping[str, Any] = False,
) -> LoadedModel:
    """Loads a diffusers / transformers model through HWR (and DLO).

    Args:
        model_dir: a model directory, a pipeline directory with
            ``subfolder``, or a hub cache snapshot. Never the network.
        subfolder: the component (``"transformer"``).
        model_class: default: the config's class in the installed library.
        mode: ``"preferred"`` (miss: load, serve, publish), ``"required"``
            (miss: raise, saying how to populate the store), ``"disabled"``
            (the library's own ``from_pretrained``; no socket, no hashing).
        dtype: runtime dtype; the library's fp32-kept modules stay fp32.
        device: DLO compute device (``"cuda:0"``, ``"cpu"``); None keeps the
            model resident on the CPU (no hooks).
        blocks: ``"auto"`` or module names (:func:`find_blocks`).
        resident_blocks: leading blocks kept on the device.
        fuse_qkv: the library's ``fuse_qkv_projections()`` as a final
            layout (its own key).
        socket: daemon runtime socket (default: the client's).
        progress: print publication progress to stderr (or a callable
            taking (bytes written, total)). A preferred miss publishes in
            the background (:mod:`dlo_runtime.background`): the call returns
            once the model is ready; ``LoadedModel.wait_published()`` waits.
        host_plan: where host weights come from
            (:mod:`~dlo_runtime.pretrained.hostplan`): ``"hwr"`` (default,
            the behaviour above), ``"ordinary"`` (the library's own load,
            as ``mode="disabled"``), ``"checkpoint-mmap"`` (read-only views
            of the checkpoint's mapping; raises when preflight refuses),
            ``"auto"`` (the cheapest for the case: checkpoint-mmap where
            preflight passes and ``mode`` is not ``"required"``, else HWR
            in ``mode``). The report says which was taken and why: outcome
            ``CHECKPOINT_MMAP`` for the checkpoint's own mapping.
        variant: the weight variant (``"fp16"``: ``model.fp16.safetensors``),
            as the library's ``variant=``.
        use_safetensors: as the library's ``use_safetensors=`` (True:
            safetensors only; False: ``.bin`` only; None: safetensors first).
        compile: True or a dict of ``torch.compile`` arguments: the model
            is compiled in place and its first call restores a compile
            artifact from HWR (or, without one, publishes one after the
            first output); see :mod:`dlo_runtime.compile`. Needs
            ``device=None``. The report is ``report.compile``.

    A model HWR cannot represent (:mod:`~dlo_runtime.pretrained.eligibility`:
    a custom loader, freshly initialized tensors, a byte-changing key
    converter...) is decided before any daemon call: ``"preferred"`` loads
    it with the library's own ``from_pretrained``, logs one WARNING and
    reports ``DISABLED`` with the reason in ``notes``; ``"required"``
    raises it. With no daemon listening on the socket, ``"preferred"``
    loads with the library at once (``CANONICAL_FALLBACK``, one WARNING
    "no HWR daemon at <socket>: is `hwr serve` running? loading without
    HWR", the same note) and ``"required"`` raises Unavailable.

    Returns:
        The :class:`LoadedModel`; close it (or use ``with``).

    Raises:
        NotFound, InvalidArgument: a bad directory, class or argument.
        FailedPrecondition: a checkpoint that does not fit the class (a
            shape mismatch, in every mode, as the library), an ineligible
            model in required mode (naming why), a missing library (naming
            the extra), a required miss.
        Unavailable: required mode with no daemon listening.
        HwrError: a FAILED resolution.
    """
    t0 = time.perf_counter()
    mode = parse_mode(mode)
    if host_plan not in HOST_PLANS:
        raise InvalidArgument(f"host_plan={host_plan!r}: expected one of {list(HOST_PLANS)}")
    compiling = settings_for_pretrained(compile, device=device)
    files = model_files(os.fspath(model_dir), subfolder, variant=variant, use_safetensors=use_safetensors)
    done = functools.partial(_compiled, settings=compiling, config_path=files.config_path, dtype=dtype, mode=mode,
                             socket=socket)
    cls = resolve_class(files, model_class)
    target = dtype_of(dtype)
    seconds: dict[str, float] = {}
    refused: HostWeightPlan | None = None
    contract: PretrainedContract | None = None
    notes: list[str] = []
    if host_plan != "ordinary" and (mode is not Mode.DISABLED or host_plan in ("checkpoint-mmap", "auto")):
        # Eligibility before any daemon call: headers and the meta skeleton only.
        contract = PretrainedContract(files, cls, dtype=dtype, fuse_qkv=fuse_qkv, blocks=blocks)
        seconds["skeleton"] = round(time.perf_counter() - t0, 6)
        reason = decide(contract, mode=mode, host_plan=host_plan)
        if reason:
            note = warn_fallback(contract.name, reason)
            return done(_fallback(files, cls, target, device, blocks, resident_blocks, fuse_qkv, t0,
                                  Outcome.DISABLED, note))
        notes += unused_keys_note(contract.name, contract.keys)
        seconds["keys"] = round(time.perf_counter() - t0 - seconds["skeleton"], 6)
    if host_plan == "checkpoint-mmap" or (host_plan == "auto" and mode is not Mode.REQUIRED):
        assert contract is not None
        skeleton = contract.build_skeleton()
        t = time.perf_counter()
        refusal = direct_map_refusal(files, contract.keys)
        plan = (HostWeightPlan("refused", (refusal,), files.weights) if refusal else
                preflight(skeleton, files.weights, contract.blocks(skeleton),
                          transforms=("fuse_qkv",) if fuse_qkv else ()))
        seconds["preflight"] = round(time.perf_counter() - t, 6)
        if plan.accepted:
            return done(_checkpoint_mmap(contract, skeleton, plan, device, resident_blocks, t0, seconds,
                                         host_plan, socket=socket))
        if host_plan == "checkpoint-mmap":
            raise FailedPrecondition(f"{files.directory}: host_plan='checkpoint-mmap' refused by preflight: "
                                     f"{plan.reason}; use host_plan='auto' to fall back to HWR")
        refused = plan
        contract.give_back(skeleton)  # untouched by preflight: the HWR start's first skeleton
    if mode is Mode.DISABLED or host_plan == "ordinary":
        loaded = _disabled(files, cls, target, device, blocks, resident_blocks, fuse_qkv, t0)
        loaded.report.host_plan = "ordinary"
        loaded.report.host_plan_reason = describe(refused, "ordinary", host_plan)
        return done(loaded)
    from dlo_runtime.options import OffloadOptions
    from dlo_runtime.transaction import ModelRecipe, StartupTransaction

    assert contract is not None
    nblocks = contract.block_count()
    if device is None:
        # Resident: the backend keeps every block on the CPU and streams none,
        # but still owns (and closes) the lease on a warm start.
        options = OffloadOptions(device="cpu", resident_blocks=nblocks)
    else:
        options = OffloadOptions(device=device, resident_blocks=resident_blocks)
    client = hwr_client.connect(socket)
    if daemon_absent(client.socket):
        # Before hashing a byte: an identity nobody can serve is pure cost.
        client.close()
        if mode is Mode.REQUIRED:
            raise Unavailable(f"HWR required: no HWR daemon at {client.socket}: is `hwr serve` running? "
                              "start it (the daemon needs no options) or use mode='preferred'")
        note = no_daemon_message(client.socket)
        log.warning("from_pretrained %s: %s", contract.name, note)
        return done(_fallback(files, cls, target, device, blocks, resident_blocks, fuse_qkv, t0,
                              Outcome.CANONICAL_FALLBACK, note))
    pending: list[bool] = []
    resolved: list[Resolution] = []
    sources = canonical_sources(contract.source_files(files.directory))

    def resolve() -> Resolution:
        # One call: the daemon vouches for the sources, builds the identity
        # and leases a hit (hwr_client.start); nothing is hashed here unless
        # the daemon cannot vouch (the notes then say why).
        t = time.perf_counter()
        ours = running()  # before asking: one that ends meanwhile still counts
        res = resolve_start(client, contract.identity_template(), sources, mode=mode)
        if not res.hit and ours and _own_publication_ended(res, ours):
            # This process's own background publication of the key was
            # running: it has ended, so ask once more (a hit, if it committed).
            res = resolve_start(client, contract.identity_template(), sources, mode=mode)
        seconds["resolve"] = round(time.perf_counter() - t, 6)
        resolved.append(res)
        return res

    try:
        recipe = ModelRecipe(
            build_skeleton=contract.build_skeleton,
            load_canonical=lambda skel, copts: contract.canonical_load(skel, mmap=copts.checkpoint_mmap),
            select_blocks=contract.blocks,
            finalize=contract.finalize,
            publish_after_load=lambda m: pending.append(True),
        )
        t = time.perf_counter()
        result = StartupTransaction(mode, recipe, resolve, options).run()
        seconds["start"] = round(time.perf_counter() - t, 6)
    except BaseException:
        client.close()
        raise
    model, backend = result.model, result.backend
    report = PretrainedReport(result.outcome.value, "", contract.name, contract.library_version,
                              trail=[_step(s.what, s.note) for s in result.trail])
    report.notes += notes + list(resolved[0].notes)
    # A certain miss whose sources are still being hashed: the publication
    # waits for its identity on its own thread, never the start.
    identity = resolved[0].identity or resolved[0].deferred
    report.key = resolved[0].identity.key if resolved[0].identity is not None else ""
    report.host_plan_reason = describe(refused, "hwr", host_plan)
    report.producer_calls = contract.counters.producer_calls
    report.checkpoint_bytes_read = contract.counters.checkpoint_bytes_read
    report.bytes_materialized = contract.counters.bytes_materialized
    if result.outcome is Outcome.LOCAL_HIT:
        # Independent of the counters: every CPU tensor must lie in the lease's mapping.
        report.bytes_materialized += private_bytes(model, backend.lease.regions())
    if device is not None:
        block_report(model, contract.blocks(model)[options.resident_blocks:], report)
    loaded = LoadedModel(model, report, backend=backend, client=client, contract=contract)
    report.seconds = seconds  # before the publication starts: its end adds "publish" to this dict
    if pending and identity is not None:
        loaded.publication = publish_in_background(model, contract, identity, client.socket, report, progress)
    seconds["total"] = round(time.perf_counter() - t0, 6)
    log.info("from_pretrained %s: %s in %.3fs (materialized %d bytes, %d producer calls)", contract.name,
             report.outcome, seconds["total"], report.bytes_materialized, report.producer_calls)
    return done(loaded)


def _compiled(loaded: LoadedModel, **how: Any) -> LoadedModel:
    """``compile=``: the model compiled in place (:mod:`dlo_runtime.compile`)."""
    try:
        attach_to_pretrained(loaded, **how)
    except BaseException:
        loaded.close()
        raise
    return loaded


def _own_publication_ended(res: Resolution, ours: list[Any]) -> bool:
    """Whether one of ``ours`` (this process's publications running when
    the start asked) publishes this start's key; if so it was waited for.
    Called only while one runs: a deferred identity (sources still being
    hashed) is waited for here, a cost only a process loading the same
    model twice pays."""
    try:
        identity = res.identity_now()
    except HwrError:
        return False
    return identity is not None and wait_for_key(identity.key, among=ours) is not None


def _checkpoint_mmap(contract: PretrainedContract, skeleton: nn.Module, plan: HostWeightPlan, device: Any,
                     resident_blocks: int, t0: float, seconds: dict[str, float], asked: str, *,
                     socket: str | None = None) -> LoadedModel:
    """An accepted plan: runtime tensors are read-only views of the
    checkpoint's mapping; DLO streams each block's span (or, with no
    device, every block stays resident on those views). Nothing published,
    nothing leased: the outcome says so (``CHECKPOINT_MMAP``)."""
    from dlo_runtime.backend import OffloadBackend
    from dlo_runtime.options import OffloadOptions
    from dlo_runtime.restore import finalize_shared

    mapping = CheckpointMapping(plan)
    # On a CUDA device the blocks' pages may be registered: under the node
    # daemon's admission when one answers (nothing else is asked of it).
    client = _admission_client(socket) if device is not None and torch.device(device).type == "cuda" else None
    try:
        mapping.session = client.session() if client is not None else None
        mapping.bind(skeleton)
        check_loaded(skeleton, contract.name)
        # eval / no grad must be byte- and pointer-neutral on the views (read-only: pointers prove it).
        finalize_shared(skeleton, contract.finalize, regions=mapping.regions())
        found = contract.blocks(skeleton)
        options = (OffloadOptions(device="cpu", resident_blocks=len(found)) if device is None
                   else OffloadOptions(device=device, resident_blocks=resident_blocks))
        report = PretrainedReport(Outcome.CHECKPOINT_MMAP.value, "", contract.name, contract.library_version,
                                  host_plan="checkpoint-mmap",
                                  host_plan_reason=describe(plan, "checkpoint-mmap", asked))
        report.bytes_materialized = private_bytes(skeleton, mapping.regions())
        # The exact plan object reaches DLO: the mapping answers the lease API from it.
        backend = OffloadBackend(skeleton, found, options, source=mapping).start()
    except BaseException:
        mapping.close()
        if client is not None:
            client.close()
        raise
    if device is not None:
        block_report(skeleton, found[options.resident_blocks:], report)
    report.seconds = {**seconds, "total": round(time.perf_counter() - t0, 6)}
    return LoadedModel(skeleton, report, backend=backend, client=client, contract=contract)


def _admission_client(socket: str | None) -> Any:
    """A daemon client for registration admission, or None when no daemon
    listens (the registration then proceeds unaccounted, as for any
    source without a session)."""
    client = hwr_client.connect(socket)
    if daemon_absent(client.socket):
        client.close()
        return None
    return client


def _fallback(files: ModelFiles, cls: Any, dtype: torch.dtype, device: Any, blocks: Any, resident_blocks: int,
              fuse_qkv: bool, t0: float, outcome: Outcome, note: str) -> LoadedModel:
    """A start HWR does not serve, loaded with the library's own load; the
    report says so (``outcome``, the note first in ``notes``)."""
    loaded = _disabled(files, cls, dtype, device, blocks, resident_blocks, fuse_qkv, t0)
    report = loaded.report
    report.outcome = outcome.value
    report.notes.insert(0, note)
    report.host_plan, report.host_plan_reason = "ordinary", f"ordinary: {note}"
    return loaded


def _disabled(files: ModelFiles, cls: Any, dtype: torch.dtype, device: Any, blocks: Any, resident_blocks: int,
              fuse_qkv: bool, t0: float) -> LoadedModel:
    """``mode="disabled"``: the library's own load; no client, no identity."""
    if fuse_qkv and not hasattr(cls, "fuse_qkv_projections"):
        raise InvalidArgument(f"fuse_qkv=True: {files.library}:{cls.__name__} has no fuse_qkv_projections(); "
                              "expected a diffusers model that supports QKV fusion")
    model = _library_load(files, cls, dtype)
    if fuse_qkv:
        with torch.no_grad():
            model.fuse_qkv_projections()
    model.eval()
    model.requires_grad_(False)
    lib = import_library(files.library)
    report = PretrainedReport(Outcome.DISABLED.value, "", f"{files.library}:{cls.__name__}", str(lib.__version__))
    backend = None
    found = find_blocks(model, blocks)
    if device is not None and found:
        from dlo_runtime.backend import enable_layerwise_offload

        backend = enable_layerwise_offload(model, found, device=device, resident_blocks=resident_blocks)
        found = found[resident_blocks:]
    if device is not None:
        block_report(model, found, report)
    report.seconds = {"total": round(time.perf_counter() - t0, 6)}
    return LoadedModel(model, report, backend=backend)


__all__ = ["HOST_PLANS", "HostWeightPlan", "PretrainedReport", "preflight", "LoadedModel", "ModelFiles",
           "PretrainedContract", "check_loaded", "find_blocks", "from_pretrained", "model_files", "parameters_on_meta",
           "publish_groups", "resolve_class"]
