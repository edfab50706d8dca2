"""``hwr demo`` end to end at a tiny size: its own daemon, real worker
processes, one table; nothing left running; non-zero exit on a failed check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hwr_client.core.defaults import parse_size
from hwr_client.core.errors import InvalidArgument
from tests.support.paths import REPO_DIR

REPO = REPO_DIR


def _hwr(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HWR_SOCKET", None)
    return subprocess.run([sys.executable, "-m", "hwr_client.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _processes_mentioning(text: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


def test_parse_size():
    assert parse_size("64MiB") == 64 << 20 and parse_size("1GiB") == 1 << 30 and parse_size("512k") == 512 << 10
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("100") == 100
    with pytest.raises(InvalidArgument, match="64MiB"):
        parse_size("lots")


@pytest.mark.slow
def test_demo_runs_end_to_end_and_leaves_nothing_running(tmp_path):
    workdir = str(tmp_path / "demo")
    proc = _hwr("demo", "--size", "2MiB", "--workers", "2", "--workdir", workdir, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    rows = doc["rows"]
    assert doc["failures"] == []
    assert rows["cold"]["outcome"] == "CANONICAL_FALLBACK" and rows["cold"]["publish"]["ok"]
    assert rows["warm"]["outcome"] == rows["warm_many"]["outcome"] == "LOCAL_HIT"
    assert all(r["outputs_equal"] for r in rows.values())
    assert rows["warm"]["bytes_materialized"] == rows["warm_many"]["bytes_materialized"] == 0
    assert rows["warm"]["producer_calls"] == 0 and rows["cold"]["producer_calls"] == 1
    assert rows["cold"]["bytes_copied_to_device"] > 0 and rows["warm"]["bytes_copied_to_device"] > 0
    assert len(doc["workers"]["warm_many"]) == 2
    assert len({w["pid"] for w in doc["workers"]["warm_many"]}) == 2  # separate processes
    assert "[3/6]" in proc.stderr  # progress is shown
    assert _processes_mentioning(workdir) == []  # the daemon and every worker are gone


@pytest.mark.slow
def test_demo_table_and_failed_check_exit_code(tmp_path):
    # A socket nobody serves: preferred workers fall back, so the warm
    # checks fail and the demo must say so with a non-zero exit.
    proc = _hwr("demo", "--size", "1MiB", "--workers", "1", "--socket", str(tmp_path / "none.sock"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "outputs equal" in proc.stdout and "expected LOCAL_HIT" in proc.stdout
