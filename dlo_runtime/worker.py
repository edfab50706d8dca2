"""Worker startup: resolve → warm restore or canonical load → layerwise
offload → serve; what ``hwr demo`` and ``bench/startup.py`` run.

:func:`start_worker` follows DESIGN §8:

- ``disabled``: never touches HWR (no client, no identity, no root): a
  canonical load, exactly what a worker without HWR does.
- ``LOCAL_HIT``: the lease's final-layout views are restored into the meta
  skeleton through the startup transaction (plan → commit → carrier →
  backend), shared finalization is proven byte/pointer-neutral, and the DLO
  backend streams blocks from the lease.
- ``CANONICAL_FALLBACK`` (preferred miss): canonical load, serve, then
  :meth:`Worker.publish` hands the runtime tensors to
  ``client.publish_after_load`` so the next start is warm.
- ``FAILED``: raises (required miss, or a non-retryable failure).

Every start returns a :class:`StartupReport` with the numbers the demo's
table and the benchmark print: startup seconds, bytes this process
materialized, bytes copied into device buffers, producer calls.

Run as a process (one JSON line on stdout; ``--hold`` keeps the process
alive until stdin closes, so a parent can read its PSS next to others')::

    python -m dlo_runtime.worker --contract tiny-dit --checkpoint DIR \\
        --mode preferred --socket /run/hwr/hwr.sock --forward --hold
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from typing import Any

import torch
from torch import nn

from dlo_runtime.contracts import Contract, check_no_meta, get_contract, private_bytes

log = logging.getLogger(__name__)

MODES = ("disabled", "preferred", "required")


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """How a worker starts.

    Attributes:
        contract: registered contract name (``tiny-dit``).
        checkpoint: canonical checkpoint directory.
        mode: ``disabled`` | ``preferred`` | ``required``.
        socket: daemon runtime socket (None: the client's default).
        layout: parallel layout text (``tp_rank=0,tp_size=1``).
        device: DLO compute device (``cpu`` here; ``cuda`` on a GPU node).
        verify: lease-time verification (``none`` | ``fast`` | ``full``).
        offload: enable the DLO backend (False: the model stays resident).
    """

    contract: str
    checkpoint: str
    mode: str = "preferred"
    socket: str | None = None
    layout: str | None = None
    device: str = "cpu"
    verify: str = "none"
    offload: bool = True


@dataclasses.dataclass
class StartupReport:
    """What a start did and cost. Bytes are exact counts, seconds wall time."""

    outcome: str  # DISABLED | LOCAL_HIT | CANONICAL_FALLBACK
    key: str = ""
    startup_s: float = 0.0  # resolve → in service (imports excluded)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_materialized: int = 0  # private bytes allocated for weights
    producer_calls: int = 0  # canonical loads / transforms run
    checkpoint_bytes_read: int = 0
    bytes_copied_to_device: int = 0  # filled in by forward passes
    block_copies: int = 0
    transport: str = ""
    trail: list[str] = dataclasses.field(default_factory=list)
    publish: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Phases:
    """Records named phase durations and the total since construction."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.out: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.out[name] = round(now - self.last, 6)
        self.last = now

    def total(self) -> float:
        return time.perf_counter() - self.t0


class Worker:
    """A started worker: the model (offloaded or resident), its backend
    handle, and, on a warm start, the lease the backend owns."""

    def __init__(self, opts: WorkerOptions, contract: Contract, model: nn.Module, report: StartupReport,
                 *, handle: Any = None, client: Any = None, identity: Any = None):
        self.opts, self.contract, self.model, self.report = opts, contract, model, report
        self.handle, self.client, self.identity = handle, client, identity
        self._lease: Any = None

    @torch.no_grad()
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One forward pass on ``opts.device``; adds the backend's copy
        counts to the report."""
        device = torch.device(self.opts.device)
        before = _copy_stats(self.handle)
        out = self.model(*(x.to(device) for x in inputs))
        after = _copy_stats(self.handle)
        self.report.bytes_copied_to_device += after[0] - before[0]
        self.report.block_copies += after[1] - before[1]
        return out.cpu()

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """The runtime tensors on the host. Between forward passes the
        backend points streamed blocks at their host copies; anything it
        moved to the device (non-block tensors on CUDA) is copied back."""
        return {n: (t.detach() if t.device.type == "cpu" else t.detach().cpu())
                for n, t in self.model.state_dict().items()}

    def publish(self, **kwargs: Any) -> Any:
        """Preferred-mode miss: publish the runtime tensors for the next
        start (never raises; returns the client's report)."""
        if self.report.outcome != "CANONICAL_FALLBACK" or self.client is None:
            return None
        t0 = time.perf_counter()
        report = self.client.publish_after_load(self.identity, self.host_tensors(), **kwargs)
        self.report.publish = _as_dict(report)
        self.report.publish["seconds"] = round(time.perf_counter() - t0, 6)
        return report

    def close(self) -> None:
        """Tears down the backend (which closes its lease), then the client."""
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.close()
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.close()
        client, self.client = self.client, None
        if client is not None:
            client.close()


def _as_dict(report: Any) -> dict[str, Any]:
    if report is None:
        return {}
    if dataclasses.is_dataclass(report):
        return {k: v for k, v in dataclasses.asdict(report).items() if isinstance(v, (str, int, float, bool, type(None)))}
    if isinstance(report, dict):
        return dict(report)
    return {"repr": repr(report)}


def _copy_stats(handle: Any) -> tuple[int, int]:
    """(bytes copied into device buffers, block copies) so far."""
    if handle is None:
        return 0, 0
    blocks = handle.stats.blocks
    return sum(b.h2d_bytes for b in blocks), sum(b.copies for b in blocks)


def _transport(handle: Any) -> str:
    if handle is None:
        return "resident"
    return str(handle.stats.transport)


def _enable_offload(opts: WorkerOptions, contract: Contract, model: nn.Module, source: Any) -> Any:
    if not opts.offload:
        return None
    from dlo_runtime.backend import enable_layerwise_offload

    return enable_layerwise_offload(model, contract.blocks(model), device=opts.device, source=source)


def _canonical(opts: WorkerOptions, contract: Contract, phases: _Phases) -> nn.Module:
    model = contract.build_skeleton(opts.checkpoint)
    phases.mark("skeleton")
    contract.canonical_load(model, opts.checkpoint)
    contract.finalize(model)
    check_no_meta(model)
    phases.mark("canonical_load")
    return model


def start_worker(opts: WorkerOptions) -> Worker:
    """Starts a worker per DESIGN §8; see the module docstring.

    Args:
        opts: contract, checkpoint, mode, socket, device.

    Returns:
        The started worker; call :meth:`Worker.close` when done.

    Raises:
        InvalidArgument: unknown mode or contract.
        HwrError: FAILED outcomes (a required miss says how to populate
            the store: ``hwr prewarm``).
    """
    if opts.mode not in MODES:
        from hwr_client.errors import InvalidArgument

        raise InvalidArgument(f"worker mode {opts.mode!r}: expected one of {MODES}")
    contract = get_contract(opts.contract)
    counters0 = dataclasses.replace(contract.counters)
    phases = _Phases()
    if opts.mode == "disabled":
        # Disabled: zero HWR interaction (no client, no identity, no root).
        model = _canonical(opts, contract, phases)
        report = StartupReport("DISABLED")
        worker = Worker(opts, contract, model, report)
    else:
        worker = _start_with_hwr(opts, contract, phases)
        report = worker.report
    if report.outcome != "LOCAL_HIT":
        report.bytes_materialized = private_bytes(worker.model)
        worker.handle = _enable_offload(opts, contract, worker.model, None)
        phases.mark("backend")
    report.transport = _transport(worker.handle)
    report.producer_calls = contract.counters.producer_calls - counters0.producer_calls
    report.checkpoint_bytes_read = contract.counters.checkpoint_bytes_read - counters0.checkpoint_bytes_read
    report.startup_s = round(phases.total(), 6)
    report.phases = phases.out
    log.info("worker started: %s in %.3fs (materialized %d bytes, %d producer calls)",
             report.outcome, report.startup_s, report.bytes_materialized, report.producer_calls)
    return worker


def _start_with_hwr(opts: WorkerOptions, contract: Contract, phases: _Phases) -> Worker:
    import hwr_client

    client = hwr_client.connect(opts.socket)
    try:
        identity = contract.identity(opts.checkpoint, opts.layout, client=client)
        phases.mark("identity")
        result = client.resolve(identity, mode=opts.mode, verify=opts.verify)
        phases.mark("resolve")
        outcome = _outcome_name(result)
        if outcome == "LOCAL_HIT":
            return _warm_start(opts, contract, client, identity, result, phases)
        if outcome == "CANONICAL_FALLBACK":
            model = _canonical(opts, contract, phases)
            report = StartupReport("CANONICAL_FALLBACK", key=identity.key)
            return Worker(opts, contract, model, report, client=client, identity=identity)
        _raise_failed(result)
    except BaseException:
        client.close()
        raise
    raise AssertionError("unreachable")


def _outcome_name(result: Any) -> str:
    outcome = getattr(result, "outcome", result)
    return str(getattr(outcome, "name", outcome)).rsplit(".", 1)[-1]


def _raise_failed(result: Any) -> None:
    from hwr_client.errors import FailedPrecondition, HwrError

    error = getattr(result, "error", None)
    if isinstance(error, HwrError):
        raise error
    raise FailedPrecondition(f"worker startup FAILED: {getattr(result, 'reason', None) or error or result}")


def _warm_start(opts: WorkerOptions, contract: Contract, client: Any, identity: Any, result: Any,
                phases: _Phases) -> Worker:
    """LOCAL_HIT: restore from the lease and hand it to the backend through
    the startup transaction; the backend owns (and closes) the lease."""
    from hwr_client.carrier import LeaseCarrier

    from dlo_runtime.restore import finalize_shared, plan_restore, commit_restore

    lease = result.lease
    report = StartupReport("LOCAL_HIT", key=identity.key, trail=["LEASE_OWNED_BY_LOADER"])
    model = contract.build_skeleton(opts.checkpoint)
    try:
        plan = plan_restore(model, lease)
        report.trail.append("RESTORE_PLANNED")
    except BaseException:
        lease.close()  # before COMMIT_STARTED the loader still owns the lease
        raise
    report.trail.append("COMMIT_STARTED")
    carrier = LeaseCarrier(lease)
    try:
        commit_restore(model, plan)
        del plan
        finalize_shared(model, contract.finalize)
        report.bytes_materialized = private_bytes(model, lease.regions())
        phases.mark("restore")
        report.trail.append("CARRIER_OWNED")
        handle = _enable_offload(opts, contract, model, carrier.take()) if opts.offload else None
        report.trail += ["BACKEND_OWNED", "BACKEND_READY", "IN_SERVICE"]
    finally:
        carrier.close()  # closes the lease only if the backend never took it
    phases.mark("backend")
    worker = Worker(opts, contract, model, report, handle=handle, client=client, identity=identity)
    if handle is None:
        worker._lease = lease  # resident warm model: keep the mapping's lease alive
    return worker


# -- process entry point ----------------------------------------------------------


def output_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (bitwise output parity across processes)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).hexdigest()


def pss_kib(pid: int | str = "self") -> int:
    """Proportional set size of a process in KiB (/proc/PID/smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def run(opts: WorkerOptions, *, forward: bool, publish: bool, seed: int = 0) -> tuple[Worker, dict[str, Any]]:
    """Starts a worker, optionally runs one forward pass and publishes (a
    preferred miss); returns the worker and a JSON-ready result."""
    from dlo_runtime.models.tiny_dit import TinyDiTConfig, sample_inputs

    worker = start_worker(opts)
    result: dict[str, Any] = {"pid": os.getpid()}
    if forward:
        cfg = getattr(worker.model, "config", None) or TinyDiTConfig.load(opts.checkpoint)
        t0 = time.perf_counter()
        out = worker.forward(*sample_inputs(cfg, seed=seed))
        result["forward_s"] = round(time.perf_counter() - t0, 6)
        result["output_sha256"] = output_digest(out)
    if publish:
        worker.publish()
    result.update(worker.report.to_dict())
    return worker, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlo_runtime.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--contract", default="tiny-dit")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--mode", choices=MODES, default="preferred")
    parser.add_argument("--socket")
    parser.add_argument("--layout")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-offload", action="store_true", help="keep the model resident (no DLO backend)")
    parser.add_argument("--forward", action="store_true", help="run one forward pass and print its digest")
    parser.add_argument("--no-publish", action="store_true", help="skip publish_after_load on a preferred miss")
    parser.add_argument("--seed", type=int, default=0, help="input seed of the forward pass")
    parser.add_argument("--hold", action="store_true", help="after printing, wait for stdin to close")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    opts = WorkerOptions(args.contract, args.checkpoint, args.mode, args.socket, args.layout, args.device,
                         offload=not args.no_offload)
    worker, result = run(opts, forward=args.forward, publish=not args.no_publish, seed=args.seed)
    try:
        result["pss_kib"] = pss_kib()
        print(json.dumps(result, sort_keys=True), flush=True)
        if args.hold:
            sys.stdin.read()  # the parent closes stdin after reading every worker's PSS
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
