"""A raw handoff-transport publication, driven message by message (what a
buggy or hostile client would do), for the handoff tests."""

from __future__ import annotations

import os
import queue
import time

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.plan import check_plan, to_proto
from hwr_client.handoff import receive_descriptor, write_file
from hwr_client.tensors import build_plan


class RawHandoff:
    """Opens a Publish stream asking for the handoff transport; the caller
    then gets descriptors, writes, and sends ``written``/``commit`` itself.

    Attributes:
        accepted: the daemon's answer to the plan.
        checked: the checked plan (layouts).
    """

    def __init__(self, client, ident: dict, tensors, *, ordered: bool = True, file_target_bytes: int = 1,
                 timeout: float = 30.0):
        self.client = client
        self.tensors = tensors
        plan = build_plan(ident, tensors, ordered=ordered, file_target_bytes=file_target_bytes)
        self.checked = check_plan(plan)
        msg = to_proto(plan)
        msg.file_handoff = True
        self._q: queue.Queue = queue.Queue()
        self._q.put(pb.PublishRequest(plan=msg))
        self.call = client.runtime.Publish(iter(self._q.get, None), timeout=timeout)
        first = next(self.call)
        assert first.WhichOneof("kind") == "accepted", first
        self.accepted = first.accepted

    @property
    def token(self) -> str:
        return self.accepted.handoff_token

    def fd(self, index: int) -> int:
        return receive_descriptor(self.client.socket, self.token, index)

    def write(self, index: int, *, close: bool = True) -> int:
        """Writes file ``index`` as the real client does; returns the fd
        (closed unless ``close`` is False)."""
        fd = self.fd(index)
        write_file(fd, self.checked.layouts[index], self.tensors)
        if close:
            os.close(fd)
        return fd

    def send(self, request: pb.PublishRequest) -> None:
        self._q.put(request)

    def written(self, index: int, *, complete: bool = True, nbytes: int | None = None) -> None:
        size = self.checked.layouts[index].data_size if nbytes is None else nbytes
        self.send(pb.PublishRequest(written=pb.FileWritten(file_index=index, data_bytes=size, complete=complete)))

    def commit(self) -> tuple[grpc.StatusCode, str, pb.PublishEvent | None]:
        """Sends the commit; returns (status code, details, last event)."""
        self.send(pb.PublishRequest(commit=pb.PublishCommit()))
        return self.result()

    def result(self) -> tuple[grpc.StatusCode, str, pb.PublishEvent | None]:
        last = None
        try:
            for ev in self.call:
                last = ev
        except grpc.RpcError as err:
            return err.code(), err.details() or "", last
        finally:
            self._q.put(None)
        return grpc.StatusCode.OK, "", last

    def cancel(self) -> None:
        self.call.cancel()
        self._q.put(None)


def wait_until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
