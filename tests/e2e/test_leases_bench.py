"""bench/warm_start.py, bench/node_memory.py and bench/lease_load.py run end
to end in their --quick modes (so the scripts cannot rot). Each starts a real
daemon and several Python processes, so they are marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.support.paths import REPO_DIR

REPO = REPO_DIR


def run_bench(name: str, tmp_path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", f"{name}.py"), "--quick", "--out", str(out),
                           "--dir", str(tmp_path), *extra], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_warm_start_quick(tmp_path):
    doc, text = run_bench("warm_start", tmp_path, "--scaling", "40,400")
    main = doc["main"]
    assert main["tensors"] == 400 and main["bytes"] >= 64 << 20
    for v in ("hwr", "hwr+touch", "load_file", "load_file pread"):
        assert main[f"{v}_s"] > 0
    assert [r["tensors"] for r in doc["scaling"]] == [40, 400]
    assert "speedup" in text


@pytest.mark.slow
def test_node_memory_quick(tmp_path):
    doc, text = run_bench("node_memory", tmp_path, "--workers", "2")
    rows = doc["rows"]
    assert len(rows["hwr"]["pss_bytes"]) == 2
    # Memory relations, not timings: 2 private copies cost clearly more than
    # one shared mapping (generous: per-process overheads dominate at 64 MiB).
    assert doc["private_over_baseline_x_artifact"] > 1.5
    assert doc["hwr_over_baseline_x_artifact"] < doc["private_over_baseline_x_artifact"]
    assert "x artifact" in text


@pytest.mark.slow
def test_lease_load_quick(tmp_path):
    doc, text = run_bench("lease_load", tmp_path, "--clients", "4", "--procs", "2", "--seconds", "1",
                          "--rate", "100")
    assert [r["op"] for r in doc["rows"]] == ["lease", "lookup", "paced"]
    for r in doc["rows"]:
        assert r["ops"] > 0 and not r["errors"] and r["clients"] == 4
    assert doc["leases_left_after"] == 0  # nothing leaked
    assert "ops/s" in text
