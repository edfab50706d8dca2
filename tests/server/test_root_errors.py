"""`hwr serve` with a store root it cannot use: one line on stderr naming the
path and the fix, exit 2 (the CLI's code for bad input), no traceback, and
nothing bound. The root is a file, lies under a file, or is a directory the
daemon's user (nobody, in a child) may not write."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.support.paths import REPO_DIR
from tests.support.privdrop import run_python_as


@pytest.fixture
def sockdir():
    path = tempfile.mkdtemp(prefix="hwr-root-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _serve_args(root: str, sockdir: str) -> list[str]:
    return ["serve", "--root", root, "--socket", os.path.join(sockdir, "hwr.sock"),
            "--admin-socket", os.path.join(sockdir, "admin.sock")]


def _serve(root: str, sockdir: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hwr_client.cli", *_serve_args(root, sockdir)],
                          capture_output=True, text=True, cwd=REPO_DIR, timeout=120)


def _one_line(out: subprocess.CompletedProcess) -> str:
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.parametrize("below", [False, True], ids=["root-is-a-file", "root-under-a-file"])
def test_root_that_is_a_file(tmp_path, sockdir, below):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    root = str(blocker / "store") if below else str(blocker)
    out = _serve(root, sockdir)
    assert out.returncode == 2, out.stderr
    assert _one_line(out) == (f"hwr serve: store root {root}: it, or a path above it, is a file, not a directory; "
                              "pass another directory (`hwr serve --root DIR`, or `root = \"DIR\"` in the config "
                              "file)")
    assert os.listdir(sockdir) == [] and blocker.read_text() == "x"  # nothing bound, nothing touched


@pytest.mark.skipif(os.geteuid() != 0, reason="switching uid needs root")
@pytest.mark.parametrize("exists", [True, False], ids=["read-only-root", "cannot-create-root"])
def test_root_the_daemon_user_may_not_write(sockdir, exists):
    nobody = pwd.getpwnam("nobody")
    parent = tempfile.mkdtemp(prefix="hwr-ro-", dir="/tmp")
    try:
        os.chmod(parent, 0o755)  # root's: nobody may look, not write
        root = os.path.join(parent, "store")
        if exists:
            os.mkdir(root, 0o755)
        # The daemon's user owns its socket directory, as under the unit.
        os.chown(sockdir, nobody.pw_uid, nobody.pw_gid)
        code = f"import sys\nfrom hwr_client.cli import main\nsys.exit(main({_serve_args(root, sockdir)!r}))\n"
        out = run_python_as(nobody.pw_uid, nobody.pw_gid, code, cwd="/", timeout=120)
        assert out.returncode == 2, out.stderr
        assert _one_line(out) == (
            f"hwr serve: store root {root}: user nobody cannot create or write it (Permission denied); pass another "
            "directory (`hwr serve --root DIR`, or `root = \"DIR\"` in the config file), or give the directory "
            f"to this user (`chown -R nobody {root}`)")
        assert os.listdir(sockdir) == [] and os.listdir(parent) == (["store"] if exists else [])
    finally:
        shutil.rmtree(parent, ignore_errors=True)
