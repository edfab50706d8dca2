"""bench/compile_start.py --quick --models llm end to end: four fresh worker
processes, one of them a cold inductor compile (about 1-2 minutes on 2
shared cores), so it runs only with HWR_BENCH_TESTS=1; run it after
touching the bench or the compile switch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO_DIR

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("HWR_BENCH_TESTS"), reason="set HWR_BENCH_TESTS=1 (about 2 min)")]


def test_compile_start_bench_quick(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "compile_start.json"
    env = dict(os.environ, PYTHONPATH=REPO_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(REPO_DIR, "bench", "compile_start.py"), "--quick", "--models", "llm",
           "--repeat", "1", "--out", str(out), "--dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (res,) = doc["results"]
    rows = res["rows"]
    assert rows["(a) cold"]["compile"]["status"] == "miss" and rows["(a) cold"]["compile"]["publish"] == "published"
    assert rows["(b) HWR"]["compile"]["status"] == "hit" and rows["(c) local warm"]["compile"] is None
    assert all(r["equals_cold"] for r in rows.values()) and all(doc["checks"].values())
    assert "(b)/(c) =" in proc.stdout
