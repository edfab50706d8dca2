"""The bottom of the worker client: a gRPC channel to a daemon socket, and
the ONE place where a failed call becomes an :mod:`hwr_client.core.errors`
class.

Everything above it (session, lease, publish, sources, the client itself)
reaches the daemon through :class:`RuntimeChannel` or :func:`call`; this
module imports nothing of the client, so no import cycle can run through it.

Example:
    >>> from hwr_client.core._proto import hwr_pb2 as pb      # doctest: +SKIP
    >>> with RuntimeChannel("/run/hwr/hwr.sock") as ch:         # doctest: +SKIP
    ...     reply = ch.call(ch.runtime.Lookup, pb.LookupRequest(key=key))
"""

from __future__ import annotations

import os
from typing import Any, Callable

import grpc

from hwr_client.core._proto import hwr_pb2_grpc as pb_grpc
from hwr_client.core.defaults import MESSAGE_OPTIONS, check_trusted_dir, default_paths
from hwr_client.core.errors import InvalidArgument, from_rpc_error

#: Deadline of a unary call, seconds. Long enough for a lookup or a release
#: on a loaded daemon; calls that do real work (hashing, verification) pass
#: their own.
DEFAULT_TIMEOUT_S = 60.0


def default_socket(*, admin: bool = False) -> str:
    """The socket a client uses when none is given.

    ``HWR_ADMIN_SOCKET`` / ``HWR_SOCKET`` (read at call time, never at
    import), else the daemon's default for this user.

    The default path may be one anyone can predict (``/tmp/hwr-<uid>-run``
    without ``XDG_RUNTIME_DIR``), so its directory is checked first: it
    must be owned by root or this user and not writable by others, up to
    ``/`` (:func:`hwr_client.core.defaults.check_trusted_dir`); else an
    impostor could serve there and choose the files this worker maps. We
    refuse loudly rather than fall back: a worker that quietly ran without
    the daemon would hide an attack on the node. A path given explicitly
    (argument or environment) is the caller's choice and is not checked.

    Args:
        admin: the admin socket instead of the runtime socket.

    Raises:
        FailedPrecondition: the default socket's directory is owned or
            writable by another user (the message names it and the fix).
    """
    env = os.environ.get("HWR_ADMIN_SOCKET" if admin else "HWR_SOCKET")
    if env:
        return env
    _, sock, admin_sock = default_paths()
    path = admin_sock if admin else sock
    check_trusted_dir(os.path.dirname(path))
    return path


def open_channel(path: str) -> grpc.Channel:
    """An insecure channel to the Unix socket ``path`` with the shared
    message limits (:data:`hwr_client.core.defaults.MESSAGE_OPTIONS`).

    The channel dials lazily: opening one never fails for a daemon that is
    down; the first call does (Unavailable).

    Raises:
        InvalidArgument: an empty path.
    """
    if not path:
        raise InvalidArgument("socket path: expected a non-empty path")
    return grpc.insecure_channel(f"unix:{os.path.abspath(path)}", options=MESSAGE_OPTIONS)


def call(method: Callable[..., Any], request: Any, *, timeout: float | None = DEFAULT_TIMEOUT_S,
         **kwargs: Any) -> Any:
    """Invokes a unary stub method with a deadline.

    Args:
        method: a bound stub method, e.g. ``runtime.Lookup``.
        request: its request message.
        timeout: deadline in seconds; None waits as long as the call takes
            (only for calls that are safe to wait on, e.g. hashing).
        **kwargs: passed to the stub (metadata, ...).

    Returns:
        The reply message.

    Raises:
        HwrError: the daemon's error class (NotFound, InvalidArgument, ...),
            or Unavailable when no daemon answers.
    """
    try:
        return method(request, timeout=timeout, **kwargs)
    except grpc.RpcError as err:
        raise from_rpc_error(err) from None


class RuntimeChannel:
    """A channel to a daemon's runtime socket and its Runtime stub: what the
    verb modules (publish, lease, sources) need of a client.

    :class:`hwr_client.client.Client` is one; a caller that only needs a
    call or two (e.g. :func:`hwr_client.sources.build_identity` without a
    client) opens one directly.

    Args:
        socket: runtime socket path; default :func:`default_socket`.
    """

    def __init__(self, socket: str | None = None):
        self.socket = socket or default_socket()
        self.channel = open_channel(self.socket)
        self.runtime = pb_grpc.RuntimeStub(self.channel)

    def call(self, method: Callable[..., Any], request: Any, *, timeout: float | None = DEFAULT_TIMEOUT_S,
             **kwargs: Any) -> Any:
        """:func:`call`: a unary call whose failure raises the daemon's error
        class."""
        return call(method, request, timeout=timeout, **kwargs)

    def close(self) -> None:
        """Closes the channel; calls in flight fail with Unavailable."""
        self.channel.close()

    def __enter__(self) -> RuntimeChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
