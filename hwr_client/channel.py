"""The bottom of the worker client: a gRPC channel to a daemon socket, and
the ONE place where a failed call becomes an :mod:`hwr_client.core.errors`
class.

Everything above it (session, lease, publish, sources, the client itself)
reaches the daemon through :class:`RuntimeChannel` or :func:`call`; this
module imports nothing of the client, so no import cycle can run through it.

Every channel opened here sends the process's peer token
(:func:`peer_token`) on each call, so the daemon counts this process's
streams against its own cap rather than the anonymous one
(:mod:`hwr_server.access.peers`). The token comes from one handshake per process
and socket; a daemon without the credentials socket simply gets no token.

Example:
    >>> from hwr_client.core._proto import hwr_pb2 as pb      # doctest: +SKIP
    >>> with RuntimeChannel("/run/hwr/hwr.sock") as ch:         # doctest: +SKIP
    ...     reply = ch.call(ch.runtime.Lookup, pb.LookupRequest(key=key))
"""

from __future__ import annotations

import collections
import os
import socket as pysocket
import threading
import time
from typing import Any, Callable

import grpc

from hwr_client.core._proto import hwr_pb2_grpc as pb_grpc
from hwr_client.core.defaults import (
    MESSAGE_OPTIONS,
    PEER_SOCKET_SUFFIX,
    PEER_TOKEN_METADATA,
    check_trusted_dir,
    default_paths,
)
from hwr_client.core.errors import InvalidArgument, from_rpc_error

#: Deadline of a unary call, seconds. Long enough for a lookup or a release
#: on a loaded daemon; calls that do real work (hashing, verification) pass
#: their own.
DEFAULT_TIMEOUT_S = 60.0
#: Bound on the credentials handshake (connect + one short line). Seconds.
_HANDSHAKE_TIMEOUT_S = 1.0
#: A failed handshake (no credentials socket: an older daemon, or none) is
#: remembered this long before a call tries again. Seconds.
_HANDSHAKE_RETRY_S = 5.0
_MAX_TOKEN_BYTES = 256


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


class _PeerTokens:
    """This process's peer tokens, one per daemon socket.

    A token is a bearer secret bound to this process (the daemon refuses it
    once the process is gone, for a reused pid, or after a uid change:
    :mod:`hwr_server.access.peers`), so it lives only here, in memory: never
    in the environment, a file or a log line. A forked child starts with
    none (:meth:`after_fork`): the token names the parent's pid, and the
    child's streams must count as its own. A process whose effective uid
    changed since its handshake shakes hands again (the old token now
    names a uid it no longer runs as, and the daemon refuses it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # socket -> (token, monotonic time, euid at the handshake)
        self._tokens: dict[str, tuple[str | None, float, int]] = {}

    def get(self, socket: str) -> str | None:
        # Every call comes here: a token we hold is read without the lock
        # (one dict read, atomic in CPython); a value is never changed in
        # place, only replaced.
        euid = os.geteuid()
        token, _, uid = self._tokens.get(socket, (None, 0.0, euid))
        if token is not None and uid == euid:
            return token
        # Under the lock: threads of one process making their first calls
        # together shake hands once.
        with self._lock:
            token, at, uid = self._tokens.get(socket, (None, -_HANDSHAKE_RETRY_S - 1.0, euid))
            if uid != euid:
                token, at = None, -_HANDSHAKE_RETRY_S - 1.0
            if token is None and time.monotonic() - at > _HANDSHAKE_RETRY_S:
                token = _handshake(socket)
                self._tokens[socket] = (token, time.monotonic(), euid)
            return token

    def forget(self, socket: str) -> None:
        with self._lock:
            self._tokens.pop(socket, None)

    def after_fork(self) -> None:
        # A lock copied while a parent thread held it would stay held.
        self._lock = threading.Lock()
        self._tokens = {}


_TOKENS = _PeerTokens()
os.register_at_fork(after_in_child=_TOKENS.after_fork)


def _handshake(socket: str) -> str | None:
    """One credentials handshake with the daemon of ``socket``: connect to
    ``socket + PEER_SOCKET_SUFFIX``, read one line. None on any failure."""
    conn = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    conn.settimeout(_HANDSHAKE_TIMEOUT_S)
    data = b""
    try:
        conn.connect(socket + PEER_SOCKET_SUFFIX)
        while not data.endswith(b"\n") and len(data) < _MAX_TOKEN_BYTES:
            chunk = conn.recv(_MAX_TOKEN_BYTES)
            if not chunk:
                break
            data += chunk
    except OSError:
        return None
    finally:
        conn.close()
    token = data.strip().decode("ascii", "replace")
    return token or None


def peer_token(socket: str) -> str | None:
    """This process's token for the daemon on ``socket`` (a handshake on
    first use), or None when that daemon offers no credentials socket."""
    return _TOKENS.get(os.path.abspath(socket))


def forget_peer_token(socket: str) -> None:
    """Drops the token of ``socket``: the next call shakes hands again (a
    restarted daemon may no longer know it)."""
    _TOKENS.forget(os.path.abspath(socket))


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _PeerTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the process's peer token to every call's metadata, read at call
    time (so a fork or a new handshake is seen by channels already open)."""

    def __init__(self, socket: str):
        self.socket = socket

    def _details(self, details: Any) -> Any:
        token = peer_token(self.socket)
        if token is None:
            return details
        metadata = [*(details.metadata or ()), (PEER_TOKEN_METADATA, token)]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def open_channel(path: str) -> grpc.Channel:
    """An insecure channel to the Unix socket ``path`` with the shared
    message limits (:data:`hwr_client.core.defaults.MESSAGE_OPTIONS`) that
    sends this process's peer token on every call.

    The channel dials lazily: opening one never fails for a daemon that is
    down; the first call does (Unavailable).

    Raises:
        InvalidArgument: an empty path.
    """
    if not path:
        raise InvalidArgument("socket path: expected a non-empty path")
    path = os.path.abspath(path)
    channel = grpc.insecure_channel(f"unix:{path}", options=MESSAGE_OPTIONS)
    return grpc.intercept_channel(channel, _PeerTokenInterceptor(path))


#: How long a finished streaming call waits for grpc's threads to leave it.
QUIESCE_SECONDS = 5.0


def quiesce(*threads: threading.Thread | None) -> None:
    """Waits (bounded) for the threads that served a streaming call.

    grpc pulls a request iterator from a daemon thread of its own, which is
    still sending the half-close when the call's answer arrives. If the
    program exits in that window, CPython's finalization ends the thread
    with pthread_exit inside grpc's C++ code, and the process aborts
    ("terminate called without an active exception", exit -6) after work
    that succeeded. Callers pass the threads once the call has ended
    (status received, cancelled or failed), so each thread's last operation
    completes or fails at once; the bound only covers a hung grpc and is
    not expected to expire. The calling thread itself is skipped.
    """
    me = threading.current_thread()
    deadline = time.monotonic() + QUIESCE_SECONDS
    for thread in threads:
        if thread is not None and thread is not me:
            thread.join(max(0.0, deadline - time.monotonic()))


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
