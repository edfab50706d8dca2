"""The client a worker (or the CLI) uses to talk to the node daemon.

``connect()`` opens the runtime channel; admin calls open the admin channel
lazily. Each verb is implemented in the module of its concept
(``publish``, ``lease``, ``resolve``, ``sources``); this class only holds the
channels and converts failed calls into :mod:`hwr_client.core.errors` classes in
ONE place (:meth:`Client.call`).

Example:
    >>> import hwr_client                                    # doctest: +SKIP
    >>> client = hwr_client.connect()                        # doctest: +SKIP
    >>> report = client.publish(identity, {"blocks.0.w": w}) # doctest: +SKIP
    >>> with client.acquire(report.key) as lease:            # doctest: +SKIP
    ...     weights = lease.tensors()
"""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping, Sequence

import grpc

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core._proto import hwr_pb2_grpc as pb_grpc
from hwr_client.core.defaults import MESSAGE_OPTIONS, default_paths
from hwr_client.core.errors import InvalidArgument, from_rpc_error
from hwr_client.core.manifest import Manifest



def default_socket(*, admin: bool = False) -> str:
    """The socket a client uses when none is given: ``HWR_ADMIN_SOCKET`` /
    ``HWR_SOCKET`` (read at call time, never at import), else the daemon's
    default for this user."""
    env = os.environ.get("HWR_ADMIN_SOCKET" if admin else "HWR_SOCKET")
    if env:
        return env
    _, sock, admin_sock = default_paths()
    return admin_sock if admin else sock


def open_channel(path: str) -> grpc.Channel:
    if not path:
        raise InvalidArgument("socket path: expected a non-empty path")
    return grpc.insecure_channel(f"unix:{os.path.abspath(path)}", options=MESSAGE_OPTIONS)


class Client:
    """A connection to one node daemon. Thread-safe; one per process is
    enough (leases share its session)."""

    def __init__(self, socket: str | None = None, *, admin_socket: str | None = None):
        self.socket = socket or default_socket()
        self._admin_socket = admin_socket
        self.channel = open_channel(self.socket)
        self.runtime = pb_grpc.RuntimeStub(self.channel)
        self._admin: pb_grpc.AdminStub | None = None
        self._admin_channel: grpc.Channel | None = None
        self._lock = threading.Lock()
        #: The process's session (hwr_client.session.Session), opened lazily.
        self._session: Any = None

    # -- plumbing -----------------------------------------------------------

    def call(self, method: Any, request: Any, *, timeout: float | None = 60.0, **kwargs: Any) -> Any:
        """Invokes a unary stub method; a failed call raises the daemon's
        error class (NotFound, InvalidArgument, ...)."""
        try:
            return method(request, timeout=timeout, **kwargs)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    @property
    def admin(self) -> pb_grpc.AdminStub:
        """Admin stub on the admin socket (read-only admin calls also work on
        the runtime socket: see :meth:`reader`)."""
        with self._lock:
            if self._admin is None:
                self._admin_channel = open_channel(self._admin_socket or default_socket(admin=True))
                self._admin = pb_grpc.AdminStub(self._admin_channel)
            return self._admin

    @property
    def reader(self) -> pb_grpc.AdminStub:
        """Admin stub on the runtime socket, for read-only calls (list,
        inspect, leases, stats, sources) that need no admin rights."""
        return pb_grpc.AdminStub(self.channel)

    def close(self) -> None:
        """Ends the session (releasing its leases) and closes the channels."""
        session, self._session = self._session, None
        if session is not None:
            session.close()
        self.channel.close()
        if self._admin_channel is not None:
            self._admin_channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- verbs ---------------------------------------------------------------

    def lookup(self, key: str) -> Manifest:
        """The manifest of a published artifact.

        Raises:
            NotFound: no artifact with that key.
            FailedPrecondition: the artifact is quarantined.
        """
        reply = self.call(self.runtime.Lookup, pb.LookupRequest(key=key))
        return Manifest.from_json(reply.manifest_json, what=f"artifact {key[:12]} manifest")

    def publish(self, identity: Any, tensors: Mapping[str, Any], **kwargs: Any) -> Any:
        """Publishes CPU tensors as a final-layout artifact; see
        :func:`hwr_client.publish.publish`."""
        from hwr_client.publish import publish

        return publish(self, identity, tensors, **kwargs)

    def acquire(self, key: str, **kwargs: Any) -> Any:
        """Takes a lease on a published artifact; see
        :func:`hwr_client.lease.acquire`."""
        from hwr_client.lease import acquire

        return acquire(self, key, **kwargs)

    def resolve(self, identity: Any, **kwargs: Any) -> Any:
        """Resolves an identity to a lease or a fallback decision; see
        :func:`hwr_client.resolve.resolve`."""
        from hwr_client.resolve import resolve

        return resolve(self, identity, **kwargs)

    def publish_after_load(self, identity: Any, tensors: Mapping[str, Any], **kwargs: Any) -> Any:
        """Publishes after a canonical load without ever raising; see
        :func:`hwr_client.resolve.publish_after_load`."""
        from hwr_client.resolve import publish_after_load

        return publish_after_load(self, identity, tensors, **kwargs)

    def resolve_sources(self, paths: Sequence[str], **kwargs: Any) -> Any:
        """Content ids of canonical files; see
        :func:`hwr_client.sources.resolve_sources`."""
        from hwr_client.sources import resolve_sources

        return resolve_sources(self, paths, **kwargs)


def connect(socket: str | None = None, *, admin_socket: str | None = None) -> Client:
    """Connects to the node daemon (lazily: the first call dials).

    Args:
        socket: runtime socket path; default ``HWR_SOCKET`` or the daemon's
            default path.
        admin_socket: admin socket path for admin calls.

    Example:
        >>> client = connect("/run/hwr/hwr.sock")  # doctest: +SKIP
    """
    return Client(socket, admin_socket=admin_socket)
