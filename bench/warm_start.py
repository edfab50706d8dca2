"""Warm start: resolve → every tensor usable, versus loading the same bytes
with safetensors (a private copy, what most loaders do).

One invocation, one daemon on a temporary root, one artifact per size:

- ``hwr``: a fresh process connects, ``resolve(identity, mode="required")``,
  and builds every tensor view (``lease.tensors()``): the tensors are usable.
  ``hwr+touch`` additionally reads one byte of every page (the cost a first
  forward pass pays in minor page faults, since the bytes are shared page
  cache, not copied);
- ``load_file``: ``safetensors.torch.load_file(blob)`` for every payload file
  of the SAME artifact (the blobs are safetensors files), default backend;
- ``load_file pread``: the same with ``backend="pread"`` (this safetensors
  version, 0.8, supports it);
- ``hwr verify=fast`` / ``verify=full``: resolve with lease-time
  verification (xxh3-128 of every file and block / SHA-256 of every file
  and tensor), timed on its own in the same process: artifact bytes / that
  time is the verification throughput (GB/s).

All bytes are in the page cache for every variant (the artifact was just
written): this compares the best case of the private copy with HWR.
Each variant runs in ``--repeat`` fresh processes; the median is reported.
Import time is excluded for all variants alike.

Scaling: the same measurement at a smaller size with 40 / 400 / 4000
tensors, to show the cost is ~constant + O(tensors).

Targets: hwr ≤ 50 ms + O(tensors) and ≥ 20× faster than the private copy.

    python bench/warm_start.py                 # 4 GiB / 400 tensors; scaling at 1 GiB
    python bench/warm_start.py --quick         # 64 MiB; scaling at 16 MiB (what the test runs)
    python bench/warm_start.py --size 1GiB     # smaller main artifact

Prints a table and writes JSON (default bench/results/warm_start.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import add_daemon_args, save_result  # noqa: E402
import torch  # noqa: E402

import hwr_client  # noqa: E402
from hwr_client.cli.workers import daemon_for  # noqa: E402
from hwr_client.core.defaults import human, parse_size  # noqa: E402

VARIANTS = ("hwr", "hwr+touch", "load_file", "load_file pread", "hwr verify=fast", "hwr verify=full")


def bench_identity(tag: str) -> dict[str, Any]:
    """A synthetic identity; ``tag`` makes each artifact distinct."""
    return {
        "contract": {"name": "bench-warm-start", "version": 1},
        "sources": [{"name": "synthetic", "content_id": "sha256:" + "00" * 32}],
        "representation": {"dtype": "bfloat16"},
        "layout": {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
        "producer": {"id": "bench", "version": "1"},
        "extra": {"tag": tag},
    }


def synthetic_tensors(size: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` bf16 tensors totalling about ``size`` bytes, as ``count - 2``
    block tensors (4 per block) plus an embedding and a final norm."""
    per = max(2, size // count // 2 * 2)  # bytes per tensor, even
    out: dict[str, torch.Tensor] = {}
    fill = torch.arange(per // 2, dtype=torch.int16)
    for i in range(count):
        name = "embed.weight" if i == 0 else ("final_norm.weight" if i == count - 1 else f"blocks.{(i - 1) // 4}.w{i}")
        t = torch.empty(per // 2, dtype=torch.bfloat16)
        t.view(torch.int16).copy_(fill).add_(i)  # distinct bytes per tensor; no RNG cost
        out[name] = t
    return out


def publish_synthetic(client: hwr_client.Client, size: int, count: int, tag: str) -> tuple[str, list[str]]:
    """Publishes a synthetic artifact; returns (key, blob paths)."""
    tensors = synthetic_tensors(size, count)
    report = client.publish(bench_identity(tag), tensors)
    del tensors
    with client.acquire(report.key) as lease:
        return report.key, list(lease.paths)


# -- child process: one measurement -------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """Runs one variant after imports; prints {"seconds": ..., ...}."""
    from safetensors.torch import load_file

    # Imported before the clock starts: connect() must not pay for the
    # client's import (grpc) inside the timed start.
    import hwr_client.client  # noqa: F401
    from hwr_client.resolve import resolve

    paths = args.paths.split(",") if args.paths else []
    extra: dict[str, float] = {}
    t0 = time.perf_counter()
    if args.child.startswith("hwr"):
        client = hwr_client.connect(args.socket)
        res = resolve(client, bench_identity(args.tag), mode="required")
        if res.outcome != "LOCAL_HIT":
            raise SystemExit(f"expected LOCAL_HIT, got {res.outcome}: {res.reason}")
        views = res.lease.tensors()
        n = len(views)
        if "verify=" in args.child:  # what resolve(verify=...) adds, timed on its own
            t1 = time.perf_counter()
            report = res.lease.verify(args.child.split("verify=")[1])
            extra["verify_s"] = time.perf_counter() - t1
            assert report.ok, report.problems
        if args.child == "hwr+touch":
            for i in range(len(res.lease.manifest.files)):
                res.lease.file_bytes(i)[::4096].sum()  # one byte of every page
    else:
        backend = "pread" if args.child.endswith("pread") else "mmap"
        views = {}
        for p in paths:
            views.update(load_file(p, backend=backend))
        n = len(views)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "tensors": n, **extra}), flush=True)


def measure(args: argparse.Namespace, socket: str, variant: str, tag: str, paths: list[str]) -> dict[str, float]:
    """Median figures of ``variant`` over ``args.repeat`` fresh processes."""
    runs = []
    for _ in range(args.repeat):
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", variant, "--socket", socket, "--tag", tag,
             "--paths", ",".join(paths)],
            capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=REPO),
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "tensors"}


def run_case(args: argparse.Namespace, client: hwr_client.Client, socket: str, size: int, count: int,
             variants: tuple[str, ...]) -> dict[str, Any]:
    """Publishes one synthetic artifact and times every start variant on it; returns its row."""
    tag = f"{size}-{count}"
    key, paths = publish_synthetic(client, size, count, tag)
    row: dict[str, Any] = {"bytes": sum(os.path.getsize(p) for p in paths), "tensors": count, "files": len(paths),
                           "key": key}
    for v in variants:
        figures = measure(args, socket, v, tag, paths)
        row[f"{v}_s"] = figures["seconds"]
        if "verify_s" in figures:  # lease-time verification throughput over the whole artifact
            row[f"{v.split('=')[1]}_verify_GBps"] = row["bytes"] / max(1e-9, figures["verify_s"]) / 1e9
    for v in variants:
        if v.startswith("load_file"):
            row[f"speedup_vs_{v.replace(' ', '_')}"] = row[f"{v}_s"] / row["hwr_s"]
    client.call(client.admin.DeleteArtifact, hwr_client.core._proto.hwr_pb2.DeleteArtifactRequest(key=key))
    return row


def print_rows(title: str, rows: list[dict[str, Any]], variants: tuple[str, ...]) -> None:
    """Prints one table of rows: milliseconds per variant and the speedups over load_file."""
    print(f"\n{title}")
    variants = tuple(v for v in variants if "verify=" not in v)  # printed as GB/s below
    speedups = [v for v in variants if v.startswith("load_file")]
    head = ["size", "tensors"] + [f"{v} ms" for v in variants] + [f"hwr vs {v}" for v in speedups]
    print("  ".join(f"{h:>18}" for h in head))
    for r in rows:
        cells = [human(r["bytes"]), str(r["tensors"])] + [f"{r[f'{v}_s'] * 1000:.1f}" for v in variants]
        cells += [f"{r['speedup_vs_' + v.replace(' ', '_')]:.1f}x" for v in speedups]
        print("  ".join(f"{c:>18}" for c in cells))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Starts a daemon (unless --socket), runs the main case and the scaling cases; returns the JSON document."""
    size, small = parse_size(args.size), parse_size(args.scaling_size)
    workdir = tempfile.mkdtemp(prefix="hwr-bench-warm-", dir=args.dir)
    ns = argparse.Namespace(socket=args.socket, admin_socket=None)
    with daemon_for(ns, workdir) as socket:
        with hwr_client.connect(socket, admin_socket=ns.admin_socket) as client:
            main_row = run_case(args, client, socket, size, args.tensors, VARIANTS)
            scaling = [run_case(args, client, socket, small, n, ("hwr", "load_file pread"))
                       for n in args.scaling]
    per_tensor_ms = ((scaling[-1]["hwr_s"] - scaling[0]["hwr_s"]) * 1000
                     / max(1, scaling[-1]["tensors"] - scaling[0]["tensors"]))
    doc = {
        "benchmark": "warm_start", "quick": args.quick, "repeat": args.repeat, "main": main_row,
        "scaling": scaling, "hwr_ms_per_tensor": per_tensor_ms,
        "hwr_fixed_ms_estimate": scaling[0]["hwr_s"] * 1000 - per_tensor_ms * scaling[0]["tensors"],
        "targets": {"hwr_ms_le": 50.0, "speedup_ge": 20.0},
        "safetensors_pread_backend": True,
    }
    print_rows("warm start: resolve -> all tensors usable (median of fresh processes)", [main_row], VARIANTS)
    print_rows("scaling with tensor count", scaling, ("hwr", "load_file pread"))
    print(f"\nlease-time verification: fast {main_row['fast_verify_GBps']:.1f} GB/s, "
          f"full {main_row['full_verify_GBps']:.2f} GB/s")
    print(f"hwr: ~{doc['hwr_fixed_ms_estimate']:.1f} ms fixed + {per_tensor_ms * 1000:.1f} us/tensor; "
          f"speedup vs load_file: {main_row['speedup_vs_load_file']:.0f}x, "
          f"vs load_file pread: {main_row['speedup_vs_load_file_pread']:.0f}x")
    return doc


def main(argv: list[str] | None = None) -> int:
    """Parses the options, runs the benchmark (or one child), prints and saves the numbers."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="4GiB", help="main artifact size (default 4GiB)")
    p.add_argument("--tensors", type=int, default=400, help="tensors in the main artifact (default 400)")
    p.add_argument("--scaling-size", default="1GiB", help="artifact size for the tensor-count scaling")
    p.add_argument("--scaling", default="40,400,4000", help="tensor counts for scaling")
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per variant (median)")
    p.add_argument("--quick", action="store_true", help="64 MiB, scaling at 16 MiB, 1 repeat")
    add_daemon_args(p, "warm_start", where="work directory parent (default: system temp)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    p.add_argument("--paths", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.quick:
        args.size, args.scaling_size, args.repeat = "64MiB", "16MiB", 1
    args.scaling = [int(x) for x in str(args.scaling).split(",")]
    doc = run(args)
    save_result(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
