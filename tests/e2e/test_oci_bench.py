"""bench/pull.py --quick runs end to end (so the script cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.oci_registry import registry_binary
from tests.support.paths import REPO_DIR

REPO = REPO_DIR


def test_bench_pull_quick(tmp_path):
    registry_binary()  # skips (or fails in CI) without the registry
    out = tmp_path / "pull.json"
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "pull.py"), "--quick", "--out", str(out),
                    "--dir", str(tmp_path)], check=True, timeout=300, capture_output=True)
    r = json.loads(out.read_text())
    assert r["pull_bytes"] == r["size_bytes"] and r["layers"] == 41 and r["push_layers"] == 41
    assert r["pull_MBps"] > 0 and r["raw_get_fsync_MBps"] > 0 and r["canonical_load_publish_s"] > 0
