"""Node memory: N worker processes on one artifact, every page touched —
sum of PSS with HWR leases versus N private loads of the same bytes.

One invocation, one daemon on a temporary root:

- ``baseline``: N processes that import the same modules and load nothing
  (their own interpreter, torch and gRPC memory);
- ``hwr``: N processes that each acquire a lease and read one byte of every
  page of every tensor (all mapped pages resident and shared);
- ``private``: N processes that each ``safetensors.torch.load_file`` every
  blob of the same artifact with ``backend="pread"``: a private copy per
  process, what most loaders end up with (they copy into their parameters);
- ``load_file mmap``: the same with safetensors' default backend, which in
  this version (0.8) maps the file MAP_PRIVATE (copy-on-write): read-only
  use shares the page cache like HWR, but a write through a tensor silently
  copies the page instead of faulting — shown for completeness.

PSS (proportional set size, ``/proc/<pid>/smaps_rollup``) charges a shared
page 1/k to each of its k mappers, so the sum over processes is the node's
real cost. All N processes are alive while PSS is read.

Targets: sum PSS(hwr) − sum PSS(baseline) ≤ 1.1 × artifact; private ≈ N ×.

    python bench/node_memory.py                # 4 workers, 2 GiB
    python bench/node_memory.py --quick        # 4 workers, 64 MiB (what the test runs)

Prints a table and writes JSON (default bench/results/node_memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from bench.common import add_daemon_args, save_result  # noqa: E402
import hwr_client  # noqa: E402
# Every child imports the client stack (grpc included), so the baseline
# subtracts its memory from the hwr rows.
import hwr_client.client  # noqa: E402,F401
from hwr_client.cli.pss import pss_kib  # noqa: E402
from hwr_client.cli.workers import daemon_for  # noqa: E402
from hwr_client.core.defaults import human, parse_size  # noqa: E402
from warm_start import bench_identity, publish_synthetic  # noqa: E402

MODES = ("baseline", "hwr", "private", "load_file mmap")


def child(args: argparse.Namespace) -> None:
    """Loads in one of MODES, touches every page, reports, waits for stdin."""
    import torch
    from safetensors.torch import load_file

    held: Any = None
    touched = 0
    if args.child == "hwr":
        client = hwr_client.connect(args.socket)
        res = client.resolve(bench_identity(args.tag), mode="required")
        held = res.lease
        for i in range(len(held.manifest.files)):
            touched += int(held.file_bytes(i)[::4096].numel())  # counts pages
            held.file_bytes(i)[::4096].sum()  # reads one byte of every page
    elif args.child in ("private", "load_file mmap"):
        backend = "pread" if args.child == "private" else "mmap"
        held = {}
        for p in args.paths.split(","):
            held.update(load_file(p, backend=backend))
        for t in held.values():
            flat = t.view(-1).view(torch.uint8)
            flat[::4096].sum()  # one byte of every page (a no-op cost for pread's resident copy)
            touched += flat[::4096].numel()
    print(json.dumps({"pid": os.getpid(), "pages": touched}), flush=True)
    sys.stdin.readline()  # hold everything until the parent has read PSS


def measure(args: argparse.Namespace, socket: str, mode: str, tag: str, paths: list[str]) -> dict[str, Any]:
    """Starts N children in ``mode``; returns per-process and summed PSS."""
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", mode, "--socket", socket,
                               "--tag", tag, "--paths", ",".join(paths)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO))
             for _ in range(args.workers)]
    try:
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"{mode} worker {p.pid} exited with {p.wait()}")
        pss = [pss_kib(p.pid) * 1024 for p in procs]  # every worker alive now
    finally:
        for p in procs:
            try:
                p.stdin.close()
            except OSError:
                pass
            p.wait(timeout=60)
    return {"pss_bytes": pss, "sum_pss_bytes": sum(pss)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Starts a daemon (unless --socket), publishes the artifact, measures
    every mode; prints the table and returns the JSON document."""
    size = parse_size(args.size)
    workdir = tempfile.mkdtemp(prefix="hwr-bench-mem-", dir=args.dir)
    ns = argparse.Namespace(socket=args.socket, admin_socket=None)
    with daemon_for(ns, workdir) as socket:
        with hwr_client.connect(socket, admin_socket=ns.admin_socket) as client:
            tag = f"mem-{size}"
            key, paths = publish_synthetic(client, size, args.tensors, tag)
            artifact = sum(os.path.getsize(p) for p in paths)
            rows = {mode: measure(args, socket, mode, tag, paths) for mode in MODES}
    base = rows["baseline"]["sum_pss_bytes"]
    hwr_extra = rows["hwr"]["sum_pss_bytes"] - base
    private_extra = rows["private"]["sum_pss_bytes"] - base
    cow_extra = rows["load_file mmap"]["sum_pss_bytes"] - base
    doc = {
        "benchmark": "node_memory", "quick": args.quick, "workers": args.workers, "artifact_bytes": artifact,
        "tensors": args.tensors, "key": key, "rows": rows,
        "hwr_over_baseline_x_artifact": hwr_extra / artifact,
        "private_over_baseline_x_artifact": private_extra / artifact,
        "private_over_hwr": private_extra / max(1, hwr_extra),
        "load_file_mmap_over_baseline_x_artifact": cow_extra / artifact,
        "targets": {"hwr_x_artifact_le": 1.1},
    }
    print(f"\nnode memory: {args.workers} workers, artifact {human(artifact)}, every page touched")
    print(f"{'mode':>14}  {'sum PSS':>12}  {'above baseline':>15}  {'x artifact':>10}")
    for mode in MODES:
        total = rows[mode]["sum_pss_bytes"]
        extra = total - base
        print(f"{mode:>14}  {human(total):>12}  {human(extra) if mode != 'baseline' else '-':>15}  "
              f"{(extra / artifact) if mode != 'baseline' else 0:>10.2f}")
    print(f"\nhwr: {doc['hwr_over_baseline_x_artifact']:.2f} x artifact (target <= 1.1); private: "
          f"{doc['private_over_baseline_x_artifact']:.2f} x; private/hwr = {doc['private_over_hwr']:.1f}")
    return doc


def main(argv: list[str] | None = None) -> int:
    """Parses the options, runs the benchmark (or one child), prints and saves the numbers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="2GiB", help="artifact size (default 2GiB)")
    p.add_argument("--tensors", type=int, default=400)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="64 MiB artifact")
    add_daemon_args(p, "node_memory", where="work directory parent (default: system temp)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    p.add_argument("--paths", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.quick:
        args.size = "64MiB"
    doc = run(args)
    save_result(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
