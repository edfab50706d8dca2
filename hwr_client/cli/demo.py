"""``hwr demo`` (the whole product on one command) and ``hwr prewarm``.

``hwr demo`` starts a daemon on a temporary root (or uses a running one with
``--socket``), writes a reference checkpoint, and runs real worker processes:

1. an ordinary worker (HWR disabled, model resident): the reference output;
2. worker 1, preferred mode: a miss, so CANONICAL_FALLBACK — canonical load,
   DLO forward pass, then ``publish_after_load``;
3. worker 2, preferred mode: LOCAL_HIT — restore from the lease, DLO forward;
4. three warm workers at once (separate processes);
5. with ``--ranks N`` (N > 1): N ranks on this node started like torchrun
   (``--dp N``), AllGather from the lease: each keeps 1/N of every block,
   their PSS is summed, their output must equal the ordinary worker's.

Each row of the table reports startup seconds, the sum of PSS of the row's
processes (read while all of them are alive), the bytes each materialized,
the bytes copied into DLO device buffers, and whether its output equals the
ordinary worker's bit for bit. The demo leaves nothing running and exits
non-zero when any check fails.

``hwr prewarm --contract NAME --checkpoint DIR`` produces and publishes the
final-layout artifact without starting a worker, so ``required`` mode starts
warm on a fresh node; ``hwr prewarm --model DIR`` does the same for a
diffusers / transformers model directory (:mod:`hwr_client.cli.pretrained`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from hwr_client.cli.common import add_json_flag, add_socket_flags, client_from, print_json, print_table
from hwr_client.cli.pretrained import add_model_flags, prewarm_model
from hwr_client.cli.pss import baseline_pss_kib, process_pss
from hwr_client.cli.workers import WorkerProcesses, daemon_for
from hwr_client.core.defaults import human, parse_size
from hwr_client.core.errors import InvalidArgument, NotFound


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``hwr demo`` and ``hwr prewarm`` to the subcommands."""
    demo = sub.add_parser("demo", help="run the end-to-end demo: cold start, publish, warm starts, parity",
                          description=__doc__.split("\n\n")[1])
    demo.add_argument("--size", default="1GiB", help="canonical (fp32) checkpoint size (default 1GiB; e.g. 64MiB)")
    demo.add_argument("--workers", type=int, default=3, help="warm workers started at once (default 3)")
    demo.add_argument("--seed", type=int, default=0, help="checkpoint seed")
    demo.add_argument("--workdir", help="directory for the checkpoint and store (default: a temp dir, removed)")
    demo.add_argument("--device", default="cpu", help="DLO compute device (default cpu)")
    demo.add_argument("--ranks", type=int, default=1,
                      help="also start N ranks (--dp N, torchrun environment) with DLO AllGather from the lease "
                           "(default 1: no such row)")
    add_socket_flags(demo)
    add_json_flag(demo)
    demo.set_defaults(func=run_demo)

    pre = sub.add_parser("prewarm", help="publish a checkpoint's final-layout artifact without starting a worker")
    pre.add_argument("--contract", help="final-layout contract name (e.g. tiny-dit); or --model")
    pre.add_argument("--checkpoint", help="canonical checkpoint directory (with --contract)")
    add_model_flags(pre)
    pre.add_argument("--layout", help="parallel layout, e.g. tp_rank=0,tp_size=2,sp_size=1,sp_backend=none")
    add_socket_flags(pre)
    add_json_flag(pre)
    pre.set_defaults(func=run_prewarm)


# -- prewarm ---------------------------------------------------------------------


def run_prewarm(args: argparse.Namespace) -> int:
    """Publishes the artifact of ``--checkpoint`` under ``--contract``, or
    of a diffusers / transformers ``--model`` directory."""
    if bool(args.model) == bool(args.contract) or bool(args.contract) != bool(args.checkpoint):
        raise InvalidArgument("hwr prewarm: give --contract NAME --checkpoint DIR, or --model DIR")
    result: dict[str, Any]
    if args.model:
        result = prewarm_model(args)
        if args.json:
            print_json(result)
        else:
            print(f"{result['outcome']}: {result['key']} {result['contract']} "
                  f"({human(result['bytes'])}, {result['seconds']} s)")
        return 0
    # The runtime imports torch: only this command pays for it, the parser
    # (and `hwr serve`) stays light.
    from dlo_runtime.contract_registry import get_contract

    contract = get_contract(args.contract)
    with client_from(args) as client:
        identity = contract.identity(args.checkpoint, args.layout, client=client)
        try:
            manifest = client.lookup(identity.key)
            result = {"key": identity.key, "outcome": "already_published", "bytes": manifest.size_bytes, "seconds": 0.0}
        except NotFound:
            t0 = time.perf_counter()
            tensors = contract.produce(args.checkpoint)
            report = client.publish(identity, tensors)
            del tensors
            result = {"key": report.key, "outcome": "already_published" if report.already_published else "committed",
                      "bytes": report.manifest.size_bytes, "bytes_written": report.bytes_written,
                      "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        print_json(result)
    else:
        print(f"{result['outcome']}: {result['key']} ({human(result['bytes'])}, {result['seconds']} s)")
    return 0


# -- demo plumbing -------------------------------------------------------------------


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _row(path: str, results: list[dict[str, Any]], reference: str) -> dict[str, Any]:
    return {
        "path": path,
        "outcome": ",".join(sorted({r["outcome"] for r in results})),
        "startup_s": max(r["startup_s"] for r in results),
        "wall_s": max(r["wall_s"] for r in results),
        "pss_sum_kib": sum(r["pss_kib"] for r in results),
        "pss_artifact_kib": sum(r["pss_artifact_kib"] for r in results),
        "pss_anon_kib": sum(r["pss_anon_kib"] for r in results),
        "bytes_materialized": sum(r["bytes_materialized"] for r in results),
        "bytes_copied_to_device": sum(r["bytes_copied_to_device"] for r in results),
        "producer_calls": sum(r["producer_calls"] for r in results),
        "outputs_equal": all(r.get("output_sha256") == reference for r in results),
        "transport": ",".join(sorted({r["transport"] for r in results})),
        "publish": next((r["publish"] for r in results if r.get("publish")), None),
    }


def spawn_ranks(workers: WorkerProcesses, checkpoint: str, socket: str, n: int, *, device: str) -> list[dict[str, Any]]:
    """Starts ``n`` worker ranks at once the way torchrun would (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on 127.0.0.1, ``--dp n``):
    DLO's group is the DP group, so they AllGather. Returns their results
    with PSS read while all are alive (like :meth:`WorkerProcesses.group`)."""
    import socket as sockets

    with sockets.socket() as s:
        s.bind(("127.0.0.1", 0))  # a free port for the rendezvous, chosen by the OS
        port = s.getsockname()[1]
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, "-m", "dlo_runtime.worker", "--contract", "tiny-dit", "--checkpoint", checkpoint,
               "--mode", "preferred", "--device", device, "--hold", "--forward", "--socket", socket,
               "--dp", str(n), "--collective-timeout-s", "120"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        proc.t0 = time.perf_counter()  # type: ignore[attr-defined]
        workers.procs.append(proc)  # kill_all() covers them
        procs.append(proc)
    results = [workers.result(p) for p in procs]
    for r, p in zip(results, procs):
        r.update(process_pss(p.pid))
    for p in procs:
        workers.release(p)
    return results


def ranks_checks(row: dict[str, Any], results: list[dict[str, Any]], model_bytes: int) -> list[str]:
    """What must hold for the AllGather ranks row; each failure is one line."""
    n = len(results)
    fails = []
    if row["outcome"] != "LOCAL_HIT":
        fails.append(f"{row['path']}: outcome {row['outcome']}, expected LOCAL_HIT")
    if row["transport"] != "allgather" or any(r.get("group_size") != n for r in results):
        fails.append(f"{row['path']}: transport {row['transport']}, expected allgather over {n} ranks")
    shards = sum(r.get("shard_bytes", 0) for r in results)
    if not 0 < shards <= model_bytes:
        fails.append(f"{row['path']}: the ranks' shards total {shards} bytes, expected one copy of the "
                     f"streamed blocks (at most the model's {model_bytes})")
    return fails


def _checks(rows: dict[str, dict[str, Any]], *, own_daemon: bool) -> list[str]:
    """What must hold; each failure is one line."""
    fails = []
    cold, warm, many = rows["cold"], rows["warm"], rows["warm_many"]
    if own_daemon and cold["outcome"] != "CANONICAL_FALLBACK":
        fails.append(f"worker 1: outcome {cold['outcome']}, expected CANONICAL_FALLBACK on an empty store")
    if cold["outcome"] == "CANONICAL_FALLBACK" and not (cold["publish"] or {}).get("ok", True):
        fails.append(f"worker 1: publish_after_load failed: {cold['publish']}")
    for name, row in (("worker 2", warm), ("concurrent workers", many)):
        if row["outcome"] != "LOCAL_HIT":
            fails.append(f"{name}: outcome {row['outcome']}, expected LOCAL_HIT")
        if row["bytes_materialized"] or row["producer_calls"]:
            fails.append(f"{name}: warm start materialized {row['bytes_materialized']} bytes with "
                         f"{row['producer_calls']} producer calls, expected 0 and 0")
    fails += [f"{r['path']}: output differs from the ordinary loader's" for r in rows.values() if not r["outputs_equal"]]
    return fails


def _print(rows: dict[str, dict[str, Any]], baseline_kib: int, size: int) -> None:
    header = ["path", "outcome", "startup s", "sum PSS", "materialized", "copied to device", "outputs equal"]
    table = [[r["path"], r["outcome"], f"{r['startup_s']:.3f}", human(r["pss_sum_kib"] * 1024),
              human(r["bytes_materialized"]), human(r["bytes_copied_to_device"]), "yes" if r["outputs_equal"] else "NO"]
             for r in rows.values()]
    print_table(table, header)
    ordinary, warm, many = rows["ordinary"], rows["warm"], rows["warm_many"]
    print(f"\ncheckpoint {human(size)} fp32 -> runtime model {human(ordinary['bytes_materialized'])} "
          f"(bf16, fp32 norms); an idle worker process alone has {human(baseline_kib * 1024)} of PSS")
    if warm["startup_s"] > 0:
        ratio = ordinary["startup_s"] / warm["startup_s"]
        print(f"warm start {warm['startup_s']:.3f} s vs ordinary {ordinary['startup_s']:.3f} s (imports excluded): "
              + (f"{ratio:.1f}x faster" if ratio >= 1 else
                 "ordinary wins at this tiny size (warm costs O(tensors), ordinary O(bytes))"))
    if rows["cold"].get("publish"):
        print(f"worker 1 published after serving in {rows['cold']['publish'].get('seconds', 0):.2f} s")
    n = many["n"]
    model = ordinary["bytes_materialized"]
    print(f"{n} warm workers at once share ONE copy of the weights: the PSS of their artifact mappings sums to "
          f"{human(many['pss_artifact_kib'] * 1024)}\n(the model is {human(model)}); "
          f"{n} ordinary workers would each hold it privately ({human(n * model)} in all)")
    if "ranks" in rows:
        r = rows["ranks"]
        print(f"{r['n']} AllGather ranks (lease closed after cutting their shards) hold "
              f"{human(r['shard_bytes'])} of private shards together, one copy of the streamed blocks; "
              f"their PSS sums to {human(r['pss_sum_kib'] * 1024)}")


def run_demo(args: argparse.Namespace) -> int:
    """Runs the demo; returns 0 when every check passes, else 1."""
    # torch, as in run_prewarm: imported by the command, not the parser.
    from dlo_runtime.models.tiny_dit import TinyDiTConfig, write_checkpoint

    size = parse_size(args.size)
    if args.ranks < 1:
        raise InvalidArgument(f"hwr demo: --ranks {args.ranks}, expected 1 or more")
    steps = 6 + (args.ranks > 1)
    own_workdir = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="hwr-demo-") if own_workdir else os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    workers = WorkerProcesses()
    try:
        cfg = TinyDiTConfig.for_size(size)
        ckpt = os.path.join(workdir, f"tiny-dit-{args.seed}")
        _say(f"[1/{steps}] writing a {human(size)} reference checkpoint (hidden {cfg.hidden}, {cfg.depth} blocks) to {ckpt}")
        write_checkpoint(ckpt, cfg, seed=args.seed,
                         progress=lambda done, total: _say(f"      {100 * done // total:3d}%  {human(done)} / {human(total)}"))
        with daemon_for(args, workdir) as socket:
            _say(f"[2/{steps}] ordinary worker (HWR disabled, model resident): the reference output")
            ordinary = workers.group(ckpt, "disabled", None, 1, device=args.device, offload=False)
            reference = ordinary[0]["output_sha256"]
            _say(f"[3/{steps}] worker 1, preferred: canonical load, DLO forward, publish after serving")
            cold = workers.group(ckpt, "preferred", socket, 1, device=args.device)
            _say(f"[4/{steps}] worker 2, preferred: warm start from the lease, DLO forward")
            warm = workers.group(ckpt, "preferred", socket, 1, device=args.device)
            _say(f"[5/{steps}] {args.workers} warm workers at once")
            many = workers.group(ckpt, "preferred", socket, args.workers, device=args.device)
            ranks: list[dict[str, Any]] = []
            if args.ranks > 1:
                _say(f"[6/{steps}] {args.ranks} ranks (--dp {args.ranks}), AllGather from the lease")
                ranks = spawn_ranks(workers, ckpt, socket, args.ranks, device=args.device)
        _say(f"[{steps}/{steps}] baseline PSS of an idle worker process")
        baseline = baseline_pss_kib()
    finally:
        workers.kill_all()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = {
        "ordinary": _row("ordinary load (no HWR)", ordinary, reference),
        "cold": _row("worker 1: cold, publishes", cold, reference),
        "warm": _row("worker 2: warm", warm, reference),
        "warm_many": dict(_row(f"workers 3-{2 + args.workers}: warm, at once", many, reference), n=args.workers),
    }
    fails = _checks(rows, own_daemon=not args.socket)
    if ranks:
        rows["ranks"] = dict(_row(f"ranks 1-{args.ranks}: warm, AllGather", ranks, reference), n=args.ranks,
                             shard_bytes=sum(r.get("shard_bytes", 0) for r in ranks))
        fails += ranks_checks(rows["ranks"], ranks, rows["ordinary"]["bytes_materialized"])
        if not rows["ranks"]["outputs_equal"]:
            fails.append(f"{rows['ranks']['path']}: output differs from the ordinary loader's")
    if args.json:
        print_json({"size": size, "baseline_pss_kib": baseline, "rows": rows, "failures": fails,
                    "workers": {"ordinary": ordinary, "cold": cold, "warm": warm, "warm_many": many,
                                **({"ranks": ranks} if ranks else {})}})
    else:
        _print(rows, baseline, size)
        print("\n" + ("ALL CHECKS PASSED" if not fails else "CHECKS FAILED:\n  " + "\n  ".join(fails)))
    return 1 if fails else 0
