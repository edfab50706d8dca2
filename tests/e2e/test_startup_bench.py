"""bench/startup.py --quick runs end to end (so the script cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.support.paths import REPO_DIR

REPO = REPO_DIR


@pytest.mark.slow
def test_startup_bench_quick(tmp_path):
    out = tmp_path / "startup.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "startup.py"), "--quick", "--out", str(out),
                           "--dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["checkpoint_bytes"] for r in doc["results"]] == [2 << 20, 8 << 20]
    for r in doc["results"]:
        assert r["parity"] and r["producer_calls_warm"] == 0 and r["bytes_materialized"]["warm"] == 0
        assert r["transport"]["cold"] == "ordinary" and r["h2d_bytes_per_forward"]["warm"] > 0
        assert 0.0 <= r["artifact_page_cache_residency"] <= 1.0 and r["fsync_s"] > 0
        assert r["registered_note"]  # no CUDA here: the registered row says why it is missing
        # Cold page cache: as many runs as the hot series, median reported,
        # residency before the runs recorded (and flagged when eviction left
        # > 5%), checkpoint hot again for the phases after it.
        assert len(r["ordinary_cold_runs_s"]) == len(r["ordinary_runs_s"]) >= 1
        assert r["ordinary_cold_s"] in r["ordinary_cold_runs_s"] and r["ordinary_cold_s"] > 0
        assert 0.0 <= r["checkpoint_residency_before_cold"] <= 1.0
        assert (r["ordinary_cold_note"] is None) == (r["checkpoint_residency_before_cold"] <= 0.05)
        assert r["checkpoint_residency_after_rewarm"] > 0.95
        assert r["speedup_warm_vs_ordinary_cold"] == round(r["ordinary_cold_s"] / r["warm_s"], 1)
    assert "warm/ord" in proc.stdout and "ord cold-cache s" in proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "startup.png").stat().st_size > 10_000
