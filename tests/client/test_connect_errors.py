"""A socket the client cannot dial says what is wrong and what to do, through
the one mapping (hwr_client.core.errors.from_rpc_error), in the library and
as one line with its exit code in the CLI: no daemon (no file, or a stale
file nobody serves) and a socket this user may not use (a real daemon with
socket_group, a caller dropped to uid nobody outside that group)."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import socket as pysocket
import subprocess
import sys
import tempfile

import pytest

import hwr_client
from hwr_client.core.errors import NotFound, PermissionDenied, Unavailable, connect_failure
from tests.support.paths import REPO_DIR
from tests.support.privdrop import run_python_as

#: An existing system group that nobody is not in (tests/server/test_access.py).
GROUP = "daemon"
KEY = "ab" * 32


@pytest.fixture
def sockdir():
    # Unix socket paths must fit in 108 bytes: a short directory under /tmp.
    path = tempfile.mkdtemp(prefix="hwr-err-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _hwr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hwr_client.cli", *args], capture_output=True, text=True,
                          cwd=REPO_DIR, env=env, timeout=120)


def test_no_daemon_library_and_cli(sockdir):
    sock = os.path.join(sockdir, "hwr.sock")
    with pytest.raises(Unavailable) as info:
        with hwr_client.connect(sock) as client:
            client.acquire(KEY)
    text = str(info.value)
    assert text.startswith(f"no HWR daemon at {sock}: start one with `hwr serve`"), text
    assert "HWR_SOCKET" in text and "failed to connect" not in text and "\n" not in text
    out = _hwr("ls", "--socket", sock)
    assert out.returncode == 5, out.stderr
    assert out.stderr.splitlines() == [f"hwr ls: Unavailable: {text}"]
    # HWR_SOCKET names the socket the same way.
    out = _hwr("ls", env=dict(os.environ, HWR_SOCKET=sock))
    assert out.returncode == 5 and f"no HWR daemon at {sock}:" in out.stderr and len(out.stderr.splitlines()) == 1


def test_stale_socket_file_is_no_daemon(sockdir):
    sock = os.path.join(sockdir, "hwr.sock")
    s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    s.bind(sock)
    s.close()  # the file stays; nothing listens: what a killed daemon leaves
    out = _hwr("ls", "--socket", sock)
    assert out.returncode == 5, out.stderr
    assert f"no HWR daemon at {sock}: the socket file is there but nothing serves it" in out.stderr
    assert len(out.stderr.splitlines()) == 1


def test_older_grpc_wording_and_other_failures_are_mapped():
    # grpc before 1.60 wrote "unix:PATH: <strerror>".
    old = "failed to connect to all addresses; last error: UNKNOWN: unix:/run/x.sock: No such file or directory"
    err = connect_failure(old)
    assert isinstance(err, Unavailable) and str(err).startswith("no HWR daemon at /run/x.sock:")
    assert connect_failure("Socket closed") is None  # not a dial: mapped as before
    assert connect_failure("failed to connect to all addresses; last error: something new") is None


# -- permissions: the daemon runs, this user may not use its socket ----------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching uid needs root")

_CALLER = r"""
import json, sys
import hwr_client
from hwr_client.cli import main
sock = sys.argv[1] if len(sys.argv) > 1 else SOCK
try:
    with hwr_client.connect(sock) as client:
        client.acquire("ab" * 32)
    print(json.dumps({"raised": None}))
except Exception as exc:
    print(json.dumps({"raised": type(exc).__name__, "text": str(exc)}))
sys.stdout.flush()
sys.exit(main(["ls", "--socket", sock]))
"""


def _as_nobody(sock: str) -> tuple[dict, subprocess.CompletedProcess]:
    nobody = pwd.getpwnam("nobody")
    assert grp.getgrnam(GROUP).gr_gid not in os.getgrouplist("nobody", nobody.pw_gid)
    out = run_python_as(nobody.pw_uid, nobody.pw_gid, _CALLER.replace("SOCK", repr(sock)), groups=[nobody.pw_gid],
                        cwd="/", timeout=120)
    return json.loads(out.stdout.splitlines()[0]), out


@needs_root
def test_socket_of_another_group_names_socket_group(make_daemon_fixture):
    d = make_daemon_fixture("--socket-group", GROUP)
    # As /run/hwr under the unit: the directory lets others reach the socket,
    # whose own mode (0660, group daemon) refuses them.
    os.chmod(os.path.dirname(d.socket), 0o755)
    raised, out = _as_nobody(d.socket)
    assert raised["raised"] == "PermissionDenied", raised
    text = raised["text"]
    assert text.startswith(f"socket {d.socket} exists (mode 0660, group {GROUP}) but this user (nobody) may not "
                           "use it (Permission denied)"), text
    assert f"usermod -aG {GROUP} nobody" in text and "Fix: the daemon's `socket_group`" in text
    assert "start one with" not in text
    assert out.returncode == 4, out.stderr
    assert out.stderr.splitlines() == [f"hwr ls: PermissionDenied: {text}"]
    # The daemon was up all along: it answers a caller it lets in.
    with d.client() as c, pytest.raises(NotFound):
        c.lookup(KEY)


@needs_root
def test_closed_socket_directory_is_named(make_daemon_fixture):
    d = make_daemon_fixture("--socket-group", GROUP)  # its socket directory stays 0700 (mkdtemp)
    raised, out = _as_nobody(d.socket)
    assert raised["raised"] == "PermissionDenied", raised
    assert "a directory on its path is closed to this user" in raised["text"]
    assert "`socket_group`" in raised["text"] and out.returncode == 4


def test_permission_denied_maps_without_a_visible_socket():
    text = "failed to connect to all addresses; last error: FAILED_PRECONDITION: unix:/nonexistent/dir/x.sock: " \
           "connect failed: addr: unix:/nonexistent/dir/x.sock error: Permission denied"
    err = connect_failure(text)
    assert isinstance(err, PermissionDenied) and "socket /nonexistent/dir/x.sock:" in str(err)


@needs_root
def test_worker_from_pretrained_is_told_socket_group(make_daemon_fixture):
    """The worker of the issue: dlo_runtime.from_pretrained (preferred mode)
    as a user outside the socket's group. PermissionDenied is a broken
    configuration, FAILED in every mode (hwr_client.resolve), so it raises
    the fix instead of falling back with "start the daemon"."""
    from tests.support.real_models import save_model

    d = make_daemon_fixture("--socket-group", GROUP)
    os.chmod(os.path.dirname(d.socket), 0o755)
    base = tempfile.mkdtemp(prefix="hwr-err-model-", dir="/tmp")
    try:
        model = save_model("bert", os.path.join(base, "bert"))
        for dirpath, _, files in os.walk(base):  # readable by nobody, as a shared model folder is
            os.chmod(dirpath, 0o755)
            for name in files:
                os.chmod(os.path.join(dirpath, name), 0o644)
        nobody = pwd.getpwnam("nobody")
        code = ("import dlo_runtime\ntry:\n"
                f"    dlo_runtime.from_pretrained({model!r}, socket={d.socket!r}).close()\n"
                "    print('loaded')\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n")
        out = run_python_as(nobody.pw_uid, nobody.pw_gid, code, groups=[nobody.pw_gid], cwd="/", timeout=300,
                            env=dict(os.environ, HOME=base))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert out.stdout.startswith(f"PermissionDenied socket {d.socket} exists (mode 0660, group {GROUP})"), \
        out.stdout + out.stderr[-2000:]
    assert f"usermod -aG {GROUP} nobody" in out.stdout and "start" not in out.stdout
