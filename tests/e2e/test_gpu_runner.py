"""bench/gpu/run.sh on CPU: the dry run (plan, imports, CUDA test
collection; nothing CUDA runs) and the summary's failure rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.gpu import runner
from tests.support.paths import REPO_DIR

REPO = REPO_DIR


def _env():
    # run.sh uses the machine's `python3`: make that the interpreter running
    # these tests, which has the project's dependencies.
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def test_dry_run_prints_the_plan_imports_everything_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "bench/gpu/run.sh", str(out), "--dry-run"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("pytest_cuda", "dlo_gpu", "startup_cuda"):
        assert name in proc.stdout
    assert "-m cuda" in proc.stdout and "--device cuda" in proc.stdout and "--reg-gib 4" in proc.stdout
    assert "import FAILED" not in proc.stdout
    collected = int(proc.stdout.split("cuda tests collected: ")[1].split()[0])
    assert collected >= 5
    assert not out.exists()  # nothing ran, nothing written


def test_unknown_option_is_refused():
    proc = subprocess.run(["bash", "bench/gpu/run.sh", "--bogus"], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and "unknown option" in proc.stderr


def test_plan_fits_the_six_minute_budget():
    steps = runner.plan("/x")
    assert sum(s.timeout_s for s in steps) <= runner.BUDGET_S < 360
    assert [s.name for s in steps] == ["pytest_cuda", "dlo_gpu", "startup_cuda"]


def _dlo(checks):
    reg = {"register_s_per_gib": 0.5, "prefault_s_per_gib": 0.1, "dirty_delta_mib": 4096.0}
    return {"h2d_gbps": {"registered": 50.0}, "registration_disk": {"cold": reg, "prefaulted": reg},
            "offload": {"registered": {"over_max_compute_copy": 1.1}}, "hook_memcpy_over_compute": 0.3,
            "checks": checks}


def test_summary_fails_on_any_failed_check_or_step(tmp_path):
    ok_step = {"name": "dlo_gpu", "rc": 0, "ok": True, "seconds": 1.0, "log": "x"}
    (tmp_path / "dlo_gpu.json").write_text(json.dumps(_dlo({"payload_equal": True})))
    doc = runner.summarise(str(tmp_path), [ok_step])
    assert doc["ok"] and doc["numbers"]["registration_cold_s_per_gib"] == 0.6
    assert "overall: ok" in runner.table(doc)
    (tmp_path / "dlo_gpu.json").write_text(json.dumps(_dlo({"payload_equal": False})))
    assert not runner.summarise(str(tmp_path), [ok_step])["ok"]
    (tmp_path / "dlo_gpu.json").write_text(json.dumps(_dlo({"payload_equal": True})))
    failed = dict(ok_step, rc="timeout after 140 s", ok=False)
    doc = runner.summarise(str(tmp_path), [failed])
    assert not doc["ok"] and "FAILED  step dlo_gpu" in runner.table(doc)


def test_summary_fails_when_every_cuda_test_skipped(tmp_path):
    (tmp_path / "pytest_cuda.xml").write_text(
        '<testsuites><testsuite tests="5" failures="0" errors="0" skipped="5"/></testsuites>')
    step = {"name": "pytest_cuda", "rc": 0, "ok": True, "seconds": 1.0, "log": "x"}
    assert not runner.summarise(str(tmp_path), [step])["ok"]
