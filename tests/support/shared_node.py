"""A daemon shared by two users: root (the test, and the node's own workers)
and ``nobody`` (the attacker), as on a node where workers of several users
reach one runtime socket through its group.

The daemon runs as root; its runtime socket (and the credentials socket next
to it) is group ``nogroup``, and the socket's directory is opened to others
(mkdtemp made it 0700), so ``nobody`` reaches it exactly as a worker in the
socket's group would. Children run as ``nobody`` through
:mod:`tests.support.privdrop`, and use ``hwr_client`` for real (their
credentials handshake names uid 65534).
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess

from hwr_client.core._proto import hwr_pb2 as pb
from tests.support.privdrop import popen_python_as, run_python_as


def toml(fields: dict) -> str:
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())


def served_to_nobody(make_daemon_fixture, tmp_path, config: dict | None = None, *args: str, root: str | None = None):
    """A started daemon (the fixture's factory) whose runtime socket nobody
    may use; ``root`` (a store nobody can reach, for leases) or one under
    ``tmp_path`` (0700: nobody maps nothing from it)."""
    extra = list(args)
    if config:
        path = tmp_path / f"shared-{len(os.listdir(tmp_path))}.toml"
        path.write_text(toml(config))
        extra += ["--config", str(path)]
    d = make_daemon_fixture(*extra, "--socket-group", "nogroup", start=False, root=root)
    os.chmod(os.path.dirname(d.socket), 0o755)  # the socket's own mode and group decide
    return d.start()


def nobody_ids() -> tuple[int, int]:
    user = pwd.getpwnam("nobody")
    return user.pw_uid, user.pw_gid


def popen_nobody(code: str, *argv: str, env: dict | None = None) -> subprocess.Popen:
    """``python -c code argv...`` as nobody, stdin and stdout piped (text)."""
    uid, gid = nobody_ids()
    return popen_python_as(uid, gid, ["-c", code, *argv], env=env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_nobody(code: str, *, env: dict | None = None, timeout: float = 120.0) -> dict:
    """Runs ``code`` as nobody; its last stdout line, parsed as JSON."""
    uid, gid = nobody_ids()
    r = run_python_as(uid, gid, code, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def finish(*procs: subprocess.Popen | None) -> None:
    """Closes each child's stdin (it exits) and reaps it; kills what lingers."""
    for p in procs:
        if p is not None and p.poll() is None and p.stdin is not None:
            try:
                p.stdin.close()
            except OSError:
                pass
    for p in procs:
        if p is None:
            continue
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def lookups(d, key: str, n: int, *, timeout: float) -> list[str]:
    """``n`` Lookups of ``key`` by root's client; each outcome ("OK" or the
    error class), every call bounded by ``timeout``."""
    out = []
    with d.client() as c:
        for _ in range(n):
            try:
                c.call(c.runtime.Lookup, pb.LookupRequest(key=key), timeout=timeout)
                out.append("OK")
            except Exception as exc:  # noqa: BLE001 - counted: the landed daemon failed them
                out.append(type(exc).__name__)
    return out
