"""Access control against the real daemon: socket modes and group, a process
outside the group is refused at connect (a child that drops to uid nobody),
one inside the group gets an HTTP/2 answer, mutating admin rpcs are refused
on the runtime socket, and the daemon listens on no TCP port."""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import PermissionDenied

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching uid needs root")

#: Group used as socket_group: an existing system group nobody is not in.
GROUP = "daemon"

# The child: imports first, then drops privileges, then connects. Runs as
# root until setuid (it cannot even exec Python as nobody here).
_CHILD = r"""
import json, os, socket, sys
path, uid, gid, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
os.setgroups(groups); os.setgid(gid); os.setuid(uid)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(10)
try:
    s.connect(path)
except OSError as exc:
    print(json.dumps({"connected": False, "errno": exc.errno, "error": str(exc)})); sys.exit(0)
# HTTP/2 client preface + empty SETTINGS; a gRPC server answers with SETTINGS.
s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
head = b""
while len(head) < 9:
    chunk = s.recv(9 - len(head))
    if not chunk:
        break
    head += chunk
print(json.dumps({"connected": True, "frame_type": head[3] if len(head) == 9 else None, "uid": os.getuid()}))
"""


def _connect_as(path: str, uid: int, gid: int, groups: list[int]) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, path, str(uid), str(gid), json.dumps(groups)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def grouped_daemon(make_daemon_fixture):
    d = make_daemon_fixture("--socket-group", GROUP)
    # The test's socket directory is 0700 (mkdtemp); open it like /run/hwr's
    # 0750-with-group so only the socket's own mode decides.
    os.chmod(os.path.dirname(d.socket), 0o755)
    return d


def test_socket_modes_and_group(grouped_daemon):
    d = grouped_daemon
    rt, adm = os.stat(d.socket), os.stat(d.admin_socket)
    assert stat.S_ISSOCK(rt.st_mode) and stat.S_IMODE(rt.st_mode) == 0o660
    assert rt.st_gid == grp.getgrnam(GROUP).gr_gid
    assert stat.S_IMODE(adm.st_mode) == 0o600 and adm.st_uid == os.geteuid()


def test_process_outside_group_is_refused_at_connect(grouped_daemon):
    nobody = pwd.getpwnam("nobody")
    assert grp.getgrnam(GROUP).gr_gid not in os.getgrouplist("nobody", nobody.pw_gid)
    for path in (grouped_daemon.socket, grouped_daemon.admin_socket):
        res = _connect_as(path, nobody.pw_uid, nobody.pw_gid, [nobody.pw_gid])
        assert res["connected"] is False and res["errno"] == 13, res  # EACCES


def test_process_in_group_reaches_runtime_but_not_admin(grouped_daemon):
    nobody = pwd.getpwnam("nobody")
    gid = grp.getgrnam(GROUP).gr_gid
    res = _connect_as(grouped_daemon.socket, nobody.pw_uid, nobody.pw_gid, [nobody.pw_gid, gid])
    assert res == {"connected": True, "frame_type": 4, "uid": nobody.pw_uid}  # SETTINGS from the server
    res = _connect_as(grouped_daemon.admin_socket, nobody.pw_uid, nobody.pw_gid, [nobody.pw_gid, gid])
    assert res["connected"] is False and res["errno"] == 13


def test_mutating_admin_rpcs_refused_on_runtime_socket(daemon):
    from tests.support.gc import publish

    with daemon.client() as c:
        report = publish(c, "acl", 1)
        runtime_admin = c.reader  # Admin service on the RUNTIME socket
        with pytest.raises(PermissionDenied, match="admin socket"):
            c.call(runtime_admin.CollectGarbage, pb.CollectGarbageRequest(dry_run=False, target_bytes=1))
        with pytest.raises(PermissionDenied):
            c.call(runtime_admin.DeleteArtifact, pb.DeleteArtifactRequest(key=report.key, force=True))
        with pytest.raises(PermissionDenied):
            c.call(runtime_admin.CollectGarbage, pb.CollectGarbageRequest(dry_run=True))
        # Read-only admin calls are fine there; the artifact is untouched.
        listed = c.call(runtime_admin.ListArtifacts, pb.ListArtifactsRequest())
        assert [a.key for a in listed.artifacts] == [report.key]
    # The CLI pointed at the runtime socket as "admin" gets the same answer.
    out = daemon.cli("gc", "--admin-socket", daemon.socket)
    assert out.returncode == 4 and "PermissionDenied" in out.stderr
    out = daemon.cli("rm", "--admin-socket", daemon.socket, report.key)
    assert out.returncode == 4 and "PermissionDenied" in out.stderr


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def test_no_tcp_listener(daemon):
    inodes = _socket_inodes(daemon.proc.pid)
    assert inodes
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
        listening = [r for r in rows if r[3] == "0A" and r[9] in inodes]  # 0A = LISTEN
        assert listening == [], f"daemon listens on TCP: {listening}"
