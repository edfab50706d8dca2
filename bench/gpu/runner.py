"""The steps of ``bench/gpu/run.sh``: plan, run with per-step time limits,
summarise. ``run.sh`` picks the interpreter; this file does the rest so the
plan and the summary are testable on CPU (tests/e2e/test_gpu_runner.py).

    python bench/gpu/runner.py OUT_DIR [--dry-run]

Each step's stdout/stderr go to ``OUT_DIR/<step>.log``; ``OUT_DIR/summary.json``
holds every step's status and every named check. Exit 1 when any step or
check failed, 0 otherwise (and always 0 for ``--dry-run`` once the imports
and the collection succeeded).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Whole run on one H200 must stay under 6 minutes: the step limits sum to 5.5.
BUDGET_S = 330

#: Modules the real run imports; the dry run imports them all (no CUDA call).
IMPORTS = ("torch", "grpc", "google.protobuf", "grpc_health.v1", "pytest", "hwr_client.client",
           "hwr_client.core._proto.hwr_pb2_grpc", "hwr_server",
           "dlo_runtime", "dlo_runtime.cuda_host", "dlo_runtime.transports", "dlo_runtime.backend",
           "bench.dlo_gpu", "bench.startup")


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of the plan, its time limit and the JSON it writes."""

    name: str
    argv: tuple[str, ...]
    timeout_s: int
    json_out: str | None = None


def plan(out_dir: str, python: str = sys.executable) -> list[Step]:
    """The steps, in order, with limits that sum to :data:`BUDGET_S`."""
    out = os.path.abspath(out_dir)
    steps = [
        Step("pytest_cuda", (python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rs",
                             "--junitxml", os.path.join(out, "pytest_cuda.xml"), "tests"), 90),
        Step("dlo_gpu", (python, "bench/dlo_gpu.py", "--quick", "--reg-gib", "4", "--disk-dir", out,
                         "--out", os.path.join(out, "dlo_gpu.json")), 140, os.path.join(out, "dlo_gpu.json")),
        # bench/startup.py's CUDA rows: --device cuda adds "warm (registered)"
        # and forces the staging row through a tiny registration limit.
        Step("startup_cuda", (python, "bench/startup.py", "--device", "cuda", "--sizes", "256MiB,1GiB",
                              "--workers", "2", "--repeat", "1", "--out", os.path.join(out, "startup_cuda.json")),
             100, os.path.join(out, "startup_cuda.json")),
    ]
    assert sum(s.timeout_s for s in steps) <= BUDGET_S
    return steps


def dry_run(out_dir: str, python: str) -> int:
    """Prints the plan, imports every module the run needs and collects the
    CUDA tests; nothing touches a GPU."""
    steps = plan(out_dir, python)
    print(f"plan ({sum(s.timeout_s for s in steps)} s of step limits, budget {BUDGET_S} s), output in {out_dir}:")
    for s in steps:
        print(f"  {s.name:13} <= {s.timeout_s:3d} s  {' '.join(s.argv)}")
    failed = []
    for name in IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # report every missing piece, not just the first
            failed.append(f"{name}: {exc!r}")
    for f in failed:
        print(f"import FAILED {f}")
    collect = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", "cuda",
                              "tests"], cwd=REPO, capture_output=True, text=True, timeout=120)
    n = sum(1 for line in collect.stdout.splitlines() if "::" in line)
    print(f"cuda tests collected: {n}")
    if failed or collect.returncode != 0 or n == 0:
        print(collect.stdout[-2000:] + collect.stderr[-2000:])
        return 1
    print("dry run ok: nothing CUDA was run")
    return 0


def _run_step(step: Step, out_dir: str) -> dict:
    log_path = os.path.join(out_dir, f"{step.name}.log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(step.argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=step.timeout_s)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {step.timeout_s} s"
    return {"name": step.name, "rc": rc, "ok": rc == 0, "seconds": round(time.monotonic() - t0, 1),
            "log": log_path, "argv": list(step.argv)}


def _junit_counts(path: str) -> dict:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def summarise(out_dir: str, steps: list[dict]) -> dict:
    """The summary document: step status, the numbers that matter, checks."""
    doc: dict = {"steps": steps, "checks": {}, "numbers": {}}
    for s in steps:
        doc["checks"][f"step {s['name']}"] = s["ok"]
    counts = _junit_counts(os.path.join(out_dir, "pytest_cuda.xml"))
    doc["numbers"]["pytest_cuda"] = counts
    if counts:
        doc["checks"]["cuda tests ran (not all skipped)"] = counts["tests"] > counts["skipped"]
    try:
        with open(os.path.join(out_dir, "dlo_gpu.json")) as f:
            d = json.load(f)
    except (OSError, ValueError):
        d = None
    if d:
        n = doc["numbers"]
        n["h2d_gbps"] = d.get("h2d_gbps")
        disk = d.get("registration_disk") or {}
        for mode in ("cold", "prefaulted"):
            row = disk.get(mode) or {}
            n[f"registration_{mode}_s_per_gib"] = (row.get("prefault_s_per_gib", 0) + row["register_s_per_gib"]
                                                    if "register_s_per_gib" in row else None)
            n[f"dirty_after_unregister_{mode}_mib"] = row.get("dirty_delta_mib")
        n["overlap_over_max"] = {k: o["over_max_compute_copy"] for k, o in (d.get("offload") or {}).items()}
        n["hook_memcpy_over_compute"] = d.get("hook_memcpy_over_compute")
        for k, v in (d.get("checks") or {}).items():
            doc["checks"][f"dlo_gpu {k}"] = bool(v)
    try:
        with open(os.path.join(out_dir, "startup_cuda.json")) as f:
            st = json.load(f)
        doc["numbers"]["startup_registered_s"] = {str(r.get("checkpoint_bytes")): r.get("registered_s") for r in st["results"]}
        doc["checks"]["startup parity"] = all(r.get("parity") for r in st["results"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    doc["ok"] = all(doc["checks"].values())
    return doc


def table(doc: dict) -> str:
    """The stdout summary."""
    lines = [f"{'step':14}{'rc':>24}{'s':>8}"]
    lines += [f"{s['name']:14}{str(s['rc']):>24}{s['seconds']:>8}" for s in doc["steps"]]
    lines.append("")
    for k, v in doc["numbers"].items():
        lines.append(f"{k:40} {json.dumps(v)}")
    lines.append("")
    lines += [f"{'ok' if v else 'FAILED':7} {k}" for k, v in doc["checks"].items()]
    lines.append(f"overall: {'ok' if doc['ok'] else 'FAILED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of run.sh."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the steps")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    sys.path.insert(0, REPO)
    if args.dry_run:
        return dry_run(args.out_dir, args.python)
    os.makedirs(args.out_dir, exist_ok=True)
    steps = []
    for step in plan(args.out_dir, args.python):
        print(f"== {step.name} (<= {step.timeout_s} s)", flush=True)
        steps.append(_run_step(step, args.out_dir))
        print(f"   rc {steps[-1]['rc']} in {steps[-1]['seconds']} s; log {steps[-1]['log']}", flush=True)
    doc = summarise(args.out_dir, steps)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(table(doc))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
