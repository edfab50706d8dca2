"""Lease rpc load: concurrent clients acquiring and releasing leases,
versus the same clients calling Lookup (the stateless floor: same socket,
same manifest reply, no lease bookkeeping or persistence).

One invocation, one daemon on a temporary root, one small artifact:

- ``--clients`` concurrent clients (default 64) = ``--procs`` processes
  (default 8, one session each) × threads; each client loops
  AcquireLease → ReleaseLease on its process's session for ``--seconds``
  (default 20) as fast as they can (closed loop). Every rpc is one op;
  latency is per rpc, client-observed.
- the same clients loop Lookup for the same time.
- paced: the same clients acquire+release at a total offered rate of
  ``--rate`` ops/s (default 2000), for latency AT the target load. In a
  closed loop, latency is clients / throughput by Little's law (64 clients
  at 2,000 ops/s wait 32 ms on average whatever the daemon does), so the
  p99 target is only meaningful at a given offered load.

Why processes × threads: each open session occupies one daemon gRPC thread
for its lifetime (``grpc_threads``, default 64), so 64 single-thread
processes would leave no thread for unary calls; real nodes run a handful
of worker processes per node.

The client side measures raw rpcs (the session's AcquireLease/ReleaseLease)
and does not map the files: this measures the daemon.

Targets: ≥ 2,000 ops/s and p99 ≤ 20 ms on a 2-core machine.

    python bench/lease_load.py                 # 64 clients, 20 s
    python bench/lease_load.py --quick         # 3 s per phase (what the test runs)

Prints a table and writes JSON (default bench/results/lease_load.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from bench.common import add_daemon_args, save_result  # noqa: E402
import hwr_client  # noqa: E402
from hwr_client.core._proto import hwr_pb2 as pb  # noqa: E402
from hwr_client.cli.workers import daemon_for  # noqa: E402
from warm_start import synthetic_tensors, bench_identity  # noqa: E402


def _loop(op: str, client: hwr_client.Client, key: str, stop_at: float, lat: list[float], errors: list[str],
          period: float) -> None:
    session = client.session() if op != "lookup" else None
    next_at = time.monotonic() + random.uniform(0.0, period)  # staggered starts
    try:
        while time.monotonic() < stop_at:
            if period:
                # Paced: one iteration per period. A client that fell behind
                # restarts its schedule instead of bursting to catch up.
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                next_at = max(next_at + period, time.monotonic())
            if session is not None:
                t0 = time.perf_counter()
                reply = session.acquire(key)
                t1 = time.perf_counter()
                if not session.release(reply.lease_id):
                    raise RuntimeError(f"lease {reply.lease_id[:8]} not released")
                t2 = time.perf_counter()
                lat.extend((t1 - t0, t2 - t1))
            else:
                t0 = time.perf_counter()
                client.call(client.runtime.Lookup, pb.LookupRequest(key=key))
                lat.append(time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        errors.append(f"{type(exc).__name__}: {exc}")


def child(args: argparse.Namespace) -> None:
    """``--threads`` clients of one process; prints latencies as JSON."""
    client = hwr_client.connect(args.socket)
    if args.child != "lookup":
        client.session().session_id()  # open before the clock starts
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    time.sleep(max(0.0, start_at - time.time()))
    stop_at = time.monotonic() + args.seconds
    lats: list[list[float]] = [[] for _ in range(args.threads)]
    errors: list[str] = []
    # paced: each client runs acquire+release (2 ops) every `period` s.
    period = 2 * args.clients / args.rate if args.child == "paced" else 0.0
    ts = [threading.Thread(target=_loop, args=(args.child, client, args.key, stop_at, lats[i], errors, period))
          for i in range(args.threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    client.close()
    print(json.dumps({"lat": [x for lat in lats for x in lat], "errors": errors}), flush=True)


def phase(args: argparse.Namespace, socket: str, op: str, key: str) -> dict[str, Any]:
    """Runs one phase over all processes; returns ops/s and percentiles."""
    per = max(1, args.clients // args.procs)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", op, "--socket", socket,
                               "--key", key, "--threads", str(per), "--seconds", str(args.seconds),
                               "--clients", str(per * args.procs), "--rate", str(args.rate)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO)) for _ in range(args.procs)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", f"{op} client {p.pid} failed to start"
    start_at = time.time() + 0.5  # everyone starts together
    for p in procs:
        p.stdin.write(f"{start_at}\n")
        p.stdin.flush()
    lat: list[float] = []
    errors: list[str] = []
    for p in procs:
        out = json.loads(p.stdout.readline())
        lat += out["lat"]
        errors += out["errors"]
        p.wait()
    lat.sort()
    q = statistics.quantiles(lat, n=100) if len(lat) >= 100 else [max(lat or [0.0])] * 99
    return {"op": op, "clients": per * args.procs, "procs": args.procs, "seconds": args.seconds, "ops": len(lat),
            "ops_per_s": len(lat) / args.seconds, "p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000,
            "max_ms": (lat[-1] if lat else 0.0) * 1000, "errors": errors[:10]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Starts a daemon (unless --socket), publishes one artifact, runs the three phases; returns the JSON document."""
    workdir = tempfile.mkdtemp(prefix="hwr-bench-lease-", dir=args.dir)
    ns = argparse.Namespace(socket=args.socket, admin_socket=None)
    with daemon_for(ns, workdir) as socket:
        with hwr_client.connect(socket) as client:
            key = client.publish(bench_identity("lease-load"), synthetic_tensors(1 << 20, 40)).key
        rows = [phase(args, socket, op, key) for op in ("lease", "lookup", "paced")]
        with hwr_client.connect(socket) as client:
            left = json.loads(client.call(client.reader.GetStats, pb.GetStatsRequest()).stats_json)
    lease, lookup, paced = rows
    doc = {"benchmark": "lease_load", "quick": args.quick, "rows": rows,
           "lease_vs_lookup_ops": lease["ops_per_s"] / max(1e-9, lookup["ops_per_s"]),
           "leases_left_after": left.get("hwr_leases_active"),
           "targets": {"ops_per_s_ge": 2000, "p99_ms_le": 20}}
    print(f"\nlease rpc load: {lease['clients']} clients ({args.procs} processes), {args.seconds:.0f} s per phase")
    print(f"{'rpc':>22}  {'ops/s':>8}  {'p50 ms':>7}  {'p99 ms':>7}  {'max ms':>7}  errors")
    for r, name in ((lease, "Acquire+Release"), (lookup, "Lookup (floor)"),
                    (paced, f"A+R paced {args.rate:.0f}/s")):
        print(f"{name:>22}  {r['ops_per_s']:>8.0f}  {r['p50_ms']:>7.2f}  {r['p99_ms']:>7.2f}  {r['max_ms']:>7.1f}  "
              f"{len(r['errors'])}")
    print(f"\nlease ops/s = {doc['lease_vs_lookup_ops']:.2f} x Lookup ops/s; leases left after: "
          f"{doc['leases_left_after']}")
    return doc


def main(argv: list[str] | None = None) -> int:
    """Parses the options, runs the benchmark (or one child), prints and saves the numbers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--procs", type=int, default=8, help="client processes (one session each)")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=2000.0,
                   help="offered ops/s of the paced phase, spread over all clients (default 2000)")
    p.add_argument("--quick", action="store_true", help="3 s per phase")
    add_daemon_args(p, "lease_load", where="work directory parent (default: system temp)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--key", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.quick and args.seconds == p.get_default("seconds"):
        args.seconds = 3.0
    doc = run(args)
    save_result(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
