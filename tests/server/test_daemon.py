"""The daemon process: locking before binding, socket modes, health,
shutdown, defaults. Every test runs the real `hwr serve`."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import tempfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hwr_client.core.defaults import default_paths, parse_size
from hwr_server.config import ServerConfig
from hwr_client.core.errors import InvalidArgument
from tests.support.daemon import make_daemon, wait_serving
from tests.support.privdrop import nobody, popen_python_as


def health_status(sock: str) -> int:
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_serves_health_with_socket_modes(daemon):
    assert health_status(daemon.socket) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(daemon.admin_socket) == health_pb2.HealthCheckResponse.SERVING
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(daemon.admin_socket).st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(daemon.socket).st_mode)


def _second(tmp_path, first, *, root=None, socket=None):
    second = make_daemon(tmp_path, root=root or first.root)
    if socket:
        second.socket = socket
    second.start(wait=False)
    rc = second.proc.wait(timeout=20)
    return rc, open(second.log_path).read()


def test_second_daemon_on_same_root_exits_naming_holder(tmp_path, daemon):
    inode = os.stat(daemon.socket).st_ino
    rc, log = _second(tmp_path, daemon)
    assert rc != 0
    assert f"pid {daemon.proc.pid}" in log and "in use by another hwr daemon" in log
    # The first keeps serving on its own, untouched socket.
    assert os.stat(daemon.socket).st_ino == inode
    assert health_status(daemon.socket) == health_pb2.HealthCheckResponse.SERVING


def test_second_daemon_on_same_socket_exits_and_first_keeps_serving(tmp_path, daemon):
    inode = os.stat(daemon.socket).st_ino
    rc, log = _second(tmp_path, daemon, root=str(tmp_path / "other-root"), socket=daemon.socket)
    assert rc != 0
    assert f"socket {daemon.socket} is in use" in log
    assert os.stat(daemon.socket).st_ino == inode
    assert health_status(daemon.socket) == health_pb2.HealthCheckResponse.SERVING


def test_sigterm_exits_zero_and_releases_everything(tmp_path, daemon):
    assert daemon.stop(signal.SIGTERM) == 0
    assert not os.path.exists(daemon.socket) and not os.path.exists(daemon.admin_socket)
    # The lock is gone with the process: a successor starts on the same root.
    daemon.start()
    assert health_status(daemon.socket) == health_pb2.HealthCheckResponse.SERVING


def test_sigkilled_daemon_leaves_a_stale_socket_that_the_successor_replaces(daemon):
    daemon.kill()
    assert os.path.exists(daemon.socket)  # nobody removed it
    daemon.start()
    assert health_status(daemon.socket) == health_pb2.HealthCheckResponse.SERVING


def test_bad_config_file_is_a_clear_error(tmp_path):
    cfg = tmp_path / "hwr.toml"
    cfg.write_text('root = "/tmp/x"\ncapacty = "1GiB"\n')
    d = make_daemon(tmp_path, "--config", str(cfg))
    d.start(wait=False)
    assert d.proc.wait(timeout=20) == 2
    assert "unknown key(s) ['capacty']" in d.log()


def test_runs_with_no_flags_as_a_normal_user(tmp_path):
    """`hwr serve` with no flags as an unprivileged user puts the root under
    its data directory and the sockets under its runtime directory."""
    user = nobody()
    home = tempfile.mkdtemp(prefix="hwr-home-", dir="/tmp")
    run = tempfile.mkdtemp(prefix="hwr-run-", dir="/tmp")
    for d in (home, run):
        os.chown(d, user.pw_uid, user.pw_gid)
    env = {"HOME": home, "XDG_RUNTIME_DIR": run, "PATH": os.environ["PATH"]}
    proc = popen_python_as(user.pw_uid, user.pw_gid, ["-m", "hwr_client.cli", "serve"], env=env, cwd=home,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        sock = os.path.join(run, "hwr", "hwr.sock")
        wait_serving(sock, proc=proc)
        assert os.path.isdir(os.path.join(home, ".local", "share", "hwr"))
        assert os.stat(sock).st_uid == user.pw_uid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_default_paths():
    assert default_paths(0, {}) == ("/var/lib/hwr", "/run/hwr/hwr.sock", "/run/hwr/admin.sock")
    root, sock, admin = default_paths(1000, {"HOME": "/home/u", "XDG_RUNTIME_DIR": "/run/user/1000"})
    assert root == "/home/u/.local/share/hwr" and sock == "/run/user/1000/hwr/hwr.sock"
    assert admin == "/run/user/1000/hwr/admin.sock"


@pytest.mark.parametrize("text,expected", [("100MiB", 100 * 2**20), ("2TiB", 2 * 2**40), ("1.5GB", 1_500_000_000),
                                           ("4096", 4096), (7, 7)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "10 parsecs", "-1", "MiB"])
def test_parse_size_rejects(text):
    with pytest.raises(InvalidArgument):
        parse_size(text)


def test_config_rejects_wrong_types_and_bad_watermarks():
    with pytest.raises(InvalidArgument, match="wrong type"):
        ServerConfig.from_mapping({"keepalive_interval_ms": "5"})
    with pytest.raises(InvalidArgument, match="gc_low_watermark"):
        ServerConfig(gc_low_watermark=0.95).validate()
