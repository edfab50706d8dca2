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

Modules: :mod:`~dlo_runtime.pretrained.files` (what a directory holds, the
class it names), :mod:`~dlo_runtime.pretrained.skeleton` (meta parameters,
real buffers, blocks), :mod:`~dlo_runtime.pretrained.contract` (the
contract); this one holds the call.

Example::

    with dlo_runtime.from_pretrained("models/flux/transformer", device="cuda:0") as loaded:
        out = loaded.model(**inputs)          # LOCAL_HIT from the second start on
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

import hwr_client
import hwr_client.client  # noqa: F401 - connect's module: imported with the runtime, not under a start's clock
from hwr_client.core.errors import FailedPrecondition, HwrError, InvalidArgument
from hwr_client.core.identity import Identity
from hwr_client.resolve import Mode, Outcome, Resolution, parse_mode
from hwr_client.sources import canonical_sources
from hwr_client.start import resolve_start

from dlo_runtime.contracts import private_bytes
from dlo_runtime.pretrained.contract import PretrainedContract
from dlo_runtime.pretrained.files import ModelFiles, hwr_version, import_library, model_files, resolve_class
from dlo_runtime.pretrained.hostplan import HOST_PLANS, CheckpointMapping, HostWeightPlan, describe, preflight
from dlo_runtime.pretrained.skeleton import (check_loaded, dtype_of, find_blocks, nparams, parameters_on_meta,
                                              publish_groups)
from dlo_runtime.restore import tensor_slots

log = logging.getLogger(__name__)

# Read once with the runtime (it is part of every identity): looking it up
# scans sys.path, a few ms that would otherwise fall on a fresh worker's
# first start.
hwr_version()


@dataclasses.dataclass
class PretrainedReport:
    """What a :func:`from_pretrained` start did and cost.

    Attributes:
        outcome: ``LOCAL_HIT``, ``CANONICAL_FALLBACK``, ``DISABLED`` or
            ``CHECKPOINT_MMAP`` (served from the checkpoint's own mapping).
        key: identity key ("" when disabled).
        contract: ``<library>:<Class>``; ``library_version`` its version.
        seconds: wall seconds per phase (``skeleton``, ``preflight``,
            ``resolve``: identity and lease in one call, ``start``,
            ``publish``), and ``total``.
        bytes_materialized: private bytes this process allocated for the
            model's tensors (0 on a warm start).
        producer_calls: canonical loads run (0 on a warm start).
        blocks: names of the streamed blocks, in order; ``streamed_bytes``
            their bytes; ``streamed_fraction`` their share of the parameters.
        notes: anything worth a look (streamed blocks under half the model;
            source files the worker hashed itself, why, and what would make
            the start fast).
        publish: the publish-after-load report on a preferred miss.
        trail: the startup transaction's steps.
        host_plan: the host-weight plan taken: ``"checkpoint-mmap"``,
            ``"hwr"`` or ``"ordinary"``; ``host_plan_reason`` why
            (:mod:`dlo_runtime.pretrained.hostplan`).
    """

    outcome: str
    key: str = ""
    contract: str = ""
    library_version: str = ""
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_materialized: int = 0
    producer_calls: int = 0
    checkpoint_bytes_read: int = 0
    blocks: list[str] = dataclasses.field(default_factory=list)
    streamed_bytes: int = 0
    streamed_fraction: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)
    publish: dict[str, Any] | None = None
    trail: list[str] = dataclasses.field(default_factory=list)
    host_plan: str = "hwr"
    host_plan_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return dataclasses.asdict(self)


class LoadedModel:
    """A model :func:`from_pretrained` started: ``model`` (eval mode, DLO
    hooks when a device was given), ``outcome``, ``key``, ``report``.
    :meth:`close` (or leaving the ``with`` block) tears down the backend,
    which closes the lease, then the client."""

    def __init__(self, model: nn.Module, report: PretrainedReport, *, backend: Any = None, client: Any = None,
                 contract: PretrainedContract | None = None):
        self.model, self.report = model, report
        self.backend, self.client, self.contract = backend, client, contract

    @property
    def outcome(self) -> Outcome:
        """How the start went (:class:`~hwr_client.resolve.Outcome`)."""
        return Outcome(self.report.outcome)

    @property
    def key(self) -> str:
        """The identity key ("" when HWR was disabled)."""
        return self.report.key

    @property
    def lease(self) -> Any:
        """The lease the backend owns on a warm start, else None."""
        return getattr(self.backend, "lease", None)

    def close(self) -> None:
        """Backend (drain, unhook, close the lease), then the client. Idempotent."""
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()
        client, self.client = self.client, None
        if client is not None:
            client.close()

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _library_load(files: ModelFiles, cls: Any, dtype: torch.dtype) -> nn.Module:
    """The library's own ``from_pretrained`` (what ``mode="disabled"`` is)."""
    key = "torch_dtype" if files.library == "diffusers" else "dtype"
    return cls.from_pretrained(files.directory, **{key: dtype}, local_files_only=True)


def _block_report(model: nn.Module, blocks: Sequence[nn.Module], report: PretrainedReport) -> None:
    names = {id(m): n for n, m in model.named_modules()}
    report.blocks = [names[id(b)] for b in blocks]
    streamed = sum(s.tensor.nbytes for b in blocks for s in tensor_slots(b).slots)
    params = sum(p.numel() for b in blocks for p in b.parameters())
    report.streamed_bytes = streamed
    report.streamed_fraction = round(params / max(nparams(model), 1), 4)
    if report.streamed_fraction < 0.5:
        report.notes.append(f"streamed blocks hold {report.streamed_fraction:.0%} of the parameters (under half): "
                            "pass blocks=[...] to stream more")


def _progress_printer(what: str) -> Callable[[int, int], None]:
    last = [-1]

    def show(done: int, total: int) -> None:
        step = 100 * done // max(total, 1) // 25 * 25
        if step > last[0]:
            last[0] = step
            print(f"{what} {step:3d}%  ({done >> 20} / {total >> 20} MiB)", file=sys.stderr, flush=True)

    return show


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
    progress: bool = True,
    host_plan: str = "hwr",
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
        progress: print publication progress to stderr.
        host_plan: where host weights come from
            (:mod:`~dlo_runtime.pretrained.hostplan`): ``"hwr"`` (default,
            the behaviour above), ``"ordinary"`` (the library's own load,
            as ``mode="disabled"``), ``"checkpoint-mmap"`` (read-only views
            of the checkpoint's mapping; raises when preflight refuses),
            ``"auto"`` (the cheapest for the case: checkpoint-mmap where
            preflight passes and ``mode`` is not ``"required"``, else HWR
            in ``mode``). The report says which was taken and why: outcome
            ``CHECKPOINT_MMAP`` for the checkpoint's own mapping.

    Returns:
        The :class:`LoadedModel`; close it (or use ``with``).

    Raises:
        NotFound, InvalidArgument: a bad directory, class or argument.
        FailedPrecondition: a checkpoint that does not fit the class, a
            missing library (naming the extra), a required miss.
        HwrError: a FAILED resolution.
    """
    t0 = time.perf_counter()
    mode = parse_mode(mode)
    if host_plan not in HOST_PLANS:
        raise InvalidArgument(f"host_plan={host_plan!r}: expected one of {list(HOST_PLANS)}")
    files = model_files(os.fspath(model_dir), subfolder)
    cls = resolve_class(files, model_class)
    target = dtype_of(dtype)
    seconds: dict[str, float] = {}
    refused: HostWeightPlan | None = None
    contract: PretrainedContract | None = None
    spare: list[nn.Module] = []  # a skeleton preflight built and did not touch: the HWR path's first
    if host_plan == "checkpoint-mmap" or (host_plan == "auto" and mode is not Mode.REQUIRED):
        contract = PretrainedContract(files, cls, dtype=dtype, fuse_qkv=fuse_qkv, blocks=blocks)
        skeleton = contract.build_skeleton()
        seconds["skeleton"] = round(time.perf_counter() - t0, 6)
        t = time.perf_counter()
        plan = preflight(skeleton, files.weights, contract.blocks(skeleton),
                         transforms=("fuse_qkv",) if fuse_qkv else ())
        seconds["preflight"] = round(time.perf_counter() - t, 6)
        if plan.accepted:
            return _checkpoint_mmap(contract, skeleton, plan, device, resident_blocks, t0, seconds, host_plan)
        if host_plan == "checkpoint-mmap":
            raise FailedPrecondition(f"{files.directory}: host_plan='checkpoint-mmap' refused by preflight: "
                                     f"{plan.reason}; use host_plan='auto' to fall back to HWR")
        refused = plan
        spare.append(skeleton)
    if mode is Mode.DISABLED or host_plan == "ordinary":
        loaded = _disabled(files, cls, target, device, blocks, resident_blocks, fuse_qkv, t0)
        loaded.report.host_plan = "ordinary"
        loaded.report.host_plan_reason = describe(refused, "ordinary", host_plan)
        return loaded
    from dlo_runtime.options import OffloadOptions
    from dlo_runtime.transaction import ModelRecipe, StartupTransaction

    if contract is None:
        contract = PretrainedContract(files, cls, dtype=dtype, fuse_qkv=fuse_qkv, blocks=blocks)
        spare.append(contract.build_skeleton())  # the one it built to read its dtype policy
        seconds["skeleton"] = round(time.perf_counter() - t0, 6)
    # Found once for the first skeleton; the transaction and the report reuse them.
    first, found = spare[0], contract.blocks(spare[0])
    nblocks = len(found)
    if device is None:
        # Resident: the backend keeps every block on the CPU and streams none,
        # but still owns (and closes) the lease on a warm start.
        options = OffloadOptions(device="cpu", resident_blocks=nblocks)
    else:
        options = OffloadOptions(device=device, resident_blocks=resident_blocks)
    if nblocks == 0:
        raise InvalidArgument(f"{contract.name}: no blocks found to stream; pass blocks=[...] module names")
    client = hwr_client.connect(socket)
    pending: list[bool] = []
    resolved: list[Resolution] = []

    def resolve() -> Resolution:
        # One call: the daemon vouches for the sources, builds the identity
        # and leases a hit (hwr_client.start); nothing is hashed here unless
        # the daemon cannot vouch (the notes then say why).
        t = time.perf_counter()
        res = resolve_start(client, contract.identity_template(),
                            canonical_sources(contract.source_files(files.directory)), mode=mode)
        seconds["resolve"] = round(time.perf_counter() - t, 6)
        resolved.append(res)
        return res

    try:
        recipe = ModelRecipe(
            build_skeleton=lambda: spare.pop() if spare else contract.build_skeleton(),
            load_canonical=lambda skel, copts: contract.canonical_load(skel, mmap=copts.checkpoint_mmap),
            select_blocks=lambda m: found if m is first else contract.blocks(m),
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
                              trail=[f"{s.what}: {s.note}" if s.note else s.what for s in result.trail])
    identity = _identity_of(resolved[0], report)
    report.host_plan_reason = describe(refused, "hwr", host_plan)
    report.producer_calls = contract.counters.producer_calls
    report.checkpoint_bytes_read = contract.counters.checkpoint_bytes_read
    report.bytes_materialized = contract.counters.bytes_materialized
    if result.outcome is Outcome.LOCAL_HIT:
        # Independent of the counters: every CPU tensor must lie in the lease's mapping.
        report.bytes_materialized += private_bytes(model, backend.lease.regions())
    if device is not None:
        _block_report(model, (found if model is first else contract.blocks(model))[options.resident_blocks:], report)
    loaded = LoadedModel(model, report, backend=backend, client=client, contract=contract)
    if pending and identity is not None:
        t = time.perf_counter()
        # On a CUDA device the backend moved the non-block tensors there:
        # publication takes host bytes (streamed blocks stay on the host).
        tensors = {s.name: s.tensor.detach() if s.tensor.device.type == "cpu" else s.tensor.detach().cpu()
                   for s in tensor_slots(model).slots}
        rep = client.publish_after_load(identity, tensors, blocks=publish_groups(model, contract.blocks(model)),
                                        progress=_progress_printer(f"hwr: publishing {contract.name}")
                                        if progress else None)
        del tensors
        report.publish = dataclasses.asdict(rep)
        seconds["publish"] = round(time.perf_counter() - t, 6)
    seconds["total"] = round(time.perf_counter() - t0, 6)
    report.seconds = seconds
    log.info("from_pretrained %s: %s in %.3fs (materialized %d bytes, %d producer calls)", contract.name,
             report.outcome, seconds["total"], report.bytes_materialized, report.producer_calls)
    return loaded


def _identity_of(res: Resolution, report: PretrainedReport) -> Identity | None:
    """The start's identity into the report (key, notes). A deferred one
    (a certain miss loaded canonically while the sources were hashed) is
    waited for here, after the load; one that failed is a note: nothing is
    published, the model serves."""
    report.notes += list(res.notes)
    try:
        identity = res.identity_now()
    except HwrError as exc:
        report.notes.append(f"source identity could not be completed ({type(exc).__name__}: {exc}); "
                            "nothing published")
        log.warning("from_pretrained: %s", report.notes[-1])
        return None
    report.key = identity.key if identity is not None else ""
    return identity


def _checkpoint_mmap(contract: PretrainedContract, skeleton: nn.Module, plan: HostWeightPlan, device: Any,
                     resident_blocks: int, t0: float, seconds: dict[str, float], asked: str) -> LoadedModel:
    """An accepted plan: runtime tensors are read-only views of the
    checkpoint's mapping; DLO streams each block's span (or, with no
    device, every block stays resident on those views). Nothing published,
    no daemon call: the outcome says so (``CHECKPOINT_MMAP``)."""
    from dlo_runtime.backend import OffloadBackend
    from dlo_runtime.options import OffloadOptions
    from dlo_runtime.restore import finalize_shared

    mapping = CheckpointMapping(plan)
    try:
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
        raise
    if device is not None:
        _block_report(skeleton, found[options.resident_blocks:], report)
    report.seconds = {**seconds, "total": round(time.perf_counter() - t0, 6)}
    return LoadedModel(skeleton, report, backend=backend, contract=contract)


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
        _block_report(model, found, report)
    report.seconds = {"total": round(time.perf_counter() - t0, 6)}
    return LoadedModel(model, report, backend=backend)


__all__ = ["HOST_PLANS", "HostWeightPlan", "PretrainedReport", "preflight", "LoadedModel", "ModelFiles",
           "PretrainedContract", "check_loaded", "find_blocks", "from_pretrained", "model_files", "parameters_on_meta", "publish_groups", "resolve_class"]
