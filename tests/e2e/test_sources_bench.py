"""bench/sources.py --quick runs end to end (so the script cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from tests.support.paths import REPO_DIR

REPO = REPO_DIR


def test_bench_sources_quick(tmp_path):
    out = tmp_path / "sources.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "sources.py"), "--quick", "--files", "2", "--out", str(out),
         "--dir", str(tmp_path), "--fadvise-only"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["files"] == 2 and result["file_bytes"] == 32 * 1024 * 1024
    assert result["cold_resolve_MBps"] > 0 and result["warm_ms_per_file_batched"] > 0
    assert result["page_cache_drop"] == "fadvise_dontneed"  # the test never drops the whole page cache
    assert "cold_resolve_MBps" in proc.stdout
