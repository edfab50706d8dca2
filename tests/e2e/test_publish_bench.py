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
    assert result["ordered"]["MBps"] > 0 and result["unordered"]["MBps"] > 0
    # Ordered publication hashes while writing: it reads (almost) none of the payload back.
    assert result["ordered"]["daemon_read_bytes"] < result["size_bytes"] // 100
    assert result["ordered"]["daemon_rchar"] < result["size_bytes"] // 100  # not even from the page cache
    assert result["unordered"]["daemon_rchar"] >= result["size_bytes"]  # its read-back, for contrast
    assert "publish ordered" in proc.stdout
