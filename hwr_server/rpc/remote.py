"""gRPC handlers of the registry component (hwr_server.remote.remote): Push and
Pull (admin) and PullOnMiss (runtime, the configured remote only).

Each handler streams the transfer's progress (at most one event per
``_PROGRESS_S``), then one ``done``. Push and Pull (admin socket) run the
transfer on a thread of their own. PullOnMiss starts (or joins) the key's
pull, which runs on the pull's own thread (bounded per node and per user,
:mod:`hwr_server.remote.gate`), and only follows it: a call costs no thread
beyond its handler's, which the socket's stream admission counts. A caller
that goes away (cancelled, or gave up on its no-progress bound) frees its
handler thread within ``_PROGRESS_S`` and leaves nothing behind, but does
not stop the transfer: a pull commits whole or leaves nothing, the other
waiters of the key get its outcome, and a later miss of the key finds it
stored (docs/many-nodes.md, "A caller that goes away").
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_server.access import peers
from hwr_server.remote.records import Flight, Progress, ProgressFn, Transfer

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
    """Pull KEY from the configured remote (see Remote.start_pull_missing)."""
    peer = peers.peer_of(context)
    flight = c.remote.start_pull_missing(request.key, owner="anonymous" if peer.uid is None else f"uid {peer.uid}")
    return _follow(flight, context)


def done_pb(t: Transfer) -> pb.TransferDone:
    return pb.TransferDone(key=t.key, reference=t.reference, manifest_digest=t.manifest_digest,
                           bytes_transferred=t.bytes_transferred, layers_transferred=t.layers_transferred,
                           layers_skipped=t.layers_skipped, seconds=t.seconds, already_present=t.already_present,
                           signature_digest=t.signature_digest, signer=t.signer)


def _throttled(events: queue.Queue) -> ProgressFn:
    """A listener that queues at most one progress event per _PROGRESS_S
    (and the last one of a transfer)."""
    last = [0.0]
    lock = threading.Lock()

    def progress(p: Progress) -> None:
        now = time.monotonic()
        with lock:
            if now - last[0] < _PROGRESS_S and p.bytes_done < p.bytes_total:
                return
            last[0] = now
        events.put(("progress", p))

    return progress


def _progress_pb(p: Progress) -> pb.TransferEvent:
    return pb.TransferEvent(progress=pb.TransferProgress(bytes_done=p.bytes_done, bytes_total=p.bytes_total,
                                                         layers_done=p.layers_done, layers_total=p.layers_total))


def _follow(flight: Flight, context: grpc.ServicerContext) -> Iterator[pb.TransferEvent]:
    """Streams a pull that runs elsewhere; leaving stops only the following."""
    events: queue.Queue = queue.Queue()
    listener = _throttled(events)
    flight.join(listener)
    try:
        while not flight.done.is_set():
            try:
                _, value = events.get(timeout=_PROGRESS_S)
            except queue.Empty:
                if not context.is_active():
                    return  # the caller went away; the pull goes on (module docstring)
                continue
            yield _progress_pb(value)
    finally:
        flight.leave(listener)
    yield pb.TransferEvent(done=done_pb(flight.outcome()))


def _stream(work: Callable[[ProgressFn], Transfer], context: grpc.ServicerContext) -> Iterator[pb.TransferEvent]:
    events: queue.Queue = queue.Queue()
    progress = _throttled(events)

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
            yield _progress_pb(value)
        elif kind == "done":
            yield pb.TransferEvent(done=done_pb(value))
            return
        else:
            raise value
