"""Helpers shared by several test modules (moved from tests/server/test_hostile_publications.py)."""

from __future__ import annotations

import threading

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.plan import check_plan
from hwr_client.tensors import iter_payload
from tests.support.daemon import make_daemon

COMMIT = pb.PublishRequest(commit=pb.PublishCommit())


def raw_publish(client, requests, timeout: float = 15.0) -> tuple[StatusCode, str]:
    """Sends ``requests`` on one Publish stream; returns the final status."""
    try:
        for _ in client.runtime.Publish(iter(requests), timeout=timeout):
            pass
    except grpc.RpcError as err:
        return err.code(), err.details()
    return StatusCode.OK, ""


def chunks(plan, tensors, size: int) -> list[pb.PublishRequest]:
    checked = check_plan(plan)
    return [pb.PublishRequest(chunk=pb.PayloadChunk(file_index=fi, offset=off, data=bytes(d)))
            for fi, lay in enumerate(checked.layouts) for off, d in iter_payload(lay, tensors, size)]


StatusCode = grpc.StatusCode


def toml(values: dict) -> str:
    return "".join(f"{k} = {v!r}\n" if not isinstance(v, str) else f'{k} = "{v}"\n' for k, v in values.items())


def daemon_rss_mib(daemon) -> int:
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))


def held_stream(client, reqs, release: threading.Event, timeout: float = 15.0):
    """A Publish call that sends ``reqs`` then nothing until ``release``."""

    def gen():
        yield from reqs
        release.wait(timeout)

    return client.runtime.Publish(gen(), timeout=timeout)


def start_with(tmp_path, name: str, values: dict):
    conf = tmp_path / f"{name}.toml"
    conf.write_text(toml(values))
    return make_daemon(tmp_path, "--config", str(conf)).start()
