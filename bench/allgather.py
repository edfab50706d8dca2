"""DLO AllGather vs rank-local on CPU (gloo on 127.0.0.1): host memory per
rank and summed, per-block time, collective bytes per forward.

One invocation: a daemon on a temporary root, the reference DiT
(:mod:`dlo_runtime.models.tiny_dit`) at ``--size`` (fp32 checkpoint; bf16
at runtime, so the streamed blocks are about half of it) published once by
a cold worker start, then for each row G worker ranks started at the same
time (``torch.multiprocessing`` spawn, gloo):

``allgather G``      warm start from the lease, AllGather over the G ranks:
                     each keeps 1/G of every block, the lease is closed.
``rank-local lease`` warm start from the lease, no group: every rank streams
                     complete blocks out of the shared mapping.
``rank-local ordinary`` canonical load, no HWR, no group: every rank keeps a
                     private copy (what a user has without HWR or AllGather).

Memory is read from ``/proc/<pid>/smaps_rollup`` in every rank after its
forward passes, while all ranks are alive (PSS sums to node memory; Private
= Private_Clean + Private_Dirty). The device is the CPU, so "copy" is a
memcpy and the collective is gloo over loopback TCP: the numbers show the
cost structure, not NCCL/PCIe speed.

Per-block time columns: ``compute`` (inside the block's forward, after its
gather was waited for), ``exposed wait`` (the host blocked on the block's
gather: the collective time NOT hidden behind compute), ``seq check`` (the
host's time in the block-sequence check: issuing its exchange one load
ahead and waiting for the one issued a load earlier), ``gather`` (one blocking all-gather of a block
measured alone: the collective's full cost) and ``copy`` (one memcpy of a
whole block: what the rank-local path moves per block).

    python bench/allgather.py                 # 512 MiB checkpoint, G = 1, 2, 4
    python bench/allgather.py --size 64MiB --ranks 1,2 --passes 2   # quick

Prints a table and writes JSON (default bench/results/allgather.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import socket
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_daemon_args, bench_dir, save_result  # noqa: E402
from hwr_client.cli.workers import daemon_for  # noqa: E402
from hwr_client.core.defaults import human, parse_size  # noqa: E402

MIB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _smaps() -> dict[str, int]:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            head = line.split()
            if head and head[0] in ("Pss:", "Private_Clean:", "Private_Dirty:", "Rss:"):
                out[head[0][:-1]] = int(head[1]) * 1024
    return out


def _rank(rank: int, size: int, port: int, row: dict, doc_path: str) -> None:
    import torch
    import torch.distributed as dist

    from dlo_runtime.allgather import _gather_op
    from dlo_runtime.models.tiny_dit import TinyDiTConfig, sample_inputs
    from dlo_runtime.worker import WorkerOptions, output_digest, start_worker

    torch.set_num_threads(1)  # G ranks share the cores; one thread each
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=600))
    group = dist.group.WORLD if row["mode"] == "allgather" else None
    mode = "disabled" if row["mode"] == "rank-local ordinary" else "required"
    base = _smaps()  # torch, gloo and the worker imported: the process without weights
    t0 = time.perf_counter()
    worker = start_worker(WorkerOptions("tiny-dit", row["checkpoint"], mode, row["socket"], process_group=group))
    startup = time.perf_counter() - t0
    model = worker.model
    cfg = TinyDiTConfig.load(row["checkpoint"])
    compute: list[float] = []
    starts: dict[int, float] = {}
    for j, blk in enumerate(model.blocks):
        # After the backend's pre-hook (its gather was waited for) and before
        # its post-hook (which issues the next load): the block's own compute.
        blk.register_forward_pre_hook(lambda m, a, j=j: starts.__setitem__(j, time.perf_counter()))
        blk.register_forward_hook(lambda m, a, o, j=j: compute.append(time.perf_counter() - starts[j]),
                                  prepend=True)
    handle = worker.handle
    stats0 = handle.stats
    walls, digests = [], []
    dist.barrier()
    for p in range(row["passes"]):
        t0 = time.perf_counter()
        out = worker.forward(*sample_inputs(cfg, seed=0))
        walls.append(time.perf_counter() - t0)
        digests.append(output_digest(out))
    stats = handle.stats
    n_blocks = len(stats.blocks)
    forwards = row["passes"]
    collective_bytes = sum(b.collective_bytes for b in stats.blocks) - sum(b.collective_bytes for b in stats0.blocks)
    h2d = sum(b.h2d_bytes for b in stats.blocks) - sum(b.h2d_bytes for b in stats0.blocks)
    dist.barrier()  # every rank has finished: memory is read with all of them alive
    mem = _smaps()
    dist.barrier()
    # Alone, after the forwards: one blocking gather and one memcpy of the largest block.
    largest = max(b.nbytes for b in stats.blocks)
    gather_s = copy_s = 0.0
    if size > 1 and group is not None:
        unit = size * 64
        padded = (largest + unit - 1) // unit * unit
        buf = torch.empty(padded, dtype=torch.uint8)
        mine = torch.zeros(padded // size, dtype=torch.uint8)
        for _ in range(3):
            t0 = time.perf_counter()
            _gather_op()(buf, mine)
            gather_s = time.perf_counter() - t0
    src, dst = torch.ones(largest, dtype=torch.uint8), torch.empty(largest, dtype=torch.uint8)
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_s = time.perf_counter() - t0
    doc = {
        "rank": rank, "pid": os.getpid(), "outcome": worker.report.outcome, "transport": stats.transport,
        "startup_s": startup, "digests": digests, "blocks": n_blocks,
        "streamed_bytes": sum(b.nbytes for b in stats.blocks), "shard_bytes": stats.shard_bytes,
        "buffer_bytes": stats.buffer_bytes, "largest_block": largest,
        "forward_s": min(walls[1:] or walls), "compute_per_block_s": sum(compute[n_blocks:] or compute) /
        max(1, len(compute[n_blocks:] or compute)),
        "wait_per_block_s": (stats.gather_wait_seconds - stats0.gather_wait_seconds) / max(1, forwards * n_blocks),
        "seq_per_block_s": (stats.sequence_seconds - stats0.sequence_seconds) / max(1, forwards * n_blocks),
        "gather_largest_s": gather_s, "copy_largest_s": copy_s,
        "collective_bytes_per_forward": collective_bytes // forwards, "h2d_bytes_per_forward": h2d // forwards,
        "pss": mem["Pss"], "private": mem["Private_Clean"] + mem["Private_Dirty"], "rss": mem["Rss"],
        # What the start and the forwards added (weights, shards, slots): the
        # process baseline (interpreter, torch, gloo) subtracted.
        "pss_added": mem["Pss"] - base["Pss"],
        "private_added": mem["Private_Clean"] + mem["Private_Dirty"] - base["Private_Clean"] - base["Private_Dirty"],
        # Written private memory only (shards, slots, private model copies):
        # excludes clean file pages a single process maps, which the kernel
        # counts as Private_Clean until a second process maps them.
        "dirty_added": mem["Private_Dirty"] - base["Private_Dirty"],
    }
    worker.close()
    with open(doc_path, "w") as f:
        json.dump(doc, f)
    dist.barrier()
    os._exit(0)


def _row(mode: str, size: int, checkpoint: str, socket_path: str, passes: int, workdir: str) -> dict:
    row = {"mode": mode, "ranks": size, "checkpoint": checkpoint, "socket": socket_path, "passes": passes}
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    paths = [os.path.join(workdir, f"{mode.replace(' ', '_')}.{size}.{r}.json") for r in range(size)]
    procs = [ctx.Process(target=_rank, args=(r, size, port, row, paths[r])) for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 1800
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    ranks = [json.load(open(path)) for path in paths if os.path.exists(path)]
    if len(ranks) != size:
        raise RuntimeError(f"{mode} x{size}: {size - len(ranks)} rank(s) wrote no result (exit codes "
                           f"{[p.exitcode for p in procs]})")
    out = {k: v for k, v in row.items() if k not in ("checkpoint", "socket")}
    out["per_rank"] = ranks
    out["outputs_equal"] = len({d for r in ranks for d in r["digests"]}) == 1
    out["pss_sum"] = sum(r["pss"] for r in ranks)
    out["private_sum"] = sum(r["private"] for r in ranks)
    out["pss_added_sum"] = sum(r["pss_added"] for r in ranks)
    out["private_added_sum"] = sum(r["private_added"] for r in ranks)
    out["dirty_added_sum"] = sum(r["dirty_added"] for r in ranks)
    out["shard_sum"] = sum(r["shard_bytes"] for r in ranks)
    return out


def run(size: int, ranks: list[int], passes: int, workdir: str, socket_path: str | None) -> dict[str, Any]:
    """Runs every row; see the module docstring."""
    from dlo_runtime.models.tiny_dit import TinyDiTConfig, write_checkpoint
    from dlo_runtime.worker import WorkerOptions
    from dlo_runtime.worker import run as run_worker

    ns = argparse.Namespace(socket=socket_path, admin_socket=None)
    cfg = TinyDiTConfig.for_size(size)
    ckpt = os.path.join(workdir, "ckpt")
    print(f"[1/3] checkpoint {human(size)}: hidden {cfg.hidden}, {cfg.depth} blocks", file=sys.stderr, flush=True)
    write_checkpoint(ckpt, cfg, seed=0)
    rows = []
    with daemon_for(ns, workdir) as sock:
        print("[2/3] cold start + publish", file=sys.stderr, flush=True)
        worker, cold = run_worker(WorkerOptions("tiny-dit", ckpt, "preferred", sock), forward=True, publish=True)
        worker.close()
        plan = [("allgather", g) for g in ranks] + [("rank-local lease", g) for g in ranks if g > 1] \
            + [("rank-local ordinary", g) for g in ranks if g > 1]
        for k, (mode, g) in enumerate(plan):
            print(f"[3/3] row {k + 1}/{len(plan)}: {mode} x{g}", file=sys.stderr, flush=True)
            r = _row(mode, g, ckpt, sock, passes, workdir)
            r["equal_to_cold"] = r["per_rank"][0]["digests"][0] == cold["output_sha256"]
            rows.append(r)
    streamed = rows[0]["per_rank"][0]["streamed_bytes"]
    for r in rows:
        r["private_added_sum_over_one_copy"] = round(r["private_added_sum"] / streamed, 3)
        r["pss_added_sum_over_one_copy"] = round(r["pss_added_sum"] / streamed, 3)
        r["dirty_added_sum_over_one_copy"] = round(r["dirty_added_sum"] / streamed, 3)
        r["shard_sum_over_one_copy"] = round(r["shard_sum"] / streamed, 3) if r["shard_sum"] else 0.0
    return {"bench": "allgather", "machine": f"{os.cpu_count()} cores, CPU device, gloo on 127.0.0.1",
            "checkpoint_bytes": size, "config": {"hidden": cfg.hidden, "depth": cfg.depth},
            "streamed_bytes": streamed, "passes": passes, "rows": rows}


def table(doc: dict) -> str:
    """The results as a fixed-width table."""
    head = (f"{'row':<22}{'G':>2} {'PSS/rank':>9} {'PSS sum':>9} {'+PSS sum':>9} {'+Priv/rank':>10} "
            f"{'+Priv sum':>9} {'+Dirty sum':>10} {'/copy':>5} {'shards':>8} {'fwd ms':>7} {'compute':>8} {'wait':>7} {'seq':>6} "
            f"{'gather':>7} {'copy':>6} {'coll/fwd':>9} {'equal':>5}")
    lines = [f"streamed blocks: {human(doc['streamed_bytes'])} ({doc['config']['depth']} blocks, hidden "
             f"{doc['config']['hidden']}); per-block times in ms; memory after {doc['passes']} forward(s); "
             f"+ = added over the process baseline (before the worker started); /copy = +Dirty sum / streamed", head,
             "-" * len(head)]
    for r in doc["rows"]:
        pr = r["per_rank"]
        avg = lambda k: sum(x[k] for x in pr) / len(pr)  # noqa: E731
        gather = f"{avg('gather_largest_s') * 1e3:.2f}" if r["mode"] == "allgather" and r["ranks"] > 1 else "-"
        lines.append(
            f"{r['mode']:<22}{r['ranks']:>2} {human(int(avg('pss'))):>9} {human(r['pss_sum']):>9} "
            f"{human(r['pss_added_sum']):>9} {human(int(avg('private_added'))):>10} {human(r['private_added_sum']):>9} "
            f"{human(r['dirty_added_sum']):>10} {r['dirty_added_sum_over_one_copy']:>5.2f} "
            f"{human(r['shard_sum']):>8} {avg('forward_s') * 1e3:>7.1f} {avg('compute_per_block_s') * 1e3:>8.2f} "
            f"{avg('wait_per_block_s') * 1e3:>7.2f} {avg('seq_per_block_s') * 1e3:>6.2f} "
            f"{gather:>7} {avg('copy_largest_s') * 1e3:>6.2f} "
            f"{human(int(avg('collective_bytes_per_forward'))):>9} {str(r['outputs_equal'] and r['equal_to_cold']):>5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python bench/allgather.py``: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="512MiB", help="fp32 checkpoint size (runtime bf16 is about half)")
    ap.add_argument("--ranks", default="1,2,4", help="group sizes G")
    ap.add_argument("--passes", type=int, default=3, help="forward passes per rank (the first warms up)")
    add_daemon_args(ap, "allgather", where="parent of the temporary workdir")
    ap.add_argument("--render", metavar="JSON", help="print the table of an earlier run and exit")
    args = ap.parse_args(argv)
    if args.render:
        print(table(json.load(open(args.render))))
        return 0
    with bench_dir("allgather", args.dir) as workdir:
        doc = run(parse_size(args.size), [int(g) for g in args.ranks.split(",")], args.passes, workdir, args.socket)
    print(table(doc))
    save_result(doc, args.out, indent=1)
    failed = [f"{r['mode']} x{r['ranks']}" for r in doc["rows"] if not (r["outputs_equal"] and r["equal_to_cold"])]
    if failed:
        print(f"outputs differ: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
