"""bench/real_models.py --quick end to end. It starts ten worker processes
that each import torch and diffusers (~50 s on 2 cores), so it runs only
with HWR_BENCH_TESTS=1 (the CI budget); run it after touching the bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.support.paths import REPO_DIR

REPO = REPO_DIR

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("HWR_BENCH_TESTS"), reason="set HWR_BENCH_TESTS=1 (about 50 s)")]


def test_real_models_bench_quick(tmp_path):
    pytest.importorskip("diffusers")
    out = tmp_path / "real_models.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "real_models.py"), "--quick", "--out", str(out),
                           "--workdir", str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (res,) = json.loads(out.read_text())["results"]
    rows = res["rows"]
    assert rows["hwr cold"]["outcome"] == "CANONICAL_FALLBACK" and rows["hwr warm"]["outcome"] == "LOCAL_HIT"
    assert rows["hwr warm"]["bytes_materialized"] == 0 and rows["hwr warm"]["producer_calls"] == 0
    assert all(r["outputs_equal"] for r in rows.values()) and res["outputs4_equal"]
    assert res["warm4_outcomes"] == ["LOCAL_HIT"] and res["concurrent"] == 2
    assert "warm vs library (hot)" in proc.stdout
    # Cold rows: the publication ran after the start returned, completed, and was reported apart.
    (cold,) = json.loads(out.read_text())["cold"]
    assert cold["publish_state"] == "published" and cold["publish_s"] > 0
    assert cold["published_after_s"] >= rows["hwr cold"]["startup_s"]
    assert cold["next_start"] == "LOCAL_HIT" and cold["next_start_equal"]
    assert "cold first output s" in proc.stdout
