"""Publishing CPU tensors to the node daemon (DESIGN §5).

One bidirectional stream: the plan goes first; the daemon answers with the
layout (or "already published", or an error: conflict, capacity, bad plan)
BEFORE any payload is sent; then the payload; then the commit.

The payload takes one of two transports. **Handoff** (the default where the
daemon's handoff socket is reachable): the client receives each staging
file's descriptor from the daemon (:mod:`hwr_client.handoff`), writes the
file's data region into it straight from the tensors (one copy, by
``pwrite``, into the page cache), closes it and sends ``written``; the
daemon seals, hashes and fsyncs each file while the next one is written.
**Messages** (otherwise, or ``handoff=False``): messages of about 4 MiB
(small tensors and padding coalesced, large tensors sliced) from a
generator that grpc pulls from its own thread, so at most a few messages
are ever materialized: memory does not grow with the artifact.

Unordered mode writes the files in a shuffled order (messages: shuffled
chunks); it exists for producers that cannot write sequentially.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import random
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import grpc
import torch

from hwr_client.channel import RuntimeChannel, quiesce
from hwr_client import handoff as _handoff
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.defaults import HANDOFF_SOCKET_SUFFIX
from hwr_client.core.errors import Aborted, Internal, InvalidArgument, from_rpc_error
from hwr_client.core.identity import Identity
from hwr_client.core.manifest import Manifest
from hwr_client.core.plan import FILE_TARGET_BYTES, CheckedPlan, PlanSpec, check_plan, to_proto
from hwr_client.tensors import build_plan, iter_payload, spec_of

#: Target payload message size.
MESSAGE_BYTES = 4 * 1024 * 1024
#: Full name of the Publish rpc (the stub's method, with our own serializer).
PUBLISH_METHOD = "/hwr.v1.Runtime/Publish"


@dataclasses.dataclass(frozen=True)
class PublishReport:
    """What a publication did."""

    key: str
    manifest: Manifest
    bytes_written: int  # payload bytes the publication wrote (0 when already published)
    already_published: bool
    seconds: float
    transport: str = ""  # "handoff", "messages", or "" when already published


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A coalesced payload message: file, data-region offset, byte pieces."""

    file_index: int
    offset: int
    parts: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)

    def request(self) -> bytes:
        """The serialized ``PublishRequest{chunk}``, encoded by hand.

        Why: upb's SerializeToString of a freshly built message holding a
        4 MiB bytes field takes ~20 ms (measured: ~200 MB/s, a transport
        limit far below the disk), while this is one copy of the payload.
        The bytes are standard protobuf wire format; tests decode them with
        ``PublishRequest.FromString``.
        """
        n = self.nbytes
        inner = []  # proto3 omits fields holding their default (0, empty)
        if self.file_index:
            inner += [_key(1, 0), _varint(self.file_index)]
        if self.offset:
            inner += [_key(2, 0), _varint(self.offset)]
        if n:
            inner += [_key(3, 2), _varint(n)]
        inner_len = sum(len(x) for x in inner) + n
        return b"".join([_key(2, 2), _varint(inner_len), *inner, *self.parts])


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _serialize(request: pb.PublishRequest | bytes) -> bytes:
    """Request serializer of the Publish stream: pre-encoded chunks pass through."""
    return request if isinstance(request, bytes) else request.SerializeToString()


def iter_pieces(checked: CheckedPlan, tensors: Mapping[str, torch.Tensor], message_bytes: int) -> Iterator[_Piece]:
    """Payload of every file, in order, as messages of exactly
    ``message_bytes`` (the last of each file may be shorter); views only,
    bytes are materialized when sent.

    Why exactly: a file's data region is contiguous, so a message may end
    inside a tensor. Messages of one size let the allocator hand the same
    buffer back for every message; messages that stopped at tensor edges
    varied in size, and each one page-faulted a fresh buffer (measured on
    the 926-tensor reference DiT: 0.45 CPU-s/GB to build the messages
    against 0.16 with 40 large tensors).
    """
    for fi, lay in enumerate(checked.layouts):
        parts: list[memoryview] = []
        start = size = 0
        for off, data in iter_payload(lay, tensors, message_bytes):
            while data:
                if not parts:
                    start = off
                take = data[: message_bytes - size]
                parts.append(take)
                size += len(take)
                off, data = off + len(take), data[len(take):]
                if size == message_bytes:
                    yield _Piece(fi, start, tuple(parts))
                    parts, size = [], 0
        if parts:
            yield _Piece(fi, start, tuple(parts))


def _check_tensors(checked: CheckedPlan, tensors: Mapping[str, torch.Tensor]) -> None:
    """Fails before the stream opens on what would fail inside grpc's thread."""
    for lay in checked.layouts:
        for spec in lay.tensors:
            t = tensors[spec.name]
            if not isinstance(t, torch.Tensor):
                raise InvalidArgument(f"tensor {spec.name!r}: expected a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise InvalidArgument(f"tensor {spec.name!r} on {t.device}: publication takes CPU tensors")
            if spec_of(spec.name, t) != spec:
                raise InvalidArgument(f"tensor {spec.name!r}: changed while publishing")


def _check_layout(checked: CheckedPlan, accepted: pb.PublishAccepted) -> None:
    if len(accepted.files) != len(checked.layouts):
        raise Internal(f"publish {accepted.key[:12]}: daemon sent {len(accepted.files)} layouts for "
                       f"{len(checked.layouts)} files")
    for i, (lay, got) in enumerate(zip(checked.layouts, accepted.files)):
        if got.data_size != lay.data_size or tuple(got.tensor_offsets) != lay.tensor_offsets:
            raise Internal(f"publish {accepted.key[:12]}: file {i} layout differs between daemon and client "
                           "(version mismatch?)")


_COMMIT = pb.PublishRequest(commit=pb.PublishCommit())
#: How often the caller looks at the call while it waits for grpc's thread, seconds.
_POLL_S = 0.05


class _Requests:
    """The request stream: the plan, then what the caller puts: the message
    payload (``chunks``: produced here, in grpc's thread), handoff messages,
    the commit. grpc pulls it from its own thread."""

    def __init__(self, plan: pb.PublishPlan, pieces: Callable[[], Iterator[_Piece]],
                 progress: Callable[[int, int], None] | None, total: int, cancel: threading.Event | None):
        self.plan = plan
        self.pieces = pieces
        self.progress = progress
        self.total = total
        self.cancel = cancel
        self.sent = 0
        self.chunks_sent = threading.Event()
        self._q: queue.Queue = queue.Queue()
        self.consumer: threading.Thread | None = None  # grpc's thread that pulls this iterator

    def chunks(self) -> None:
        self._q.put("chunks")

    def send(self, request: pb.PublishRequest) -> None:
        self._q.put(request)

    def stop(self) -> None:
        self._q.put(None)  # the call ended: let a waiting generator finish

    def __iter__(self) -> Iterator[pb.PublishRequest | bytes]:
        self.consumer = threading.current_thread()
        yield pb.PublishRequest(plan=self.plan)
        while (item := self._q.get()) is not None:
            if isinstance(item, str):
                for piece in self.pieces():
                    if self.cancel is not None and self.cancel.is_set():
                        break  # the caller sees it and cancels the call; never a commit
                    yield piece.request()
                    self.sent += piece.nbytes
                    if self.progress is not None:
                        self.progress(self.sent, self.total)
                self.chunks_sent.set()
            else:
                yield item


def _handoff_reachable(socket: str) -> bool:
    """The handoff socket exists and this process may connect to it (a Unix
    socket takes a connection from whoever may write the file)."""
    path = socket + HANDOFF_SOCKET_SUFFIX
    return os.path.exists(path) and os.access(path, os.W_OK)


def _send_handed(client: RuntimeChannel, reqs: _Requests, events: Any, checked: CheckedPlan, token: str,
                 tensors: Mapping[str, torch.Tensor], order: list[int]) -> int:
    """The handoff payload: each file's descriptor from the daemon, written,
    closed, reported; returns the data bytes written."""
    done = 0

    def report(i: int, nbytes: int, complete: bool) -> None:
        reqs.send(pb.PublishRequest(written=pb.FileWritten(file_index=i, data_bytes=nbytes, complete=complete)))

    for i in order:
        if events.done():
            return done  # the daemon ended the call: its status says why
        lay = checked.layouts[i]
        fd = _handoff.receive_descriptor(client.socket, token, i)
        try:
            def progress(nbytes: int, i: int = i) -> None:
                report(i, nbytes, False)  # also keeps the publication within the daemon's idle deadline
                if reqs.progress is not None:
                    reqs.progress(done + nbytes, reqs.total)

            cancel = reqs.cancel
            cancelled = cancel.is_set if cancel is not None else (lambda: False)
            written = _handoff.write_file(fd, lay, tensors, progress=progress, cancelled=cancelled)
        finally:
            # Closed before `written` is sent: the daemon seals the file only
            # once no writable descriptor of it is left anywhere.
            os.close(fd)
        done += written
        report(i, written, True)
        if reqs.progress is not None:
            reqs.progress(done, reqs.total)
    return done


def _wait_chunks(reqs: _Requests, events: Any) -> None:
    """Waits until grpc's thread sent the message payload, the call ended,
    or the caller cancelled."""
    while not reqs.chunks_sent.wait(_POLL_S):
        if events.done() or (reqs.cancel is not None and reqs.cancel.is_set()):
            return


def publish(
    client: RuntimeChannel,
    identity: Identity | Mapping | str,
    tensors: Mapping[str, torch.Tensor],
    *,
    blocks: Sequence[Sequence[str]] | None = None,
    ordered: bool = True,
    file_target_bytes: int = FILE_TARGET_BYTES,
    progress: Callable[[int, int], None] | None = None,
    seed: int | None = None,
    handoff: bool = True,
    before_commit: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
    annotations: Mapping[str, Any] | None = None,
) -> PublishReport:
    """Publishes a mapping of CPU tensors as a final-layout artifact.

    Args:
        client: a connected :class:`hwr_client.Client` (any
            :class:`~hwr_client.channel.RuntimeChannel`).
        identity: Identity, its dict document or JSON text.
        tensors: name -> CPU tensor.
        blocks: name groups in execution order; None derives them from names
            (``blocks.N.``, ``layers.N.``, ``transformer_blocks.N.``).
        ordered: write strictly sequentially (fastest: the daemon hashes
            file i while file i+1 is written). False writes the files (on
            the message transport: the chunks) in a shuffled order.
        file_target_bytes: split block files at about this size.
        progress: called with (bytes written, total bytes) as the payload goes.
        seed: shuffle seed for unordered mode (None: random).
        handoff: use the handoff transport where the daemon offers it (see
            the module docstring); False always sends messages.
        before_commit: called once every payload byte is written and before
            the commit is sent; whatever it raises ends the call with
            nothing published, and is re-raised.
        cancel: set from any thread to end the publication before its
            commit (nothing published, the staging removed): Aborted.
        annotations: an opaque ``{"schema_version": 1, "data": {...}}``
            object stored in the manifest (:mod:`hwr_client.core.annotations`).

    Returns:
        PublishReport with the identity key and the stored manifest.

    Raises:
        InvalidArgument: bad tensors or plan. Aborted: the same key is being
        published by someone else, or ``cancel`` was set. ResourceExhausted:
        no space. FailedPrecondition: a declared digest mismatched, or a
        staging file was still open for writing when reported written.
        Unavailable: no daemon.

    Example:
        >>> report = publish(client, identity, {"blocks.0.w": w})  # doctest: +SKIP
        >>> report.key                                             # doctest: +SKIP
    """
    t0 = time.monotonic()
    plan = build_plan(identity, tensors, blocks=blocks, ordered=ordered, file_target_bytes=file_target_bytes)
    if annotations is not None:
        plan = dataclasses.replace(plan, annotations=annotations)
    return publish_plan(client, plan, tensors, progress=progress, seed=seed, started=t0, handoff=handoff,
                        before_commit=before_commit, cancel=cancel)


def publish_plan(
    client: RuntimeChannel,
    plan: PlanSpec,
    tensors: Mapping[str, torch.Tensor],
    *,
    progress: Callable[[int, int], None] | None = None,
    seed: int | None = None,
    started: float | None = None,
    handoff: bool = True,
    before_commit: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
) -> PublishReport:
    """Publishes ``tensors`` laid out as ``plan`` says: for a caller that
    chose the files itself (an integration keeping its producer's sharding).

    Args:
        client: a connected :class:`hwr_client.Client`.
        plan: the plan (:func:`hwr_client.tensors.build_plan` makes one);
            every planned tensor must be in ``tensors`` with its dtype and shape.
        tensors: name -> CPU tensor.
        progress: called with (bytes written, total bytes) as the payload goes.
        seed: shuffle seed for unordered mode (None: random).
        started: ``time.monotonic()`` at which the report's clock starts.
        handoff, before_commit, cancel: as :func:`publish`.

    Returns and Raises: as :func:`publish`.
    """
    t0 = time.monotonic() if started is None else started
    ordered = plan.ordered
    missing = [t.name for f in plan.files for t in f.tensors if t.name not in tensors]
    if missing:
        raise InvalidArgument(f"publication: planned tensors {missing[:5]} are not in the tensor mapping")
    checked = check_plan(plan)
    _check_tensors(checked, tensors)
    msg = to_proto(plan)
    msg.file_handoff = handoff and _handoff_reachable(client.socket)
    accepted_max = [0]

    def pieces() -> Iterator[_Piece]:
        size = min(MESSAGE_BYTES, accepted_max[0] or MESSAGE_BYTES)
        if ordered:
            return iter_pieces(checked, tensors, size)
        # Descriptors only (views, no copies): shuffling costs no memory.
        shuffled = list(iter_pieces(checked, tensors, size))
        random.Random(seed).shuffle(shuffled)
        return iter(shuffled)

    # Progress counts payload (data-region) bytes: headers are the daemon's to write.
    reqs = _Requests(msg, pieces, progress, sum(lay.data_size for lay in checked.layouts), cancel)
    transport, sent = "", 0
    try:
        stream = client.channel.stream_stream(
            PUBLISH_METHOD, request_serializer=_serialize, response_deserializer=pb.PublishEvent.FromString
        )
        events = stream(iter(reqs))
        try:
            first = next(events)
            if first.WhichOneof("kind") != "accepted":
                raise Internal("publish: the daemon's first answer was not `accepted`")
            accepted = first.accepted
            _check_layout(checked, accepted)
            accepted_max[0] = int(accepted.max_chunk_bytes)
            if not accepted.already_published:
                transport, sent = _send_payload(client, reqs, events, checked, accepted, tensors, ordered, seed)
                if not events.done():
                    if cancel is not None and cancel.is_set():
                        raise Aborted(f"publish {accepted.key[:12]}: cancelled before the commit; nothing was "
                                      "published")
                    if before_commit is not None:
                        before_commit()
            reqs.send(_COMMIT)
            last = next(events)
            # The daemon ends the call after `committed`: wait for its status
            # so no grpc thread still works on this call when we return.
            for extra in events:
                raise Internal(f"publish: the daemon sent {extra.WhichOneof('kind')!r} after `committed`")
        except StopIteration:
            raise Internal("publish: the daemon closed the stream without an answer") from None
        except BaseException:
            events.cancel()  # nothing is published: the daemon removes the staging at once
            raise
    except grpc.RpcError as err:
        raise from_rpc_error(err) from None
    except _handoff.Cancelled:
        raise Aborted(f"publish {plan.identity.key[:12]}: cancelled while writing; nothing was published") from None
    finally:
        reqs.stop()
        quiesce(reqs.consumer)  # see quiesce: no grpc thread may outlive the call
    done = last.committed
    manifest = Manifest.from_json(done.manifest_json, what=f"artifact {done.key[:12]} manifest")
    if done.key != plan.identity.key:
        raise Internal(f"publish: daemon committed {done.key[:12]}, expected {plan.identity.key[:12]}")
    return PublishReport(done.key, manifest, int(done.bytes_written), bool(done.already_published),
                         time.monotonic() - t0, transport if not done.already_published else "")


def _send_payload(client: RuntimeChannel, reqs: _Requests, events: Any, checked: CheckedPlan,
                  accepted: pb.PublishAccepted, tensors: Mapping[str, torch.Tensor], ordered: bool,
                  seed: int | None) -> tuple[str, int]:
    """The payload on the transport the daemon granted; returns (transport, bytes)."""
    if not accepted.handoff_token:
        reqs.chunks()
        _wait_chunks(reqs, events)
        return "messages", reqs.sent
    order = list(range(len(checked.layouts)))
    if not ordered:
        random.Random(seed).shuffle(order)
    return "handoff", _send_handed(client, reqs, events, checked, accepted.handoff_token, tensors, order)


__all__ = ["MESSAGE_BYTES", "PublishReport", "publish", "publish_plan"]
