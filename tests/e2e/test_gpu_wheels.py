"""The wheel set carried to the GPU image (issue 23, finding 2): the lock
holds the exact versions these tests run against and the code's own
requirements; the install plan takes only what the image lacks or has too
old; the set builds for CPython 3.12 manylinux x86-64 from the lock, pip
accepts it for that interpreter offline, and it fits the 64 MiB the device
tool carries together with the working tree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

from bench.gpu import wheels
from tests.support.paths import REPO_DIR

#: What makes a failed download "no index here" rather than a bad lock.
OFFLINE = re.compile(r"NewConnectionError|Temporary failure in name resolution|Network is unreachable|"
                     r"Max retries exceeded|ProxyError|Name or service not known|Connection refused", re.I)


def test_the_lock_pins_what_the_tests_here_run_against_and_needs_what_the_code_needs():
    locked = wheels.read_lock()
    assert {lk.name for lk in locked} == {"grpcio", "protobuf", "grpcio-health-checking", "diffusers"}
    for lk in locked:
        assert wheels.installed_version(lk.name) == lk.version, (lk, "update bench/gpu/wheels.lock")
    with open(os.path.join(REPO_DIR, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    specs = project["dependencies"] + project["optional-dependencies"]["diffusers"]
    for lk in locked:
        spec = next(s for s in specs if re.match(rf"{re.escape(lk.name)}[<>=!~]", s))
        assert sorted(spec[len(lk.name):].split(",")) == sorted(lk.need.split(",")), (lk, spec)


def test_the_plan_installs_only_what_is_missing_or_too_old():
    locked = wheels.parse_lock("grpcio==1.85.3 >=1.85.1\nprotobuf==7.36.2 >=7.35.1,<8\ndiffusers==0.42.1 >=0.36\n")
    image = {"grpcio": "1.71.0", "protobuf": "8.1.0", "diffusers": None}.get
    assert [(r["name"], r["install"]) for r in wheels.plan(locked, image)] == [
        ("grpcio", True), ("protobuf", True), ("diffusers", True)]  # too old, too new for <8, absent
    assert not any(r["install"] for r in wheels.plan(locked, {"grpcio": "1.86.0", "protobuf": "7.35.1",
                                                               "diffusers": "0.36.0"}.get))
    with pytest.raises(ValueError, match="line 1"):
        wheels.parse_lock("grpcio>=1\n")


def test_one_wheel_per_locked_package(tmp_path):
    locked = wheels.parse_lock("grpcio-health-checking==1.85.1 >=1\n")
    (tmp_path / "grpcio_health_checking-1.85.1-py3-none-any.whl").write_bytes(b"")
    assert wheels.wheel_files(locked, str(tmp_path))["grpcio-health-checking"].endswith("py3-none-any.whl")
    (tmp_path / "grpcio_health_checking-1.85.1-py2.py3-none-any.whl").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="2 wheels"):
        wheels.wheel_files(locked, str(tmp_path))


def _working_tree_bytes() -> int:
    """What the device tool sends besides carried paths: tracked files and
    untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_DIR, check=True,
                           capture_output=True).stdout.decode().split("\0")
    return sum(os.path.getsize(os.path.join(REPO_DIR, n)) for n in names if n and os.path.isfile(
        os.path.join(REPO_DIR, n)))


def test_the_carried_set_builds_for_cp312_installs_offline_and_fits(tmp_path):
    directory = tmp_path / "whl"
    argv = wheels.download_argv(wheels.read_lock(), str(directory))
    assert {"--no-deps", "--only-binary=:all:"} <= set(argv) and argv[argv.index("--python-version") + 1] == "3.12"
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and OFFLINE.search(proc.stdout + proc.stderr):
        pytest.skip(f"no package index reachable from here: {proc.stderr.strip().splitlines()[-1][:200]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = wheels.wheel_files(wheels.read_lock(), str(directory))
    for f in files.values():
        name = os.path.basename(f)
        assert re.search(r"-(cp312-cp312|cp3\d+-abi3|py3-none)-(manylinux\S*x86_64|any)\.whl$", name), name
    # pip itself accepts the set for CPython 3.12 on x86-64, offline and
    # without dependencies, exactly as run.sh installs it there.
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--only-binary=:all:",
               "--target", str(target), "--python-version", "3.12", "--implementation", "cp"]
    for p in wheels.PLATFORMS:
        install += ["--platform", p]
    got = subprocess.run(install + list(files.values()), capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert {"grpc", "grpc_health", "google", "diffusers"} <= set(os.listdir(target))
    carried = sum(os.path.getsize(f) for f in files.values())
    tree = _working_tree_bytes()
    assert carried + tree <= wheels.CARRY_LIMIT, (carried, tree)
