"""Run a Python child as an unprivileged user (tests run as root, so a
permission test that does not drop privileges tests nothing).

The test interpreter may live where ``nobody`` cannot reach it (pyenv under
``/root``). Then we use a system interpreter of the same major.minor version
with our site-packages on PYTHONPATH: compiled extensions are ABI-compatible
across builds of one CPython version. If nothing works, the caller skips with
the reason (never passes silently).
"""

from __future__ import annotations

import os
import pwd
import shutil
import site
import subprocess
import sys

import pytest

from tests.support.paths import REPO_DIR

REPO = REPO_DIR


def nobody() -> pwd.struct_passwd:
    return pwd.getpwnam("nobody")


def _drop(uid: int, gid: int, groups: list[int]):
    def fn() -> None:
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)

    return fn


def python_command(uid: int, gid: int) -> tuple[list[str], dict[str, str]]:
    """(argv prefix, env additions) that run Python with our packages as
    ``uid``; skips the test if no interpreter is usable by that user."""
    paths = [REPO, *site.getsitepackages()]
    env = {"PYTHONPATH": os.pathsep.join(paths), "PYTHONNOUSERSITE": "1"}
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    reasons = []
    for exe in (sys.executable, shutil.which(version, path="/usr/bin:/usr/local/bin") or ""):
        if not exe:
            continue
        try:
            probe = subprocess.run([exe, "-c", "import grpc, hwr_client"], env=dict(os.environ, **env),
                                   preexec_fn=_drop(uid, gid, []), capture_output=True, text=True, timeout=60)
        except OSError as exc:  # exec itself refused: the binary is out of reach
            reasons.append(f"{exe}: {exc.strerror}")
            continue
        if probe.returncode == 0:
            return [exe], env
        reasons.append(f"{exe}: {probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode}")
    pytest.skip(f"no Python interpreter usable by uid {uid} ({'; '.join(reasons)})")


def run_python_as(uid: int, gid: int, code: str, *, groups: list[int] | None = None,
                  env: dict[str, str] | None = None, timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``python -c code`` as uid/gid with supplementary ``groups``."""
    argv, extra = python_command(uid, gid)
    full_env = dict(env if env is not None else os.environ, **extra)
    return subprocess.run([*argv, "-c", code], env=full_env, preexec_fn=_drop(uid, gid, groups or []),
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def popen_python_as(uid: int, gid: int, args: list[str], *, groups: list[int] | None = None,
                    env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Starts ``python ARGS`` as uid/gid."""
    argv, extra = python_command(uid, gid)
    full_env = dict(env if env is not None else os.environ, **extra)
    return subprocess.Popen([*argv, *args], env=full_env, preexec_fn=_drop(uid, gid, groups or []), **kwargs)
