"""bench/publish.py --quick runs end to end (so the script cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from tests.support.paths import REPO_DIR

REPO = REPO_DIR


def test_bench_publish_quick(tmp_path):
    out = tmp_path / "publish.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "publish.py"), "--quick", "--out", str(out), "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["blocks"] == 40 and result["size_bytes"] >= 128 * 1024 * 1024
    runs = result["runs"]
    assert set(runs) == {"handoff ordered", "handoff unordered", "messages ordered", "messages unordered"}
    assert all(r["MBps"] > 0 and r["daemon_cpu_s_per_GB"] > 0 and r["client_cpu_s_per_GB"] > 0 for r in runs.values())
    assert runs["handoff ordered"]["transport"] == "handoff" and runs["messages ordered"]["transport"] == "messages"
    # The daemon reads no payload back through read(2): it hashes the sealed
    # files through mappings (the unordered message transport reads its files back).
    assert runs["handoff ordered"]["daemon_rchar"] < result["size_bytes"] // 100
    assert runs["handoff unordered"]["daemon_rchar"] < result["size_bytes"] // 100
    assert runs["messages unordered"]["daemon_rchar"] >= result["size_bytes"]
    # One SHA-256 pass per byte and no message copies: far below the message transport's daemon CPU.
    assert runs["handoff ordered"]["daemon_cpu_s_per_GB"] < runs["messages ordered"]["daemon_cpu_s_per_GB"]
    assert result["limit_MBps"] == min(result["raw_write_fsync"]["MBps"], result["sha256_cores"]["MBps"])
    assert "publish handoff ordered" in proc.stdout and "targets" in proc.stdout
