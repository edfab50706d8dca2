"""Processes for ``hwr demo`` and the benches: a daemon of their own
(:func:`daemon_for`) and real worker processes (:class:`WorkerProcesses`).

Example:
    >>> with daemon_for(args, workdir) as socket:                  # doctest: +SKIP
    ...     rows = WorkerProcesses().group(ckpt, "preferred", socket, 3, device="cpu")
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import grpc

from hwr_client.cli.pss import process_pss
from hwr_client.core.errors import InvalidArgument


def _wait_serving(socket: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Polls the daemon's health service until it reports SERVING."""
    # grpc_health is only needed here: kept off the CLI parser's imports.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InvalidArgument(f"demo daemon exited with {proc.returncode} before serving")
        if os.path.exists(socket):
            try:
                with grpc.insecure_channel(f"unix:{socket}") as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError:
                pass
        time.sleep(0.05)
    raise InvalidArgument(f"demo daemon on {socket}: not serving after {timeout:.0f}s")


@contextlib.contextmanager
def daemon_for(args: argparse.Namespace, workdir: str) -> Iterator[str]:
    """Yields the runtime socket: ``args.socket``, or that of a daemon of our
    own on ``workdir/root`` that is stopped on exit (nothing is left running).

    Args:
        args: needs ``socket`` (None: start a daemon) and receives
            ``admin_socket`` when a daemon is started.
        workdir: holds the daemon's root and log; also its source root, so
            checkpoints under it are hashed once per node.

    Raises:
        InvalidArgument: the daemon exited or did not serve in time.
    """
    if args.socket:
        yield args.socket
        return
    sockdir = tempfile.mkdtemp(prefix="hwr-demo-", dir="/tmp")  # socket paths must fit 108 bytes
    sock, admin = os.path.join(sockdir, "hwr.sock"), os.path.join(sockdir, "admin.sock")
    log_path = os.path.join(workdir, "daemon.log")
    # The checkpoints live under workdir: as a source root, the daemon hashes
    # each canonical file once and later workers get cached content ids.
    cmd = [sys.executable, "-m", "hwr_client.cli", "serve", "--root", os.path.join(workdir, "root"),
           "--socket", sock, "--admin-socket", admin, "--source-root", workdir]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_serving(sock, proc)
        args.admin_socket = admin
        yield sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                # SIGTERM lets in-flight calls finish and the daemon stop
                # cleanly; SIGKILL only when it hangs, so nothing is left.
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(sockdir, ignore_errors=True)


class WorkerProcesses:
    """Worker processes (``python -m dlo_runtime.worker --hold``) that print
    one JSON line and hold their model until released.

    Call :meth:`kill_all` in a ``finally``: a failed run leaves none behind.
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(self, checkpoint: str, mode: str, socket: str | None, *, device: str, offload: bool = True,
              forward: bool = True, extra: tuple[str, ...] = ()) -> subprocess.Popen:
        """Starts one worker on the tiny-dit ``checkpoint`` in ``mode``
        (``disabled``, ``preferred``, ``required``); does not wait."""
        cmd = [sys.executable, "-m", "dlo_runtime.worker", "--contract", "tiny-dit", "--checkpoint", checkpoint,
               "--mode", mode, "--device", device, "--hold", *extra]
        if forward:
            cmd.append("--forward")
        if socket:
            cmd += ["--socket", socket]
        if not offload:
            cmd.append("--no-offload")
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        proc.t0 = time.perf_counter()  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    @staticmethod
    def result(proc: subprocess.Popen) -> dict[str, Any]:
        """Waits for the worker's JSON line; adds ``wall_s`` since spawn.

        Raises:
            InvalidArgument: the worker exited before reporting.
        """
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            proc.wait()
            raise InvalidArgument(f"worker pid {proc.pid} exited with {proc.returncode} before reporting; see its stderr above")
        out = json.loads(line)
        out["wall_s"] = round(time.perf_counter() - proc.t0, 3)  # type: ignore[attr-defined]
        return out

    def group(self, checkpoint: str, mode: str, socket: str | None, n: int, *,
              measure: Callable[[int], dict[str, Any]] | None = None, **kw: Any) -> list[dict[str, Any]]:
        """Starts ``n`` workers at once; returns their results with PSS (and
        ``measure(pid)``, if given) read while all of them are still alive;
        then releases them."""
        procs = [self.spawn(checkpoint, mode, socket, **kw) for _ in range(n)]
        results = [self.result(p) for p in procs]
        for r, p in zip(results, procs):
            r.update(process_pss(p.pid))
            if measure is not None:
                r.update(measure(p.pid))
        for p in procs:
            self.release(p)
        return results

    def release(self, proc: subprocess.Popen) -> None:
        """Lets one worker exit (closes its stdin); kills it after 60 s."""
        if proc.stdin:
            proc.stdin.close()  # the worker exits when its stdin closes
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill_all(self) -> None:
        """Kills every worker still running (the cleanup of a failed run)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
