"""gRPC handlers of the registry component (hwr_server.remote.remote): Push and
Pull (admin) and PullOnMiss (runtime, the configured remote only).

The transfer runs on its own thread and the handler streams its progress
(at most one event per ``_PROGRESS_S``), then one ``done``. A caller that
goes away (cancelled, or gave up on its no-progress bound) frees its
handler thread within ``_PROGRESS_S`` but does not stop the transfer: a
pull commits whole or leaves nothing, the other waiters of the key get its
outcome, and a later miss of the key finds it stored (README "Many nodes",
"A caller that goes away").
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_server.remote.remote import Progress, ProgressFn, Transfer

if TYPE_CHECKING:
    from hwr_server.components import Components

#: Seconds between two progress events of one transfer.
_PROGRESS_S = 0.25


def push(c: Components, request: pb.PushRequest, context: grpc.ServicerContext) -> Iterator[pb.TransferEvent]:
    """Push KEY to REFERENCE; progress, then done (see Remote.push)."""
    return _stream(lambda progress: c.remote.push(request.key, request.reference, progress), context)


def pull(c: Components, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.TransferEvent]:
    """Pull REFERENCE into the store; progress, then done (see Remote.pull)."""
    return _stream(lambda progress: c.remote.pull(request.reference, progress), context)


def pull_on_miss(c: Components, request: pb.PullOnMissRequest,
                 context: grpc.ServicerContext) -> Iterator[pb.TransferEvent]:
    """Pull KEY from the configured remote (see Remote.pull_missing)."""
    return _stream(lambda progress: c.remote.pull_missing(request.key, progress), context)


def done_pb(t: Transfer) -> pb.TransferDone:
    return pb.TransferDone(key=t.key, reference=t.reference, manifest_digest=t.manifest_digest,
                           bytes_transferred=t.bytes_transferred, layers_transferred=t.layers_transferred,
                           layers_skipped=t.layers_skipped, seconds=t.seconds, already_present=t.already_present,
                           signature_digest=t.signature_digest, signer=t.signer)


def _stream(work: Callable[[ProgressFn], Transfer], context: grpc.ServicerContext) -> Iterator[pb.TransferEvent]:
    events: queue.Queue = queue.Queue()
    last = [0.0]
    lock = threading.Lock()

    def progress(p: Progress) -> None:
        now = time.monotonic()
        with lock:
            if now - last[0] < _PROGRESS_S and p.bytes_done < p.bytes_total:
                return
            last[0] = now
        events.put(("progress", p))

    def run() -> None:
        try:
            events.put(("done", work(progress)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the handler's thread
            events.put(("error", exc))

    threading.Thread(target=run, name="hwr-transfer", daemon=True).start()
    while True:
        try:
            kind, value = events.get(timeout=_PROGRESS_S)
        except queue.Empty:
            if not context.is_active():
                return  # the caller went away; the transfer goes on (module docstring)
            continue
        if kind == "progress":
            yield pb.TransferEvent(progress=pb.TransferProgress(
                bytes_done=value.bytes_done, bytes_total=value.bytes_total, layers_done=value.layers_done,
                layers_total=value.layers_total))
        elif kind == "done":
            yield pb.TransferEvent(done=done_pb(value))
            return
        else:
            raise value
