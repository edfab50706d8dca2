"""The DLO benchmarks' quick modes, so the scripts cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from tests.support.paths import REPO_DIR

REPO = REPO_DIR


def test_dlo_cpu_quick(tmp_path):
    out = tmp_path / "dlo_cpu.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "dlo_cpu.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["parity"] == {"dlo_layout": True, "per_tensor": True}
    assert result["transport"] == "registered"
    # One contiguous copy per block per pass (plus the initial prefetch),
    # against one copy per tensor.
    assert 1.0 <= result["per_block"]["copies_layout"] < 1.5
    assert result["per_block"]["copies_per_tensor"] == result["config"]["tensors_per_block"]
    assert "copy ms per block" in proc.stdout


def test_dlo_gpu_without_cuda_says_so(tmp_path):
    out = tmp_path / "dlo_gpu.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "dlo_gpu.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert json.loads(out.read_text())["h2d_gbps"]
    else:
        assert proc.returncode == 2 and "no CUDA device" in proc.stderr
