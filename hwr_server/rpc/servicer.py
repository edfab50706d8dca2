"""The gRPC servicers: thin adapters from rpcs to the daemon's components.

Each rpc is one line that hands (components, request, context) to the
handler of its concept (``rpc_store``, ``rpc_leases``, ``rpc_sources``,
``rpc_gc``, ``rpc_stats``, ``rpc_registration``). Handlers parse and
validate the request, call the component, and build the reply; they raise
:mod:`hwr_client.core.errors` classes. This module converts those into gRPC statuses in ONE place
(:func:`_abort`), so no handler ever touches status codes.

The same two servicer classes serve both sockets; on the runtime socket
(``admin=False``) the mutating admin calls answer PERMISSION_DENIED.

Every client stream (Session, Publish), and PullOnMiss (one request, but a
reply stream that holds its thread for the whole pull), passes the socket's
:class:`~hwr_server.access.admission.StreamAdmission` at handler entry, before its
first message is read: over its peer's cap or the socket's total it answers
RESOURCE_EXHAUSTED at once, and a stream whose first message does not come
in time is cancelled (see :mod:`hwr_server.access.admission`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from hwr_client.core._proto import hwr_pb2_grpc as pb_grpc
from hwr_client.core.errors import (
    REASON_METADATA, HwrError, InvalidArgument, PermissionDenied, Unavailable, status_code_of,
)
from hwr_server.access import peers
from hwr_server.access.admission import StreamAdmission
from hwr_server.logtext import untrusted
from hwr_server.rpc import gc as rpc_gc
from hwr_server.rpc import leases as rpc_leases
from hwr_server.rpc import registration as rpc_registration
from hwr_server.rpc import remote as rpc_remote
from hwr_server.rpc import resolve_lease as rpc_resolve_lease
from hwr_server.rpc import sources as rpc_sources
from hwr_server.rpc import stats as rpc_stats
from hwr_server.rpc import store as rpc_store

if TYPE_CHECKING:
    from hwr_server.components import Components

log = logging.getLogger(__name__)

#: Admin rpcs that change the store; only served on the admin socket.
MUTATING_ADMIN_RPCS = frozenset({"DeleteArtifact", "CollectGarbage", "VerifyArtifact", "ForgetSource", "Push", "Pull"})

#: A handler: (components, request or request iterator, context) -> reply,
#: or an iterator of replies for a streaming rpc; a scoped one also takes
#: ``admin=`` (see _handler). Requests and replies are protobuf messages of
#: many types; the handlers' own signatures name them.
Handler = Callable[..., Any]


class _Undecodable:
    """What the request deserializer hands the handler for bytes that do not
    parse as the rpc's request message (e.g. a string field that is not valid
    UTF-8). gRPC's own deserializer failure answers INTERNAL before any
    handler runs; this lets the handler answer INVALID_ARGUMENT naming the
    rpc instead."""

    __slots__ = ("message_type", "error")

    def __init__(self, message_type: str, error: str):
        self.message_type = message_type
        self.error = error

    def refusal(self, rpc: str) -> InvalidArgument:
        return InvalidArgument(f"{rpc}: the request is not a valid {self.message_type} message ({self.error}); "
                               "expected a protobuf message whose strings are valid UTF-8")


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    message_type = getattr(getattr(deserializer, "__self__", None), "__name__", "request")

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(message_type, str(exc) or "cannot parse")

    return deserialize


def _decoded(rpc: str, request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise request.refusal(rpc)
    return request


def _decoded_stream(rpc: str, requests: Iterator[Any]) -> Iterator[Any]:
    for request in requests:
        yield _decoded(rpc, request)


class _TolerantServer:
    """Stands in for the grpc server while the generated ``add_*_to_server``
    registers a service: the same method handlers, each with its request
    deserializer wrapped by :func:`_tolerant`."""

    def __init__(self, server: grpc.Server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        # Rebuilt from the method handlers in add_registered_method_handlers,
        # which the generated code (grpcio-tools >= 1.62, checked in) calls
        # right after this; code generated without it would register no
        # service at all, which every daemon test would show at once.
        pass

    def add_registered_method_handlers(self, service: str, method_handlers: dict[str, Any]) -> None:
        wrapped = {name: h._replace(request_deserializer=_tolerant(h.request_deserializer))
                   for name, h in method_handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        self._server.add_registered_method_handlers(service, wrapped)


def _abort(context: grpc.ServicerContext, rpc: str, exc: BaseException) -> None:
    if isinstance(exc, HwrError):
        log.info("%s failed: %s: %s", rpc, type(exc).__name__, untrusted(exc))
        if exc.reason:
            # The client turns it back into the same subclass (from_rpc_error).
            context.set_trailing_metadata(((REASON_METADATA, exc.reason),))
        context.abort(status_code_of(exc), str(exc))
    log.exception("%s failed with an unexpected error", rpc)
    context.abort(grpc.StatusCode.INTERNAL, f"{rpc}: internal error: {type(exc).__name__}: {exc}")


def _handler(func: Handler, rpc: str, *, streaming: bool = False, replies: bool = False,
             admitted: bool = False, scoped: bool = False) -> Callable[..., Any]:
    """Builds the servicer method of ``rpc`` that calls ``func``: a client
    stream with ``streaming``, one request and a reply stream with
    ``replies`` (the transfers; ``admitted``: counted by the socket's stream
    admission like a client stream), else unary. A ``scoped`` unary handler
    is told which socket it serves (``admin=``): its answer depends on the
    caller there (:mod:`hwr_server.access.views`)."""
    mutating = rpc in MUTATING_ADMIN_RPCS

    def check(self: _Base) -> None:
        if not self.ready():
            raise Unavailable(f"{rpc}: the daemon is still recovering its store; retry shortly")
        if mutating and not self.admin:
            raise PermissionDenied(f"{rpc}: only served on the admin socket; use `--admin-socket` or HWR_ADMIN_SOCKET")

    if streaming:

        def stream(self: _Base, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                check(self)
                peer = peers.peer_of(context)
                # Counted before the first read: a refused stream frees its
                # thread here, and an admitted one must send in time.
                with self.admission.admitted(peer, rpc, context):
                    requests = self.admission.first_message_deadline(_decoded_stream(rpc, request), context,
                                                                     peer, rpc)
                    yield from func(self.components, requests, context)
            except Exception as exc:  # noqa: BLE001 - translated, never swallowed
                if isinstance(exc, grpc.RpcError) or context.code() is not None:
                    raise
                _abort(context, rpc, exc)

        stream.__name__ = rpc
        return stream

    if replies:

        def reply_stream(self: _Base, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                check(self)
                if not admitted:
                    yield from func(self.components, _decoded(rpc, request), context)
                    return
                # Holds a server thread for as long as the transfer runs, like
                # a client stream: counted against the same caps, at entry.
                with self.admission.admitted(peers.peer_of(context), rpc, context):
                    yield from func(self.components, _decoded(rpc, request), context)
            except Exception as exc:  # noqa: BLE001 - translated, never swallowed
                if isinstance(exc, grpc.RpcError) or context.code() is not None:
                    raise
                _abort(context, rpc, exc)

        reply_stream.__name__ = rpc
        return reply_stream

    def unary(self: _Base, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            check(self)
            if scoped:
                return func(self.components, _decoded(rpc, request), context, admin=self.admin)
            return func(self.components, _decoded(rpc, request), context)
        except Exception as exc:  # noqa: BLE001 - translated, never swallowed
            # context.abort raises an Exception subclass; let it through.
            if context.code() is not None:
                raise
            _abort(context, rpc, exc)

    unary.__name__ = rpc
    return unary


class _Base:
    """State shared by both servicers.

    Args:
        components: the daemon's components (built before any socket binds).
        ready: False until recovery finished; rpcs answer UNAVAILABLE until then.
        admin: True on the admin socket.
        admission: the stream caps of this socket.
    """

    def __init__(self, components: Components, *, ready: Callable[[], bool], admin: bool,
                 admission: StreamAdmission):
        self.components = components
        self.ready = ready
        self.admin = admin
        self.admission = admission


class RuntimeServicer(_Base, pb_grpc.RuntimeServicer):
    """hwr.v1.Runtime: what workers call (the runtime socket, mode 0660)."""

    Publish = _handler(rpc_store.publish, "Publish", streaming=True)
    Lookup = _handler(rpc_store.lookup, "Lookup")
    ReportCorruption = _handler(rpc_store.report_corruption, "ReportCorruption")
    Session = _handler(rpc_leases.session, "Session", streaming=True)
    AcquireLease = _handler(rpc_leases.acquire, "AcquireLease")
    ReleaseLease = _handler(rpc_leases.release, "ReleaseLease")
    ResolveSources = _handler(rpc_sources.resolve, "ResolveSources")
    AdmitRegistration = _handler(rpc_registration.admit, "AdmitRegistration")
    ReportRegistrationChunk = _handler(rpc_registration.report_chunk, "ReportRegistrationChunk")
    ReleaseRegistration = _handler(rpc_registration.release, "ReleaseRegistration")
    PullOnMiss = _handler(rpc_remote.pull_on_miss, "PullOnMiss", replies=True, admitted=True)
    ResolveLease = _handler(rpc_resolve_lease.resolve_lease, "ResolveLease")


class AdminServicer(_Base, pb_grpc.AdminServicer):
    """hwr.v1.Admin: what operators call; mutating calls only on the admin socket."""

    ListArtifacts = _handler(rpc_store.list_artifacts, "ListArtifacts", scoped=True)
    InspectArtifact = _handler(rpc_store.inspect, "InspectArtifact", scoped=True)
    VerifyArtifact = _handler(rpc_store.verify, "VerifyArtifact")
    DeleteArtifact = _handler(rpc_store.delete, "DeleteArtifact")
    ListLeases = _handler(rpc_leases.list_leases, "ListLeases", scoped=True)
    CollectGarbage = _handler(rpc_gc.collect, "CollectGarbage")
    GetStats = _handler(rpc_stats.get_stats, "GetStats")
    ListSources = _handler(rpc_sources.list_records, "ListSources", scoped=True)
    ForgetSource = _handler(rpc_sources.forget, "ForgetSource")
    Push = _handler(rpc_remote.push, "Push", replies=True)
    Pull = _handler(rpc_remote.pull, "Pull", replies=True)


def add_to_server(server: grpc.Server, components: Components, *, ready: Callable[[], bool], admin: bool,
                  admission: StreamAdmission) -> None:
    """Registers both services on ``server``.

    Args:
        server: a grpc server not yet started.
        components: the daemon's components the handlers call.
        ready: the daemon's readiness (recovery done).
        admin: True for the admin socket (mutating admin rpcs allowed).
        admission: the stream caps of this socket (one per socket: each has
            its own thread pool).
    """
    tolerant = _TolerantServer(server)
    pb_grpc.add_RuntimeServicer_to_server(
        RuntimeServicer(components, ready=ready, admin=admin, admission=admission), tolerant)
    pb_grpc.add_AdminServicer_to_server(AdminServicer(components, ready=ready, admin=admin, admission=admission),
                                        tolerant)
