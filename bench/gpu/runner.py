"""The steps of ``bench/gpu/run.sh``: plan, run with per-step time limits,
summarise into ONE JSON and ONE log. ``run.sh`` installs the carried wheels
and sets PYTHONPATH; this file does the rest so the plan and the summary are
testable on CPU (tests/e2e/test_gpu_runner.py).

    python bench/gpu/runner.py OUT_DIR [--dry-run]

OUT_DIR receives exactly two files (a device run returns at most eight):
``gpu.json`` (every step's status and output, the pytest counts and every
skip reason, the numbers, the named checks) and ``gpu.log`` (every step's
stdout/stderr in order, then the summary table). Step outputs are written to
a scratch directory on the repository's filesystem (a disk: the probe's file
rows need one), removed at the end. Exit 1 when any step or check failed, 0
otherwise; ``--dry-run`` imports every module, collects the CUDA tests and
runs nothing CUDA (exit 0 once that worked).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The whole run on one H200 must stay within 5 minutes (a rerun must fit the
#: 15 minutes of device time, machine start included): step limits sum to this.
BUDGET_S = 285
#: The world_size=1 NCCL smoke test of the gather engine (finding 10).
NCCL_TEST = "test_gather_engine_over_nccl_with_one_rank"

#: Modules the real run imports; the dry run imports them all (no CUDA call).
IMPORTS = ("torch", "grpc", "google.protobuf", "grpc_health.v1", "pytest", "hwr_client.client",
           "hwr_client.core._proto.hwr_pb2_grpc", "hwr_server", "dlo_runtime", "dlo_runtime.cuda_host",
           "dlo_runtime.transports", "dlo_runtime.backend", "dlo_runtime.pinned", "bench.dlo_gpu", "bench.startup",
           "bench.gpu.probe", "bench.compile_start")


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of the plan, its time limit and the JSON it writes."""

    name: str
    argv: tuple[str, ...]
    timeout_s: int
    json_out: str | None = None


def cuda_test_files() -> list[str]:
    """The test modules holding ``cuda``-marked tests: pytest collects only
    these (a module the image cannot import elsewhere must not fail the run)."""
    out = []
    for dirpath, _, files in os.walk(os.path.join(REPO, "tests")):
        for name in sorted(files):
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    if "mark.cuda" in f.read():
                        out.append(os.path.relpath(path, REPO))
    return sorted(out)


def plan(scratch: str, python: str = sys.executable) -> list[Step]:
    """The steps, in order, with limits that sum to at most :data:`BUDGET_S`."""
    j = lambda name: os.path.join(scratch, name)  # noqa: E731
    steps = [
        Step("probe", (python, "bench/gpu/probe.py", "--gib", "1", "--disk-dir", scratch, "--out", j("probe.json")),
             40, j("probe.json")),
        Step("pytest_cuda", (python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rs",
                             "--junitxml", j("junit.xml"), *cuda_test_files()), 90),
        Step("dlo_gpu", (python, "bench/dlo_gpu.py", "--quick", "--out", j("dlo_gpu.json")), 60, j("dlo_gpu.json")),
        # bench/startup.py's CUDA rows: the ordinary worker resident on the
        # GPU (finding 3), warm (staging) and warm (registered).
        Step("startup_cuda", (python, "bench/startup.py", "--device", "cuda", "--sizes", "256MiB", "--workers", "2",
                              "--repeat", "1", "--out", j("startup.json")), 45, j("startup.json")),
        # bench/compile_start.py on the GPU (cold, from HWR, local cache
        # warm): the causal LM only, the image has no diffusers. A step past
        # its limit is killed and reported; the others still count.
        Step("compile_cuda", (python, "bench/compile_start.py", "--device", "cuda", "--models", "llm", "--repeat", "1",
                              "--out", j("compile_start.json")), 50, j("compile_start.json")),
    ]
    assert sum(s.timeout_s for s in steps) <= BUDGET_S
    return steps


def dry_run(out_dir: str, python: str) -> int:
    """Prints the plan, imports every module the run needs and collects the
    CUDA tests; nothing touches a GPU and nothing is written."""
    steps = plan("<scratch>", python)
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
                              *cuda_test_files()], cwd=REPO, capture_output=True, text=True, timeout=120)
    ids = [line for line in collect.stdout.splitlines() if "::" in line]
    print(f"cuda tests collected: {len(ids)}")
    for line in ids:
        print(f"  {line}")
    if failed or collect.returncode != 0 or not ids or not any(NCCL_TEST in i for i in ids):
        print(collect.stdout[-2000:] + collect.stderr[-2000:])
        return 1
    print("dry run ok: nothing CUDA was run")
    return 0


def _run_step(step: Step, log) -> dict:
    log.write(f"\n===== {step.name}: {' '.join(step.argv)}\n")
    log.flush()
    t0 = time.monotonic()
    # Its own process group: a step that runs out of time is killed with
    # every process it started (daemons, workers), which would otherwise
    # hold the GPU and the disk through the steps after it.
    proc = subprocess.Popen(step.argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc: int | str = proc.wait(timeout=step.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()  # reap it before the next step starts
        rc = f"timeout after {step.timeout_s} s"
    log.flush()
    return {"name": step.name, "rc": rc, "ok": rc == 0, "seconds": round(time.monotonic() - t0, 1),
            "argv": list(step.argv)}


def junit(path: str) -> dict:
    """Counts, every skip with its reason, and every failure (name and the
    first lines of its message) from pytest's junit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    out: dict = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    out["skips"], out["failed"], out["passed"] = [], [], []
    for case in suite.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        skip = case.find("skipped")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if skip is not None:
            out["skips"].append({"test": name, "reason": skip.get("message", "")})
        elif bad is not None:
            out["failed"].append({"test": name, "message": (bad.get("message") or "")[:800]})
        else:
            out["passed"].append(name)
    return out


def _load(path: str | None) -> dict | None:
    try:
        with open(path or "") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def summarise(scratch: str, steps: list[dict]) -> dict:
    """The one document: step status, every step's output, numbers, checks."""
    doc: dict = {"steps": steps, "checks": {}, "numbers": {}}
    checks, n = doc["checks"], doc["numbers"]
    for s in steps:
        checks[f"step {s['name']}"] = s["ok"]
    tests = doc["pytest_cuda"] = junit(os.path.join(scratch, "junit.xml"))
    if tests:
        n["pytest_cuda"] = {k: tests[k] for k in ("tests", "failures", "errors", "skipped")}
        checks["cuda tests ran (not all skipped)"] = tests["tests"] > tests["skipped"]
        checks["cuda tests passed"] = tests["failures"] == 0 and tests["errors"] == 0
        checks["NCCL world_size=1 gather engine"] = any(NCCL_TEST in p for p in tests["passed"])
    probe = doc["probe"] = _load(os.path.join(scratch, "probe.json"))
    if probe:
        n["device"] = probe["device"]
        n["versions"] = probe["versions"]
        n["probe_decision"] = probe["decision"]
        n["registration"] = {f"{r['mapping']}/{r['flag']}/{r['state']}": _probe_cell(r) for r in probe["rows"]}
        checks["probe decision agrees with the code's rule"] = bool(probe["agrees"])
    d = doc["dlo_gpu"] = _load(os.path.join(scratch, "dlo_gpu.json"))
    if d:
        n["h2d_gbps"] = d.get("h2d_gbps")
        n["overlap_over_max"] = {k: o["over_max_compute_copy"] for k, o in (d.get("offload") or {}).items()}
        n["hook_memcpy_over_compute"] = d.get("hook_memcpy_over_compute")
        n["offload_over_resident"] = {k: o["over_resident"] for k, o in (d.get("offload") or {}).items()}
        for k, v in (d.get("checks") or {}).items():
            checks[f"dlo_gpu {k}"] = bool(v)
    st = doc["startup"] = _load(os.path.join(scratch, "startup.json"))
    if st:
        try:
            n["startup_s"] = {str(r.get("checkpoint_bytes")): {k: r.get(k) for k in ("ordinary_s", "warm_s",
                                                                                      "registered_s")}
                              for r in st["results"]}
            checks["startup parity"] = all(r.get("parity") for r in st["results"])
        except (KeyError, TypeError):
            checks["startup results readable"] = False
    cs = doc["compile_start"] = _load(os.path.join(scratch, "compile_start.json"))
    if cs:
        try:
            n["compile_first_output_s"] = {res["model"]: {row: r["to_first_output_s"] for row, r in res["rows"].items()}
                                           for res in cs["results"]}
            for k, v in cs["checks"].items():
                checks[f"compile {k}"] = bool(v)
        except (KeyError, TypeError):
            checks["compile results readable"] = False
    doc["ok"] = all(checks.values())
    return doc


def _probe_cell(r: dict) -> dict:
    keys = ("code", "error", "register_s_per_gib", "h2d_gbps", "dirty_delta_over_registered", "writeback_s",
            "resident_before")
    return {k: r[k] for k in keys if k in r}


def table(doc: dict) -> str:
    """The stdout summary."""
    lines = [f"{'step':14}{'rc':>24}{'s':>8}"]
    lines += [f"{s['name']:14}{str(s['rc']):>24}{s['seconds']:>8}" for s in doc["steps"]]
    lines.append("")
    for k, v in doc["numbers"].items():
        lines.append(f"{k:28} {json.dumps(v)}")
    for skip in (doc.get("pytest_cuda") or {}).get("skips", []):
        lines.append(f"SKIPPED {skip['test']}: {skip['reason']}")
    for bad in (doc.get("pytest_cuda") or {}).get("failed", []):
        lines.append(f"FAILED  {bad['test']}: {bad['message'][:200]}")
    lines.append("")
    lines += [f"{'ok' if v else 'FAILED':7} {k}" for k, v in doc["checks"].items()]
    lines.append(f"overall: {'ok' if doc['ok'] else 'FAILED'}")
    return "\n".join(lines)


def run(out_dir: str, python: str) -> int:
    """Every step, then gpu.json and the table (also at the end of gpu.log)."""
    os.makedirs(out_dir, exist_ok=True)
    # On the repository's filesystem (a disk), not in OUT: OUT returns 2 files.
    scratch = tempfile.mkdtemp(prefix=".gpu-scratch-", dir=REPO)
    t0 = time.monotonic()
    try:
        with open(os.path.join(out_dir, "gpu.log"), "w") as log:
            steps = []
            for step in plan(scratch, python):
                print(f"== {step.name} (<= {step.timeout_s} s)", flush=True)
                steps.append(_run_step(step, log))
                print(f"   rc {steps[-1]['rc']} in {steps[-1]['seconds']} s", flush=True)
            doc = summarise(scratch, steps)
            doc["seconds"] = round(time.monotonic() - t0, 1)
            text = table(doc)
            log.write("\n===== summary\n" + text + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    with open(os.path.join(out_dir, "gpu.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(text)
    return 0 if doc["ok"] else 1


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
    return run(args.out_dir, args.python)


if __name__ == "__main__":
    sys.exit(main())
