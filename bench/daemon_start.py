"""How fast `hwr serve` becomes SERVING and how much memory it holds idle.

Starts the daemon N times on a fresh empty root (a temp dir) and measures:
- start: from spawning the process to the health service answering SERVING
  (the moment a worker can use it; systemd's READY=1 comes at the same point);
- idle RSS and PSS (``/proc/PID/smaps_rollup``) two seconds after SERVING;
- whether ``torch`` is among the daemon's mapped files (it must not be).

``--tree DIR`` runs the daemon from another checkout (PYTHONPATH=DIR), so one
run compares two revisions on the same machine, e.g. a worktree of the
commit before the torch-free core::

    python bench/daemon_start.py --runs 10 --tree ../before --label before
    python bench/daemon_start.py --runs 10 --label after

Prints a table and writes ``bench/results/daemon_start-<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parent.parent


def _serving(sock: str) -> bool:
    try:
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.2)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _memory(pid: int) -> tuple[int, int, bool]:
    rss = pss = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    with open(f"/proc/{pid}/maps") as f:
        torch_mapped = any("/torch/" in line for line in f)
    return rss, pss, torch_mapped


def one_start(tree: pathlib.Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="hwr-start-") as tmp:
        sock, admin = os.path.join(tmp, "hwr.sock"), os.path.join(tmp, "admin.sock")
        env = dict(os.environ, PYTHONPATH=str(tree))
        cmd = [sys.executable, "-m", "hwr_client.cli", "serve", "--root", os.path.join(tmp, "root"),
               "--socket", sock, "--admin-socket", admin]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not (os.path.exists(sock) and _serving(sock)):
                if proc.poll() is not None:
                    raise RuntimeError(f"hwr serve exited {proc.returncode} before SERVING")
                if time.perf_counter() - t0 > 60:
                    raise RuntimeError("hwr serve not SERVING after 60 s")
                time.sleep(0.005)
            start_s = time.perf_counter() - t0
            time.sleep(2.0)  # let start-up threads settle before reading memory
            rss, pss, torch_mapped = _memory(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
    return {"start_s": start_s, "rss_bytes": rss, "pss_bytes": pss, "torch_mapped": torch_mapped}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tree", default=str(REPO), help="checkout to run the daemon from (default: this one)")
    ap.add_argument("--label", default="current")
    args = ap.parse_args()
    tree = pathlib.Path(args.tree).resolve()
    runs = [one_start(tree) for _ in range(args.runs)]
    starts = [r["start_s"] for r in runs]
    out = {
        "label": args.label,
        "runs": runs,
        "start_s_median": statistics.median(starts),
        "start_s_min": min(starts),
        "rss_mib_median": statistics.median(r["rss_bytes"] for r in runs) / 2**20,
        "pss_mib_median": statistics.median(r["pss_bytes"] for r in runs) / 2**20,
        "torch_mapped": any(r["torch_mapped"] for r in runs),
    }
    print(f"{'label':<10} {'runs':>4} {'start median s':>15} {'start min s':>12} {'idle RSS MiB':>13} "
          f"{'idle PSS MiB':>13} {'torch mapped':>13}")
    print(f"{args.label:<10} {args.runs:>4} {out['start_s_median']:>15.3f} {out['start_s_min']:>12.3f} "
          f"{out['rss_mib_median']:>13.1f} {out['pss_mib_median']:>13.1f} {str(out['torch_mapped']):>13}")
    results = REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"daemon_start-{args.label}.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
