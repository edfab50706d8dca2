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

from dlo_runtime.allgather import group_size, is_placeholder
from dlo_runtime.contracts import Contract, check_no_meta, private_bytes
from dlo_runtime.contract_registry import get_contract
from hwr_client.core.errors import InvalidArgument
from hwr_client.resolve import Mode, Outcome, parse_mode

# ``startup_s`` excludes imports on every path (the process imports torch
# and this module before its clock starts). These are the modules a start
# would otherwise import lazily under the clock: the reference model and
# safetensors (canonical loading), the transaction, and the client's
# session and gRPC's stub helpers (warm). Importing them connects to
# nothing: disabled mode still never touches HWR.
import grpc._channel  # noqa: E402,F401 - grpc imports it on the first channel (1.4 ms)
import grpc.experimental  # noqa: E402,F401
import safetensors  # noqa: E402,F401

import dlo_runtime.models.tiny_dit  # noqa: E402,F401
import dlo_runtime.transaction  # noqa: E402,F401
import hwr_client.session  # noqa: E402,F401

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """How a worker starts.

    Attributes:
        contract: registered contract name (``tiny-dit``).
        checkpoint: canonical checkpoint directory.
        mode: ``disabled`` | ``preferred`` | ``required`` (or a Mode).
        socket: daemon runtime socket (None: the client's default).
        layout: parallel layout text (``tp_rank=0,tp_size=1``).
        device: DLO compute device (``cpu`` here; ``cuda`` on a GPU node).
        verify: lease-time verification (``none`` | ``fast`` | ``full``).
        offload: enable the DLO backend (False: the model stays resident).
        registration_limit_gib: registered-bytes ceiling (0 = none); a tiny
            value forces the staging transport on a CUDA node.
        process_group: DLO's weight-sharding group (see
            :func:`dlo_runtime.groups.offload_group`): a group of more than
            one rank selects AllGather; None is rank-local.
        collective_timeout_s: AllGather collective timeout in seconds.
    """

    contract: str
    checkpoint: str
    mode: Mode | str = "preferred"
    socket: str | None = None
    layout: str | None = None
    device: str = "cpu"
    verify: str = "none"
    offload: bool = True
    registration_limit_gib: float = 0.0
    process_group: Any = None
    collective_timeout_s: float = 300.0


@dataclasses.dataclass
class StartupReport:
    """What a start did and cost. Bytes are exact counts, seconds wall time."""

    outcome: str  # an Outcome's value: DISABLED | LOCAL_HIT | CANONICAL_FALLBACK
    key: str = ""
    startup_s: float = 0.0  # resolve → in service (imports excluded)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_materialized: int = 0  # private bytes allocated for weights
    producer_calls: int = 0  # canonical loads / transforms run
    checkpoint_bytes_read: int = 0
    bytes_copied_to_device: int = 0  # filled in by forward passes
    block_copies: int = 0
    device_buffer_bytes: int = 0  # both rotating device buffers together
    staging_bytes: int = 0  # both host staging slots together (0 unless staging)
    transport: str = ""
    group_size: int = 1  # DLO AllGather group size (1: rank-local)
    shard_bytes: int = 0  # AllGather: this rank's private host shards
    trail: list[str] = dataclasses.field(default_factory=list)
    publish: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
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
        self._publish_pending = False
        self.publication: Any = None
        #: AllGather group rank 0 after a miss: the full canonical tensors,
        #: taken before the backend sharded the model, kept only until
        #: :meth:`publish` has sent them (one transient copy on one rank).
        self._publish_source: dict[str, torch.Tensor] | None = None

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

    def publish(self, *, background: bool = False, **kwargs: Any) -> Any:
        """Preferred-mode miss: publish the runtime tensors for the next
        start (never raises). Returns the client's report, or with
        ``background`` the :class:`~dlo_runtime.background.BackgroundPublication`
        at once (``report.publish``: its state, then its report)."""
        if not self._publish_pending or self.client is None:
            return None
        self._publish_pending = False
        source, self._publish_source = self._publish_source, None
        allgather = self.handle is not None and self.handle.stats.group_size > 1
        if source is None and allgather:
            # Placeholders: only the group's rank 0 kept the full tensors (see the transaction).
            self.report.publish = {"ok": False, "skipped": "AllGather rank: only shards are held"}
            return None
        tensors = source if source is not None else self.host_tensors()
        bad = next((n for n, t in tensors.items() if allgather and is_placeholder(t)), None)
        if bad is not None:
            # Never a placeholder into the store: the artifact would serve NaN.
            self.report.publish = {"ok": False, "refused": f"{bad} is an AllGather placeholder, not a weight"}
            log.error("publish refused: %s", self.report.publish["refused"])
            return None
        if background:  # its own connection and references: the worker may close meanwhile
            from dlo_runtime.background import RUNNING, BackgroundPublication

            self.report.publish = {"state": RUNNING, "ok": False, "key": self.identity.key}
            self.publication = BackgroundPublication(self.client.socket, self.identity, tensors, **kwargs,
                                                     on_done=lambda result: setattr(self.report, "publish", result))
            return self.publication
        t0 = time.perf_counter()
        report = self.client.publish_after_load(self.identity, tensors, **kwargs)
        del tensors, source  # rank 0's full copy goes once it is published
        self.report.publish = _as_dict(report)
        self.report.publish["seconds"] = round(time.perf_counter() - t0, 6)
        return report

    def close(self) -> None:
        """Tears down the backend (which closes its lease), then the client
        (a background publication has its own: :mod:`dlo_runtime.background`)."""
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.close()
        client, self.client = self.client, None
        if client is not None:
            client.close()


def _as_dict(report: Any) -> dict[str, Any]:
    if report is None:
        return {}
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
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


def _recipe(opts: WorkerOptions, contract: Contract, phases: _Phases, pending: list[Any], publish: bool) -> Any:
    """The model integration the startup transaction sequences."""
    from dlo_runtime.transaction import ModelRecipe

    def load(skeleton: nn.Module, copts: Any) -> nn.Module:
        phases.mark("skeleton")
        model = contract.canonical_load(skeleton, opts.checkpoint, mmap=copts.checkpoint_mmap)
        check_no_meta(model)
        phases.mark("canonical_load")
        return model

    def defer_publish(model: nn.Module) -> None:
        # The transaction calls this only where publication is allowed (a
        # preferred miss, never the fresh recovery load). The worker serves
        # first and publishes afterwards (Worker.publish). Under AllGather it
        # is called on the group's rank 0 before the backend shards the
        # model: references to the full tensors are kept for Worker.publish
        # (no copy; they are freed once published instead of at sharding).
        if group_size(opts.process_group) > 1:
            pending.append({n: t.detach() for n, t in model.state_dict().items()})
        else:
            pending.append(True)

    return ModelRecipe(
        build_skeleton=lambda: contract.build_skeleton(opts.checkpoint),
        load_canonical=load,
        select_blocks=contract.blocks,
        finalize=contract.finalize,
        publish_after_load=defer_publish if publish else None,
    )


def _start_resident(opts: WorkerOptions, contract: Contract, phases: _Phases) -> Worker:
    """The ordinary worker: canonical load, model resident, no HWR, no DLO."""
    if parse_mode(opts.mode) is not Mode.DISABLED:
        raise InvalidArgument(f"worker without offload: only mode 'disabled' is supported, got {opts.mode!r}")
    model = contract.build_skeleton(opts.checkpoint)
    phases.mark("skeleton")
    contract.canonical_load(model, opts.checkpoint)
    contract.finalize(model)
    check_no_meta(model)
    # Resident on the compute device: forward() moves the inputs there.
    model.to(torch.device(opts.device))
    phases.mark("canonical_load")
    return Worker(opts, contract, model, StartupReport(Outcome.DISABLED.value))


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
    parse_mode(opts.mode)  # an unknown mode fails before anything loads
    contract = get_contract(opts.contract)
    counters0 = dataclasses.replace(contract.counters)
    phases = _Phases()
    worker = _start_resident(opts, contract, phases) if not opts.offload else _start_offloaded(opts, contract, phases)
    report = worker.report
    report.producer_calls = contract.counters.producer_calls - counters0.producer_calls
    report.checkpoint_bytes_read = contract.counters.checkpoint_bytes_read - counters0.checkpoint_bytes_read
    report.bytes_materialized = contract.counters.bytes_materialized - counters0.bytes_materialized
    # In service: what follows is reporting, not part of the start.
    report.startup_s = round(phases.total(), 6)
    if report.outcome == Outcome.LOCAL_HIT.value:
        # Independent proof: every CPU tensor of the model lies in the
        # lease's mapping (device buffers are not model tensors between uses).
        # (An AllGather backend closed its lease after cutting its shards:
        # nothing of the model is in a mapping, and its shards are private.)
        lease = worker.handle.lease
        report.bytes_materialized += private_bytes(worker.model, lease.regions() if lease is not None else ())
    report.transport = _transport(worker.handle)
    if worker.handle is not None:
        stats = worker.handle.stats
        report.device_buffer_bytes, report.staging_bytes = 2 * stats.buffer_bytes, 2 * stats.staging_bytes
        report.group_size, report.shard_bytes = stats.group_size, stats.shard_bytes
        report.bytes_materialized += stats.shard_bytes
    report.phases = {**phases.out, **report.phases}
    log.info("worker started: %s in %.3fs (materialized %d bytes, %d producer calls)",
             report.outcome, report.startup_s, report.bytes_materialized, report.producer_calls)
    return worker


def _start_offloaded(opts: WorkerOptions, contract: Contract, phases: _Phases) -> Worker:
    """Runs the startup transaction (resolve → restore → carrier → backend,
    or canonical load → backend) and wraps its result."""
    from dlo_runtime.options import OffloadOptions
    from dlo_runtime.transaction import StartupTransaction

    mode = parse_mode(opts.mode)
    client = identity = None
    pending: list[Any] = []
    if mode is not Mode.DISABLED:
        # Disabled never gets here with a client: zero HWR interaction.
        import hwr_client

        client = hwr_client.connect(opts.socket)
    try:
        if client is not None:
            identity = contract.identity(opts.checkpoint, opts.layout, client=client)
            phases.mark("identity")
        backend = OffloadOptions(device=opts.device, registration_limit_gib=opts.registration_limit_gib,
                                 process_group=opts.process_group, collective_timeout_s=opts.collective_timeout_s)
        tx = StartupTransaction(mode, _recipe(opts, contract, phases, pending, client is not None),
                                lambda: _resolve(client, identity, mode, opts.verify, phases), backend)
        result = tx.run()
    except BaseException:
        if client is not None:
            client.close()
        raise
    phases.mark("backend")
    report = StartupReport(result.outcome.value, key=identity.key if identity else "",
                           trail=[f"{s.what}: {s.note}" if s.note else s.what for s in result.trail])
    # Seconds from each trail step to the next (where the start spent its time).
    steps = list(result.trail)
    report.phases.update({f"tx.{a.what}": round(b.at - a.at, 6) for a, b in zip(steps, steps[1:])})
    worker = Worker(opts, contract, result.model, report, handle=result.backend, client=client, identity=identity)
    worker._publish_pending = bool(pending)
    worker._publish_source = next((p for p in pending if isinstance(p, dict)), None)
    pending.clear()  # the worker alone holds rank 0's full tensors now
    return worker


def _resolve(client: Any, identity: Any, mode: Mode, verify: str, phases: _Phases) -> Any:
    """The transaction's lookup: the client's Resolution, as resolve made
    it (the transaction decides nothing about a miss a second time)."""
    res = client.resolve(identity, mode=mode, verify=verify)
    phases.mark("resolve")
    return res


# -- process entry point ----------------------------------------------------------


def output_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (bitwise output parity across processes)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw.data).hexdigest()


def pss_kib(pid: int | str = "self") -> int:
    """Proportional set size of a process in KiB (/proc/PID/smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


#: Path fragment of artifact payload files in any HWR store root.
BLOB_DIR_MARK = "/blobs/sha256/"


def pss_breakdown(pid: int | str = "self") -> dict[str, int]:
    """A process's PSS (KiB) split by what backs it (/proc/PID/smaps):
    ``pss_artifact_kib`` (HWR artifact mappings: shared weights),
    ``pss_anon_kib`` (heap and anonymous memory: a privately loaded model,
    DLO buffers on CPU), ``pss_files_kib`` (libraries and other files, shared
    with every Python process on the node)."""
    out = {"pss_artifact_kib": 0, "pss_anon_kib": 0, "pss_files_kib": 0}
    where = "pss_anon_kib"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if not head[0].endswith(":") and "-" in head[0] and len(head) >= 5:
                path = head[5].strip() if len(head) > 5 else ""
                where = ("pss_artifact_kib" if BLOB_DIR_MARK in path
                         else "pss_files_kib" if path.startswith("/") else "pss_anon_kib")
            elif head[0] == "Pss:":
                out[where] += int(head[1])
    return out


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
        worker.publish(progress=_progress_printer(f"worker {os.getpid()}: publishing"))
    result.update(worker.report.to_dict())
    return worker, result


def _progress_printer(what: str) -> Any:
    """A progress callback printing ``what`` at every further 25% to stderr."""
    last = [-1]

    def show(done: int, total: int) -> None:
        step = 100 * done // max(total, 1) // 25 * 25
        if step > last[0]:
            last[0] = step
            print(f"      {what} {step:3d}%  ({done >> 20} / {total >> 20} MiB)", file=sys.stderr, flush=True)

    return show


def main(argv: list[str] | None = None) -> int:
    """``python -m dlo_runtime.worker``: start one worker, print one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m dlo_runtime.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--contract", default="tiny-dit")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.PREFERRED.value)
    parser.add_argument("--socket")
    parser.add_argument("--layout")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-offload", action="store_true", help="keep the model resident (no DLO backend)")
    parser.add_argument("--registration-limit-gib", type=float, default=0.0,
                        help="registered-bytes ceiling; tiny forces staging on CUDA (default 0 = none)")
    parser.add_argument("--forward", action="store_true", help="run one forward pass and print its digest")
    parser.add_argument("--no-publish", action="store_true", help="skip publish_after_load on a preferred miss")
    parser.add_argument("--seed", type=int, default=0, help="input seed of the forward pass")
    parser.add_argument("--hold", action="store_true", help="after printing, wait for stdin to close")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (torchrun: WORLD_SIZE = dp * sp)")
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel size")
    parser.add_argument("--no-allgather", action="store_true", help="rank-local DLO even with dp or sp > 1")
    parser.add_argument("--collective-timeout-s", type=float, default=300.0,
                        help="AllGather collective timeout (and the process group's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # The torchrun environment is read here only: library code takes groups.
    topo = _init_topology(dict(os.environ), args.dp, args.sp, args.device, args.collective_timeout_s,
                          allgather=not args.no_allgather)
    opts = WorkerOptions(args.contract, args.checkpoint, args.mode, args.socket, args.layout, args.device,
                         offload=not args.no_offload, registration_limit_gib=args.registration_limit_gib,
                         process_group=topo.get("group"), collective_timeout_s=args.collective_timeout_s)
    worker, result = run(opts, forward=args.forward, publish=not args.no_publish, seed=args.seed)
    try:
        result["pss_kib"] = pss_kib()
        result.update({k: v for k, v in topo.items() if k != "group"})
        print(json.dumps(result, sort_keys=True), flush=True)
        if args.hold:
            sys.stdin.read()  # the parent closes stdin after reading every worker's PSS
    finally:
        worker.close()
        if topo.get("world_size", 1) > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def _init_topology(env: dict[str, str], dp: int, sp: int, device: str, timeout_s: float, *,
                   allgather: bool = True) -> dict[str, Any]:
    """Initializes torch.distributed from the torchrun environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and the DP and SP
    groups (rank = dp_index * sp + sp_index), then picks DLO's group with
    :func:`dlo_runtime.groups.offload_group`. A single process (no
    WORLD_SIZE, or 1) initializes nothing.

    Raises:
        InvalidArgument: WORLD_SIZE != dp * sp, or a missing variable.
    """
    from dlo_runtime.groups import offload_group

    world = int(env.get("WORLD_SIZE", "1"))
    if world != dp * sp:
        raise InvalidArgument(f"worker: WORLD_SIZE={world} but --dp {dp} --sp {sp} needs {dp * sp} ranks")
    if world == 1:
        return {"rank": 0, "world_size": 1, "dlo_group": "rank-local"}
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise InvalidArgument(f"worker: WORLD_SIZE={world} but {missing} not set (launch with torchrun)")
    import datetime

    import torch.distributed as dist

    rank, local = int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s or 1800))
    dp_i, sp_i = divmod(rank, sp)
    dp_group = sp_group = None
    # Every rank creates every group, in the same order (new_group is collective).
    for s_i in range(sp):
        g = dist.new_group([d * sp + s_i for d in range(dp)])
        dp_group = g if s_i == sp_i else dp_group
    for d_i in range(dp):
        g = dist.new_group([d_i * sp + s for s in range(sp)])
        sp_group = g if d_i == dp_i else sp_group
    choice = offload_group(dp_size=dp, sp_size=sp, dp_group=dp_group, sp_group=sp_group, allgather=allgather)
    return {"rank": rank, "local_rank": local, "world_size": world, "dlo_group": choice.kind,
            "dlo_group_size": choice.size, "group": choice.group}


if __name__ == "__main__":
    sys.exit(main())
