"""Starts the real daemon (``hwr serve``) as a subprocess on temp sockets.

Socket paths live in a short ``/tmp/hwr-*`` directory because a Unix socket
path must fit in 108 bytes and pytest's tmp_path often does not.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import hwr_client
from tests.support.paths import REPO_DIR


def wait_serving(socket: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Blocks until the daemon's health service says SERVING."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode} before serving")
        if os.path.exists(socket):
            try:
                with grpc.insecure_channel(f"unix:{socket}") as ch:
                    resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last = resp.status
            except grpc.RpcError as err:
                last = err.code()
        time.sleep(0.05)
    raise TimeoutError(f"daemon on {socket} not SERVING after {timeout}s (last: {last})")


@dataclasses.dataclass
class Daemon:
    root: str
    socket: str
    admin_socket: str
    log_path: str
    extra_args: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "hwr_client.cli", "serve",
            "--root", self.root, "--socket", self.socket, "--admin-socket", self.admin_socket,
            *self.extra_args,
        ]

    def start(self, *, wait: bool = True) -> "Daemon":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        if wait:
            wait_serving(self.socket, proc=self.proc)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signals the daemon and waits; returns its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> "Daemon":
        self.stop()
        return self.start()

    def client(self) -> hwr_client.Client:
        return hwr_client.connect(self.socket, admin_socket=self.admin_socket)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def cli(self, *args: str, check: bool = False, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Runs ``hwr ARGS`` against this daemon."""
        cmd = [sys.executable, "-m", "hwr_client.cli", *args]
        env = dict(self.env, HWR_SOCKET=self.socket, HWR_ADMIN_SOCKET=self.admin_socket)
        return subprocess.run(cmd, capture_output=True, text=True, env=env, check=check, timeout=timeout)


def make_daemon(tmp_path, *extra_args: str, root: str | None = None, env: dict | None = None) -> Daemon:
    sockdir = tempfile.mkdtemp(prefix="hwr-", dir="/tmp")
    repo = REPO_DIR
    full_env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    d = Daemon(
        root=root or str(tmp_path / "root"),
        socket=os.path.join(sockdir, "hwr.sock"),
        admin_socket=os.path.join(sockdir, "admin.sock"),
        log_path=str(tmp_path / f"daemon-{len(os.listdir(tmp_path))}.log"),
        extra_args=list(extra_args),
        env=full_env,
    )
    d._sockdir = sockdir  # type: ignore[attr-defined]
    return d


def cleanup(d: Daemon) -> None:
    d.kill()
    shutil.rmtree(getattr(d, "_sockdir", ""), ignore_errors=True)
