"""sd_notify (a real datagram socket stands in for systemd), the unit file
and the example config."""

from __future__ import annotations

import configparser
import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from hwr_server.config import ServerConfig
from hwr_server.sdnotify import Notifier
from tests.support.paths import REPO_DIR

REPO = Path(REPO_DIR)


@pytest.fixture
def notify_socket():
    """A bound AF_UNIX datagram socket and its path (short, under /tmp)."""
    d = tempfile.mkdtemp(prefix="hwr-n-", dir="/tmp")
    path = os.path.join(d, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(10)
    yield s, path
    s.close()
    os.unlink(path)
    os.rmdir(d)


def test_notifier_without_socket_is_a_noop():
    n = Notifier.from_environ({})
    assert not n.enabled
    n.ready()
    n.stopping()
    n.close()
    assert list(n.sent) == []


def test_ready_and_stopping_reach_the_socket(notify_socket):
    sock, path = notify_socket
    n = Notifier.from_environ({"NOTIFY_SOCKET": path})
    n.ready()
    assert sock.recv(4096).decode().split("\n")[0] == "READY=1"
    n.stopping()
    assert sock.recv(4096).decode().split("\n")[0] == "STOPPING=1"
    n.close()
    n.close()  # idempotent


def test_abstract_namespace_address():
    name = f"hwr-test-{os.getpid()}-{time.monotonic_ns()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(b"\0" + name.encode())
    s.settimeout(10)
    try:
        n = Notifier.from_environ({"NOTIFY_SOCKET": "@" + name})
        n.ready()
        assert s.recv(4096).startswith(b"READY=1")
        n.close()
    finally:
        s.close()


def test_watchdog_pings_every_half_period(notify_socket):
    sock, path = notify_socket
    n = Notifier.from_environ({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": str(os.getpid())})
    assert n.watchdog_usec == 100000
    n.ready()
    msgs = [sock.recv(4096).decode() for _ in range(4)]
    assert msgs[0].startswith("READY=1") and msgs[1:] == ["WATCHDOG=1"] * 3
    n.close()


def test_watchdog_withheld_while_liveness_fails(notify_socket):
    sock, path = notify_socket
    n = Notifier(path, watchdog_usec=50000)
    alive = {"v": False}
    n.liveness = lambda: alive["v"]
    n.ready()
    assert sock.recv(4096).startswith(b"READY=1")
    sock.settimeout(0.3)  # upper bound only: six periods without a ping
    with pytest.raises(socket.timeout):
        sock.recv(4096)
    alive["v"] = True
    sock.settimeout(10)
    assert sock.recv(4096) == b"WATCHDOG=1"
    n.close()


def test_watchdog_not_armed_for_another_pid():
    n = Notifier.from_environ({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert n.watchdog_usec == 0
    n.close()


def test_send_failure_is_logged_not_raised(caplog):
    n = Notifier("/nonexistent/notify")
    n.ready()
    assert list(n.sent) == [] and "sdnotify" in caplog.text
    n.close()


def _unit() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # keys are case-sensitive in systemd
    cp.read(REPO / "deploy" / "systemd" / "hwr.service")
    return cp


def test_unit_is_type_notify_with_watchdog_and_hardening():
    svc = _unit()["Service"]
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert int(svc["WatchdogSec"].rstrip("s")) > 0
    assert svc["ExecStart"].split()[1:3] == ["serve", "--config"]
    for key, value in {"ProtectSystem": "strict", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
                       "RuntimeDirectory": "hwr", "StateDirectory": "hwr"}.items():
        assert svc[key] == value, key
    assert "/var/lib/hwr" in svc["ReadWritePaths"]
    # Workers in the hwr group must reach the socket dir and map the store.
    assert svc["RuntimeDirectoryMode"] == "0750" and svc["StateDirectoryMode"] == "0750"
    assert svc["UMask"] == "0027"
    assert "IPAddressDeny" in svc and svc["IPAddressDeny"] == "any"


def test_example_config_is_accepted_and_matches_the_unit():
    cfg = ServerConfig.from_file(str(REPO / "deploy" / "hwr.toml.example")).validate()
    assert cfg.root == "/var/lib/hwr" and cfg.socket.startswith("/run/hwr/")
    assert cfg.admin_socket.startswith("/run/hwr/")
    assert cfg.gc_low_watermark < cfg.gc_high_watermark
    svc = _unit()["Service"]
    assert "/etc/hwr/hwr.toml" in svc["ExecStart"]
    # The example holds the defaults (tests/server/test_config_example.py):
    # socket_group "" keeps the daemon's group, which the unit makes hwr,
    # the group workers join.
    assert cfg.socket_group == "" and svc["Group"] == "hwr"


def test_tmpfiles_creates_socket_dir_for_the_group():
    lines = [ln.split() for ln in (REPO / "deploy" / "systemd" / "hwr.tmpfiles").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert ["d", "/run/hwr", "0750", "hwr", "hwr", "-"] in lines


def test_unit_passes_systemd_analyze_verify(tmp_path):
    import shutil
    import subprocess

    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze not installed")
    text = (REPO / "deploy" / "systemd" / "hwr.service").read_text().replace("/usr/local/bin/hwr", "/bin/true")
    unit = tmp_path / "hwr.service"
    unit.write_text(text)
    out = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Unknown key" not in out.stderr and "Unknown section" not in out.stderr, out.stderr


def test_daemon_notifies_ready_after_recovery_and_stopping_on_sigterm(make_daemon_fixture, notify_socket, tmp_path):
    """A fake NOTIFY_SOCKET (our bound datagram socket) stands in for systemd."""
    import json
    import signal

    from hwr_client.core._proto import hwr_pb2 as pb

    sock, path = notify_socket
    root = tmp_path / "root"
    leftover = root / "staging" / "crashed-publication"
    leftover.mkdir(parents=True)
    (leftover / "payload.0").write_bytes(b"x" * 4096)  # recovery must remove it before READY
    d = make_daemon_fixture(root=str(root), start=False,
                            env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    d.start(wait=False)
    first = sock.recv(4096).decode()
    assert first.split("\n")[0] == "READY=1" and f"MAINPID={d.proc.pid}" in first
    # At READY the store is recovered and every rpc is served at once.
    assert not leftover.exists()
    with d.client() as c:
        figures = json.loads(c.call(c.reader.GetStats, pb.GetStatsRequest(), timeout=10).stats_json)
    assert "hwr_recovery_seconds" in figures
    assert sock.recv(4096) == b"WATCHDOG=1"  # pings every WATCHDOG_USEC/2
    d.proc.send_signal(signal.SIGTERM)
    msgs = []
    while not msgs or msgs[-1] == "WATCHDOG=1":
        msgs.append(sock.recv(4096).decode())
    assert msgs[-1].split("\n")[0] == "STOPPING=1"
    assert d.proc.wait(60) == 0


def test_install_script_stages_files(tmp_path):
    import subprocess

    script = REPO / "deploy" / "install.sh"
    out = subprocess.run(["bash", str(script)], env={"DESTDIR": str(tmp_path), "HWR_BIN": "/opt/hwr/bin/hwr",
                                                     "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    unit = (tmp_path / "etc/systemd/system/hwr.service").read_text()
    assert "ExecStart=/opt/hwr/bin/hwr serve --config /etc/hwr/hwr.toml" in unit
    assert (tmp_path / "usr/lib/tmpfiles.d/hwr.conf").exists()
    ServerConfig.from_file(str(tmp_path / "etc/hwr/hwr.toml")).validate()
    # A second run keeps the operator's edited config.
    (tmp_path / "etc/hwr/hwr.toml").write_text('capacity = "1TiB"\n')
    subprocess.run(["bash", str(script)], env={"DESTDIR": str(tmp_path), "PATH": os.environ["PATH"]}, check=True,
                   capture_output=True, timeout=60)
    assert (tmp_path / "etc/hwr/hwr.toml").read_text() == 'capacity = "1TiB"\n'
