"""bench/gpu/run.sh on CPU: the dry run (plan, imports, CUDA test
collection; nothing CUDA runs), the one-JSON-one-log output of a run, and
the summary's failure rules (issue 23)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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
    proc = subprocess.run(["bash", "bench/gpu/run.sh", str(out), "--dry-run", "--wheels", str(tmp_path / "none")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("probe", "pytest_cuda", "dlo_gpu", "startup_cuda", "compile_cuda"):
        assert name in proc.stdout
    assert "-m cuda -rs" in proc.stdout and "--device cuda" in proc.stdout
    assert "import FAILED" not in proc.stdout
    collected = int(proc.stdout.split("cuda tests collected: ")[1].split()[0])
    assert collected >= 10
    # The tests that need no host registration are there, and NCCL's one-rank test.
    for name in (runner.NCCL_TEST, "test_staging_slots_are_pinned_exactly_and_released",
                 "test_the_decline_rule_matches_what_the_driver_does"):
        assert name in proc.stdout
    assert not out.exists()  # nothing ran, nothing written


def test_unknown_option_and_missing_out_are_refused():
    for argv in (["--bogus"], []):
        proc = subprocess.run(["bash", "bench/gpu/run.sh", *argv], cwd=REPO, env=_env(), capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 2 and ("unknown option" in proc.stderr or "usage" in proc.stderr)


def test_plan_fits_five_minutes_and_collects_only_modules_with_cuda_tests():
    steps = runner.plan("/x")
    assert sum(s.timeout_s for s in steps) <= runner.BUDGET_S <= 300
    assert [s.name for s in steps] == ["probe", "pytest_cuda", "dlo_gpu", "startup_cuda", "compile_cuda"]
    files = runner.cuda_test_files()
    assert "tests/runtime/test_dlo_cuda.py" in files and "tests/runtime/test_allgather_nccl.py" in files
    assert "tests/runtime/test_dlo_transports.py" not in files
    # Every step writes into the scratch directory, never into OUT.
    assert all(a.startswith("/x") for s in steps for a in s.argv if a.endswith((".json", ".xml")))


def test_a_run_leaves_exactly_one_json_and_one_log(tmp_path, monkeypatch):
    """The real run() with a plan of stand-in steps: OUT holds gpu.json and
    gpu.log only (a device run returns at most eight files), the scratch
    directory is gone, and a failed step fails the run."""
    made = []

    def fake_plan(scratch, python=sys.executable):
        made.append(scratch)
        write = ("import json, sys; json.dump({'checks': {'payload_equal': True}, 'h2d_gbps': {'staging': 9.0}, "
                 "'offload': {}}, open(sys.argv[1], 'w'))")
        return [runner.Step("dlo_gpu", (python, "-c", write, os.path.join(scratch, "dlo_gpu.json")), 30),
                runner.Step("startup_cuda", (python, "-c", "print('boom'); raise SystemExit(3)"), 30)]

    monkeypatch.setattr(runner, "plan", fake_plan)
    out = tmp_path / "out"
    assert runner.run(str(out), sys.executable) == 1
    assert sorted(os.listdir(out)) == ["gpu.json", "gpu.log"]
    doc = json.loads((out / "gpu.json").read_text())
    assert doc["dlo_gpu"]["h2d_gbps"] == {"staging": 9.0} and doc["checks"]["step startup_cuda"] is False
    log = (out / "gpu.log").read_text()
    assert "===== startup_cuda" in log and "boom" in log and "overall: FAILED" in log
    assert made and not os.path.exists(made[0])


JUNIT = """<testsuites><testsuite tests="4" failures="1" errors="0" skipped="2">
<testcase classname="tests.runtime.test_allgather_nccl" name="test_gather_engine_over_nccl_with_one_rank"/>
<testcase classname="tests.runtime.test_dlo_cuda" name="test_registration_round_trip_and_error_cleared">
  <skipped message="host registration not usable here: read-only host registration unsupported"/></testcase>
<testcase classname="tests.runtime.test_allgather_cuda" name="test_two_gpus_allgather_parity">
  <skipped message="needs 2 CUDA devices (one per NCCL rank)"/></testcase>
<testcase classname="tests.runtime.test_dlo_cuda" name="test_copies_overlap_compute_on_streams">
  <failure message="staging: 10 of 100 us of H2D copy overlapped kernels"/></testcase>
</testsuite></testsuites>"""


def test_junit_keeps_every_skip_reason_and_failure(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    doc = runner.summarise(str(tmp_path), [{"name": "pytest_cuda", "rc": 1, "ok": False, "seconds": 1.0}])
    t = doc["pytest_cuda"]
    assert (t["tests"], t["skipped"], t["failures"]) == (4, 2, 1)
    assert [s["reason"] for s in t["skips"]] == ["host registration not usable here: read-only host registration "
                                                 "unsupported", "needs 2 CUDA devices (one per NCCL rank)"]
    assert t["failed"][0]["test"].endswith("test_copies_overlap_compute_on_streams")
    assert doc["checks"]["NCCL world_size=1 gather engine"] and not doc["checks"]["cuda tests passed"]
    text = runner.table(doc)
    assert "SKIPPED tests.runtime.test_allgather_cuda::test_two_gpus_allgather_parity: needs 2" in text
    assert "overall: FAILED" in text


def _dlo(checks):
    return {"h2d_gbps": {"staging": 20.0}, "offload": {"staging": {"over_max_compute_copy": 1.1, "over_resident": 1.3}},
            "hook_memcpy_over_compute": 0.3, "checks": checks}


def _probe(agrees):
    row = {"mapping": "file_ro", "flag": "read_only", "state": "cold", "code": 801,
           "error": "cudaErrorNotSupported", "register_s_per_gib": 0.0}
    return {"device": {"name": "H200"}, "versions": {"python": "3.12.3"}, "rows": [row], "agrees": agrees,
            "decision": {"transport": "staging", "flags": "", "why": "x"}}


def test_summary_fails_on_a_failed_check_a_step_a_disagreeing_probe_or_all_skipped(tmp_path):
    ok = [{"name": "dlo_gpu", "rc": 0, "ok": True, "seconds": 1.0}]
    (tmp_path / "dlo_gpu.json").write_text(json.dumps(_dlo({"payload_equal": True})))
    (tmp_path / "probe.json").write_text(json.dumps(_probe(True)))
    doc = runner.summarise(str(tmp_path), ok)
    assert doc["ok"], doc["checks"]
    assert doc["numbers"]["registration"]["file_ro/read_only/cold"]["error"] == "cudaErrorNotSupported"
    (tmp_path / "dlo_gpu.json").write_text(json.dumps(_dlo({"payload_equal": False})))
    assert not runner.summarise(str(tmp_path), ok)["ok"]
    (tmp_path / "dlo_gpu.json").write_text(json.dumps(_dlo({"payload_equal": True})))
    (tmp_path / "probe.json").write_text(json.dumps(_probe(False)))
    assert not runner.summarise(str(tmp_path), ok)["ok"]
    (tmp_path / "probe.json").write_text(json.dumps(_probe(True)))
    failed = [dict(ok[0], rc="timeout after 75 s", ok=False)]
    assert "FAILED  step dlo_gpu" in runner.table(runner.summarise(str(tmp_path), failed))
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite tests="5" failures="0" errors="0" skipped="5"/></testsuites>')
    assert not runner.summarise(str(tmp_path), ok)["ok"]


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


def test_a_step_out_of_time_is_killed_with_every_process_it_started(tmp_path):
    child = ("import subprocess, sys, time; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
             "print('grandchild', p.pid, flush=True); time.sleep(120)")
    log_path = tmp_path / "log"
    with open(log_path, "w") as log:
        row = runner._run_step(runner.Step("slow", (sys.executable, "-c", child), 3), log)
    assert row["rc"] == "timeout after 3 s" and not row["ok"]
    pid = int(log_path.read_text().split("grandchild ")[1].split()[0])
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), "the step's own child survived it"
