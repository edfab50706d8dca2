"""bench/vllm_omni_store.py --quick runs end to end (so the script cannot rot)
and measures both stores on the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import vllm_omni as vo
from tests.support.paths import REPO_DIR


def test_bench_quick(tmp_path):
    vo.load()  # skips without the wheel
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO_DIR, "bench", "vllm_omni_store.py"), "--quick",
                           "--out", str(out), "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=REPO_DIR))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["quick"] is True and r["tensors"] == 40 and r["bytes"] >= 60 * 2**20
    assert set(r["rows"]) == {"vLLM-Omni filesystem store", "HWR store"}
    assert all(v > 0 for row in r["rows"].values() for v in row.values())
    assert "HWR / filesystem" in proc.stdout
