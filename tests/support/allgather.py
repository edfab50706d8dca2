"""The AllGather test harness: a launcher that runs named scenarios in G
spawned ranks (gloo on 127.0.0.1, or NCCL), the scenarios themselves and the
module fixture with checkpoints and a daemon, shared by the CPU and the CUDA
AllGather tests (moved from tests/runtime/test_allgather.py).

One launch per group size runs every scenario of that size in the same G
processes (spawning torch processes is the expensive part on 2 cores); each
rank writes one JSON result per scenario, the parent compares them with the
single-process resident model. Every launch has its own deadline and kills
its children. A test module can register more scenarios in
:data:`SCENARIOS` and name itself in the launch's ``imports`` so the ranks
import it too.
"""

from __future__ import annotations

import datetime
import gc
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
import types

import pytest
import torch

from dlo_runtime.contract_registry import get_contract
from dlo_runtime.models.tiny_dit import TinyDiTConfig, sample_inputs, write_checkpoint
from dlo_runtime.worker import BLOB_DIR_MARK, WorkerOptions, output_digest, run, start_worker
from tests.support.daemon import cleanup, make_daemon
from tests.support.paths import REPO_DIR

REPO = REPO_DIR
SMALL = TinyDiTConfig()  # 4 blocks of ~100 KiB
#: The memory relation needs streamed bytes well above allocator noise and
#: the two slots: 16 blocks of ~2.3 MiB.
MEDIUM = TinyDiTConfig(hidden=256, depth=16, heads=4, image=8)
LAUNCH_DEADLINE_S = 150.0
STALL_TIMEOUT_S = 3.0
KILL_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(size: int, scenarios: list[str], env: dict, outdir: str, deadline_s: float = LAUNCH_DEADLINE_S) -> dict:
    """Runs ``scenarios`` on ``size`` spawned ranks; returns
    {scenario: [per-rank result or None]} and the exit codes."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, size, port, scenarios, env, outdir), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    try:
        for p in procs:
            p.join(max(0.1, end - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():  # past the deadline: a hang; never leave it running
                p.kill()
                p.join(10)
    out: dict = {"exitcodes": [p.exitcode for p in procs]}
    for name in scenarios:
        rows = []
        for r in range(size):
            path = os.path.join(outdir, f"{name}.{r}.json")
            rows.append(json.load(open(path)) if os.path.exists(path) else None)
        out[name] = rows
    return out


def rank_main(rank: int, size: int, port: int, scenarios: list[str], env: dict, outdir: str) -> None:
    import importlib

    import torch.distributed as dist

    for module in env.get("imports", ()):  # modules that register more scenarios
        importlib.import_module(module)
    torch.set_num_threads(1)
    backend = env.get("backend", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.group.WORLD
    for name in scenarios:
        t0 = time.monotonic()
        try:
            doc = {"ok": True, **SCENARIOS[name](rank, size, pg, env)}
        except BaseException as exc:  # reported to the parent, which decides
            doc = {"ok": False, "type": type(exc).__name__, "error": str(exc), "tb": traceback.format_exc()[-3000:]}
        doc["seconds"] = time.monotonic() - t0
        with open(os.path.join(outdir, f"{name}.{rank}.json"), "w") as f:
            json.dump(doc, f)
        if not doc["ok"] and name not in EXPECTED_TO_BREAK:
            break  # the group may be unusable: stop here, the parent reports it
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: a broken group can block in it


def offload(model, pg, **kw):
    from dlo_runtime import enable_layerwise_offload

    return enable_layerwise_offload(model, list(model.blocks), device="cpu", process_group=pg, **kw)


def canonical_model(ckpt: str):
    contract = get_contract("tiny-dit")
    model = contract.build_skeleton(ckpt)
    contract.canonical_load(model, ckpt)
    contract.finalize(model)
    return model


@torch.no_grad()
def forward_digests(model, cfg, passes: int = 2) -> list[str]:
    return [output_digest(model(*sample_inputs(cfg, seed=p))) for p in range(passes)]


def private_dirty_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    return 0


def blob_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if BLOB_DIR_MARK in line)


def sc_tinydit_ordinary(rank, size, pg, env):
    model = canonical_model(env["small"])
    handle = offload(model, pg, resident_blocks=env["resident"])
    try:
        digests = forward_digests(model, SMALL)
        stats = handle.stats
        return {"digests": digests, "transport": stats.transport, "group_size": stats.group_size,
                "shard_bytes": stats.shard_bytes, "blocks": [b.nbytes for b in stats.blocks],
                "collective": [b.collective_bytes for b in stats.blocks], "h2d": [b.h2d_bytes for b in stats.blocks],
                "copies": [b.copies for b in stats.blocks], "buffer_bytes": stats.buffer_bytes,
                "exchanges": handle._sequence.exchanges, "blocking": handle._sequence.blocking,
                "loads": handle._sequence.loads,
                "placeholder_nan": bool(torch.isnan(model.blocks[-1].attn.qkv.weight.float()).all())}
    finally:
        handle.close()


def sc_toy_uneven(rank, size, pg, env):
    from tests.support.dlo import reference

    model = reference(5)
    handle = offload(model, pg)
    try:
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            outs = [output_digest(model(x)) for _ in range(3)]
        return {"digests": outs, "blocks": [b.nbytes for b in handle.stats.blocks],
                "shard_bytes": handle.stats.shard_bytes}
    finally:
        handle.close()


def sc_lease(rank, size, pg, env):
    """Warm start through the startup transaction (required mode, the real
    daemon's lease), AllGather over the group; memory from smaps_rollup."""
    gc.collect()
    opts = WorkerOptions("tiny-dit", env["medium"], "required", env["socket"], process_group=pg)
    import dlo_runtime.backend as backend

    marks = [("start", private_dirty_kib())]
    setup = backend.OffloadBackend._setup_allgather

    def traced(self):
        marks.append(("setup", private_dirty_kib()))
        setup(self)
        gc.collect()
        marks.append(("ready", private_dirty_kib()))

    backend.OffloadBackend._setup_allgather = traced
    worker = start_worker(opts)
    try:
        out = worker.forward(*sample_inputs(MEDIUM, seed=0))
        gc.collect()
        marks.append(("forward", private_dirty_kib()))
        stats = worker.handle.stats
        return {"digest": output_digest(out), "outcome": worker.report.outcome, "trail": worker.handle.trail,
                "tx": worker.report.trail, "lease_open": worker.handle.lease is not None,
                "blob_mappings": blob_mappings(),
                "shard_bytes": stats.shard_bytes, "streamed": sum(b.nbytes for b in stats.blocks),
                "buffer_bytes": stats.buffer_bytes, "transport": stats.transport, "key": worker.report.key,
                "marks": marks}
    finally:
        worker.close()


def sc_cold(rank, size, pg, env):
    """A preferred miss on every rank under AllGather: canonical load, shards
    from the ordinary tensors; the group's rank 0 publishes the full tensors
    it kept from before sharding, the others skip; then a second start of
    the group is a LOCAL_HIT on every rank."""
    import torch.distributed as dist

    from hwr_client.resolve import Outcome

    opts = WorkerOptions("tiny-dit", env["small"], "preferred", env["socket"], process_group=pg)
    worker = start_worker(opts)
    try:
        out = worker.forward(*sample_inputs(SMALL, seed=0))
        kept = worker._publish_source is not None
        # In the background, as a serving rank 0 does: the full tensors it
        # kept are read by the publication's thread and freed when it ends.
        pub = worker.publish(background=True)
        published = pub.wait_published(120) if pub is not None else None
        if published is not None:
            published = types.SimpleNamespace(ok=published["ok"], already_published=published["already_published"],
                                              bytes_written=published["bytes_written"])
        # The guard behind publication: the served model's host tensors are
        # placeholders on an AllGather rank and are refused, never published.
        worker._publish_pending, worker._publish_source = True, worker.host_tensors()
        refused = worker.publish() is None and "placeholder" in worker.report.publish.get("refused", "")
        cold = {"outcome": worker.report.outcome, "tx": worker.report.trail, "digest": output_digest(out),
                "kept": kept, "publish": publish_doc(published), "refused": refused,
                "transport": worker.handle.stats.transport}
    finally:
        worker.close()
    dist.barrier(group=pg)  # rank 0's publication has committed before anyone starts again
    worker = start_worker(opts)
    try:
        out = worker.forward(*sample_inputs(SMALL, seed=0))
        warm = {"outcome": worker.report.outcome, "digest": output_digest(out), "key": worker.report.key,
                "transport": worker.handle.stats.transport,
                "pending": worker._publish_pending or worker._publish_source is not None}
        hit = worker.client.resolve(worker.identity, mode="preferred").outcome is Outcome.LOCAL_HIT
    finally:
        worker.close()
    return {"cold": cold, "warm": warm, "hit": hit}


def publish_doc(report):
    if report is None:
        return None
    return {"ok": report.ok, "already": report.already_published, "bytes": report.bytes_written}


def sc_divergent(rank, size, pg, env):
    """The last rank skips block 1: every rank must fail with the sequence error."""
    model = canonical_model(env["small"])
    handle = offload(model, pg)
    if rank == size - 1:
        model.blocks = torch.nn.ModuleList(b for i, b in enumerate(model.blocks) if i != 1)
    try:
        forward_digests(model, SMALL, passes=1)
    finally:
        handle.close()
    return {}


def sc_consistent_skip(rank, size, pg, env):
    """Every rank skips block 1 (a consistent out-of-order call, e.g. the
    same skipped layer on every rank of a wave): the ranks revise the
    announced sequence together and the output equals the resident model
    with the same block skipped."""
    reference = canonical_model(env["small"])
    reference.blocks = torch.nn.ModuleList(b for i, b in enumerate(reference.blocks) if i != 1)
    model = canonical_model(env["small"])
    handle = offload(model, pg)
    model.blocks = torch.nn.ModuleList(b for i, b in enumerate(model.blocks) if i != 1)
    try:
        got = forward_digests(model, SMALL)
        return {"digests": got, "want": forward_digests(reference, SMALL),
                "revisions": handle._sequence.revisions}
    finally:
        handle.close()


def hook_block(model, index, fn):
    model.blocks[index].register_forward_pre_hook(lambda m, a: fn())


def sc_stall(rank, size, pg, env):
    """The last rank stalls (then exits) mid-forward: the others fail within the timeout."""
    model = canonical_model(env["small"])
    handle = offload(model, pg, collective_timeout_s=STALL_TIMEOUT_S)
    if rank == size - 1:
        hook_block(model, 2, lambda: (time.sleep(STALL_TIMEOUT_S + 4), os._exit(0)))
    t0 = time.monotonic()
    try:
        forward_digests(model, SMALL, passes=1)
    except Exception as exc:
        raise type(exc)(f"{exc} [after {time.monotonic() - t0:.2f}s]") from exc
    finally:
        handle.close()
    return {}


def sc_sigkill(rank, size, pg, env):
    """The last rank is SIGKILLed mid-forward: the others fail within the timeout."""
    model = canonical_model(env["small"])
    handle = offload(model, pg, collective_timeout_s=KILL_TIMEOUT_S)
    if rank == size - 1:
        hook_block(model, 2, lambda: os.kill(os.getpid(), signal.SIGKILL))
    t0 = time.monotonic()
    try:
        forward_digests(model, SMALL, passes=1)
    except Exception as exc:
        raise type(exc)(f"{exc} [after {time.monotonic() - t0:.2f}s]") from exc
    finally:
        handle.close()
    return {}


SCENARIOS = {"tinydit_ordinary": sc_tinydit_ordinary, "toy_uneven": sc_toy_uneven, "lease": sc_lease, "cold": sc_cold,
             "consistent_skip": sc_consistent_skip, "divergent": sc_divergent, "stall": sc_stall, "sigkill": sc_sigkill}
EXPECTED_TO_BREAK = {"divergent"}  # fails on every rank but leaves the group consistent


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Checkpoints, the resident reference digests, a real daemon holding
    the MEDIUM model's artifact (published by a cold worker start)."""
    base = tmp_path_factory.mktemp("allgather")
    small, medium = str(base / "small"), str(base / "medium")
    write_checkpoint(small, SMALL, seed=3)
    write_checkpoint(medium, MEDIUM, seed=4)
    d = make_daemon(base).start()
    try:
        resident_small = forward_digests(canonical_model(small), SMALL)
        resident_medium = forward_digests(canonical_model(medium), MEDIUM, passes=1)[0]
        worker, result = run(WorkerOptions("tiny-dit", medium, "preferred", d.socket), forward=False, publish=True)
        worker.close()
        assert result["publish"] and result["publish"].get("ok", True), result["publish"]
        from tests.support.dlo import reference

        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            toy = output_digest(reference(5)(x))
        yield {"small": small, "medium": medium, "socket": d.socket, "resident_small": resident_small,
               "resident_medium": resident_medium, "toy": toy, "base": base}
    finally:
        cleanup(d)


def assert_ok(rows, name):
    for r, row in enumerate(rows):
        assert row is not None, f"{name}: rank {r} wrote no result (hung or died)"
        assert row["ok"], f"{name}: rank {r} failed: {row.get('tb', row)}"
