"""Trust in the filesystem (issue 16): the runtime directory, startup
recovery, the store's bytes. Every test runs the real daemon; the
permission cases run it (or the attacker) as uid nobody in a child process.

Each test plants what an attacker or a damaged disk would leave, starts
``hwr serve`` and checks that it refuses the planted thing with a reason,
or serves the rest, and never writes through a planted link.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import uuid

import pytest

from tests.daemon import make_daemon, wait_serving
from tests.privdrop import nobody, popen_python_as, run_python_as

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="planting files of other users needs root")

#: A uid that is neither root nor nobody: the "other user" of a two-user attack.
OTHER_UID = 1


def _exit_log(d, timeout: float = 30.0) -> tuple[int, str]:
    """Waits for a daemon expected to refuse to start; (exit code, log)."""
    assert d.proc is not None
    try:
        rc = d.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"daemon did not refuse to start; log:\n{d.log()[-2000:]}")
    return rc, d.log()


@pytest.fixture
def victim_file(tmp_path):
    """A file of the daemon's user that a planted link points at."""
    path = tmp_path / "precious.txt"
    path.write_text("precious\n")
    return path


# -- finding 1: the runtime directory ------------------------------------------------


def test_socket_dir_made_by_another_user_writable_by_all_is_refused(tmp_path, victim_file):
    """nobody pre-creates the daemon's socket directory 0777 and plants
    ``hwr.sock.lock`` as a link to a file of the victim (root). The daemon
    must refuse the directory and leave the file alone."""
    user = nobody()
    sockdir = f"/tmp/hwr-victim-{uuid.uuid4().hex[:8]}"
    os.chmod(tmp_path, 0o755)  # let nobody reach the victim's file by name
    plant = (f"import os; os.mkdir({sockdir!r}); os.chmod({sockdir!r}, 0o777); "
             f"os.symlink({str(victim_file)!r}, {sockdir + '/hwr.sock.lock'!r})")
    out = run_python_as(user.pw_uid, user.pw_gid, plant)
    assert out.returncode == 0, out.stderr
    try:
        d = make_daemon(tmp_path)
        d.socket, d.admin_socket = f"{sockdir}/hwr.sock", f"{sockdir}/admin.sock"
        d.start(wait=False)
        rc, log = _exit_log(d)
        assert rc != 0
        assert f"directory {sockdir} is owned by uid {user.pw_uid}, expected root or uid 0" in log
        assert victim_file.read_text() == "precious\n"
        assert not os.path.exists(d.socket)
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def test_lock_file_planted_as_a_link_is_never_written_through(tmp_path, victim_file):
    """Even in a directory of our own, ``<socket>.lock`` that is a link is
    refused (O_NOFOLLOW), with the reason."""
    d = make_daemon(tmp_path)
    os.symlink(victim_file, d.socket + ".lock")
    d.start(wait=False)
    rc, log = _exit_log(d)
    assert rc != 0
    assert f"lock file {d.socket}.lock of socket {d.socket} is a symbolic link" in log
    assert victim_file.read_text() == "precious\n"


def test_store_lock_planted_as_a_link_is_refused(tmp_path, victim_file):
    d = make_daemon(tmp_path)
    os.makedirs(d.root)
    os.symlink(victim_file, os.path.join(d.root, "hwr.lock"))
    d.start(wait=False)
    rc, log = _exit_log(d)
    assert rc != 0 and "is a symbolic link" in log
    assert victim_file.read_text() == "precious\n"


def test_socket_path_that_is_a_link_is_refused(tmp_path, victim_file):
    """A link at the socket path itself is not bound through or unlinked."""
    d = make_daemon(tmp_path)
    os.symlink(victim_file, d.socket)
    d.start(wait=False)
    rc, log = _exit_log(d)
    assert rc != 0 and f"socket {d.socket}: exists and is not a Unix socket" in log
    assert os.path.islink(d.socket) and victim_file.read_text() == "precious\n"


@pytest.fixture
def nobody_env():
    """uid nobody's environment without XDG_RUNTIME_DIR (so the predictable
    /tmp/hwr-<uid>-run default is used), with a HOME of its own; the default
    runtime directory is removed before and after."""
    user = nobody()
    run = f"/tmp/hwr-{user.pw_uid}-run"
    shutil.rmtree(run, ignore_errors=True)
    home = tempfile.mkdtemp(prefix="hwr-home-", dir="/tmp")
    os.chown(home, user.pw_uid, user.pw_gid)
    env = {"HOME": home, "PATH": os.environ["PATH"]}
    yield user, run, env
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)


def test_default_runtime_dir_is_created_private_and_serves(nobody_env):
    user, run, env = nobody_env
    proc = popen_python_as(user.pw_uid, user.pw_gid, ["-m", "hwr_client.cli", "serve"], env=env, cwd=env["HOME"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_serving(os.path.join(run, "hwr", "hwr.sock"), proc=proc)
        for d in (run, os.path.join(run, "hwr")):
            st = os.stat(d)
            assert (st.st_uid, st.st_mode & 0o777) == (user.pw_uid, 0o700), d
        # The client's default choice accepts a directory of its own user.
        out = run_python_as(user.pw_uid, user.pw_gid,
                            "from hwr_client.channel import default_socket; print(default_socket())", env=env)
        assert out.returncode == 0 and out.stdout.strip() == os.path.join(run, "hwr", "hwr.sock"), out.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def _plant_other_users_runtime_dir(run: str, victim: str) -> None:
    """What another user (uid 1) leaves for nobody: the predictable runtime
    directory, 0777, with a lock link to nobody's file."""
    os.makedirs(os.path.join(run, "hwr"))
    for d in (run, os.path.join(run, "hwr")):
        os.chown(d, OTHER_UID, OTHER_UID)
        os.chmod(d, 0o777)
    os.symlink(victim, os.path.join(run, "hwr", "hwr.sock.lock"))


def test_default_runtime_dir_of_another_user_is_refused_by_daemon_and_client(nobody_env):
    """uid 1 pre-created /tmp/hwr-<nobody>-run: nobody's daemon refuses to
    start there (and writes nothing through the planted lock link), and
    nobody's client refuses the default socket in it, naming the directory."""
    user, run, env = nobody_env
    victim = os.path.join(env["HOME"], "precious.txt")
    with open(victim, "w") as f:
        f.write("precious\n")
    os.chown(victim, user.pw_uid, user.pw_gid)
    _plant_other_users_runtime_dir(run, victim)
    proc = popen_python_as(user.pw_uid, user.pw_gid, ["-m", "hwr_client.cli", "serve"], env=env, cwd=env["HOME"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0, out
    assert f"directory {run}/hwr: directory {run} on its way is owned by uid {OTHER_UID}, expected root or uid {user.pw_uid}" in out
    assert open(victim).read() == "precious\n"
    client = run_python_as(user.pw_uid, user.pw_gid, (
        "from hwr_client.channel import RuntimeChannel\n"
        "from hwr_client.core.errors import FailedPrecondition\n"
        "try:\n    RuntimeChannel()\nexcept FailedPrecondition as e:\n    print('refused:', e)\n"
    ), env=env)
    assert client.returncode == 0, client.stderr
    assert client.stdout.startswith("refused:") and f"{run} on its way is owned by uid {OTHER_UID}" in client.stdout
