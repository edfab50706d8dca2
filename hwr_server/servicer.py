"""The gRPC servicers: thin adapters from rpcs to the daemon's components.

Each rpc is one line that hands (daemon, request, context) to the handler
module of its concept (``rpc_store``, ``rpc_leases``, ``rpc_sources``,
``rpc_gc``, ``rpc_stats``). Handlers parse and validate the request, call the
component, and build the reply; they raise :mod:`hwr_client.core.errors` classes.
This module converts those into gRPC statuses in ONE place
(:func:`_translate`), so no handler ever touches status codes.

The same two servicer classes serve both sockets; on the runtime socket
(``admin=False``) the mutating admin calls answer PERMISSION_DENIED.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

import grpc

from hwr_client.core._proto import hwr_pb2_grpc as pb_grpc
from hwr_client.core.errors import HwrError, PermissionDenied, Unavailable, status_code_of

log = logging.getLogger(__name__)

#: Admin rpcs that change the store; only served on the admin socket.
MUTATING_ADMIN_RPCS = frozenset({"DeleteArtifact", "CollectGarbage", "VerifyArtifact", "ForgetSource"})


def _abort(context: grpc.ServicerContext, rpc: str, exc: BaseException) -> None:
    if isinstance(exc, HwrError):
        log.info("%s failed: %s: %s", rpc, type(exc).__name__, exc)
        context.abort(status_code_of(exc), str(exc))
    log.exception("%s failed with an unexpected error", rpc)
    context.abort(grpc.StatusCode.INTERNAL, f"{rpc}: internal error: {type(exc).__name__}: {exc}")


def _handler(module: str, func: str, rpc: str, *, streaming: bool = False, mutating: bool = False) -> Callable:
    """Builds a servicer method that calls ``hwr_server.<module>.<func>``."""

    def resolve() -> Callable:
        return getattr(importlib.import_module(f"hwr_server.{module}"), func)

    def check(self: "_Base", context: grpc.ServicerContext) -> None:
        if not getattr(self.daemon, "ready", True):
            raise Unavailable(f"{rpc}: the daemon is still recovering its store; retry shortly")
        if mutating and not self.admin:
            raise PermissionDenied(f"{rpc}: only served on the admin socket; use `--admin-socket` or HWR_ADMIN_SOCKET")

    if streaming:

        def method(self: "_Base", request: Any, context: grpc.ServicerContext):
            try:
                check(self, context)
                yield from resolve()(self.daemon, request, context)
            except Exception as exc:  # noqa: BLE001 - translated, never swallowed
                if isinstance(exc, grpc.RpcError) or context.code() is not None:
                    raise
                _abort(context, rpc, exc)

    else:

        def method(self: "_Base", request: Any, context: grpc.ServicerContext):
            try:
                check(self, context)
                return resolve()(self.daemon, request, context)
            except Exception as exc:  # noqa: BLE001 - translated, never swallowed
                # context.abort raises an Exception subclass; let it through.
                if context.code() is not None:
                    raise
                _abort(context, rpc, exc)

    method.__name__ = rpc
    return method


class _Base:
    def __init__(self, daemon: Any, *, admin: bool):
        #: The running daemon (hwr_server.daemon.Daemon): config and components.
        self.daemon = daemon
        #: True on the admin socket.
        self.admin = admin


class RuntimeServicer(_Base, pb_grpc.RuntimeServicer):
    Publish = _handler("rpc_store", "publish", "Publish", streaming=True)
    Lookup = _handler("rpc_store", "lookup", "Lookup")
    ReportCorruption = _handler("rpc_store", "report_corruption", "ReportCorruption")
    Session = _handler("rpc_leases", "session", "Session", streaming=True)
    AcquireLease = _handler("rpc_leases", "acquire", "AcquireLease")
    ReleaseLease = _handler("rpc_leases", "release", "ReleaseLease")
    ResolveSources = _handler("rpc_sources", "resolve", "ResolveSources")


class AdminServicer(_Base, pb_grpc.AdminServicer):
    ListArtifacts = _handler("rpc_store", "list_artifacts", "ListArtifacts")
    InspectArtifact = _handler("rpc_store", "inspect", "InspectArtifact")
    VerifyArtifact = _handler("rpc_store", "verify", "VerifyArtifact", mutating=True)
    DeleteArtifact = _handler("rpc_store", "delete", "DeleteArtifact", mutating=True)
    ListLeases = _handler("rpc_leases", "list_leases", "ListLeases")
    CollectGarbage = _handler("rpc_gc", "collect", "CollectGarbage", mutating=True)
    GetStats = _handler("rpc_stats", "get_stats", "GetStats")
    ListSources = _handler("rpc_sources", "list_records", "ListSources")
    ForgetSource = _handler("rpc_sources", "forget", "ForgetSource", mutating=True)


def add_to_server(server: grpc.Server, daemon: Any, *, admin: bool) -> None:
    """Registers both services on ``server``."""
    pb_grpc.add_RuntimeServicer_to_server(RuntimeServicer(daemon, admin=admin), server)
    pb_grpc.add_AdminServicer_to_server(AdminServicer(daemon, admin=admin), server)
