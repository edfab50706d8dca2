"""One error hierarchy for the daemon, the client and the runtime.

The daemon raises these; the servicer turns them into a gRPC status in ONE
place (:func:`status_code_of`), and the client turns a status back into the
same class in ONE place (:func:`from_rpc_error`), so a ``NotFound`` raised in
the daemon arrives as ``NotFound`` in the worker.

Messages name the object and the expectation, and the fix where there is one:
``artifact 3f2a…: blob size 1048576, expected 2097152; run `hwr verify 3f2a…```.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import stat
from typing import Any, Callable

import grpc


#: Trailing metadata key of a failed call that names a subclass more
#: precise than its status code (:attr:`HwrError.reason`).
REASON_METADATA = "hwr-error-reason"


class HwrError(Exception):
    """Base of every HWR error. ``code`` is the matching gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    #: Whether retrying the same call later may succeed.
    retryable: bool = False
    #: Non-empty for a subclass the client must tell apart from others of
    #: its status code; it travels as :data:`REASON_METADATA`.
    reason: str = ""


class InvalidArgument(HwrError):
    """The request or input is malformed (bad name, dtype, size, JSON...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(HwrError):
    """The named object (artifact, lease, file) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(HwrError):
    """The object exists and the operation would create it again."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(HwrError):
    """State forbids the operation: digest/size mismatch, quarantined or
    leased artifact."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class UntrustedPublisher(FailedPrecondition):
    """The artifact was published by someone the caller does not trust
    (docs/trust.md): a miss in preferred mode, FAILED in required mode."""

    reason = "untrusted-publisher"


class Aborted(HwrError):
    """A conflicting operation is in flight (e.g. a second publisher of the
    same identity key)."""

    code = grpc.StatusCode.ABORTED
    retryable = True


class ResourceExhausted(HwrError):
    """Capacity (disk budget, in-flight bytes) does not allow it."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDenied(HwrError):
    """The caller may not do this here (path outside source roots, admin-only
    call on the runtime socket)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(HwrError):
    """The daemon cannot answer now; a retry is safe."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class DataLoss(HwrError):
    """Stored bytes are corrupt (found by verification)."""

    code = grpc.StatusCode.DATA_LOSS


class Internal(HwrError):
    """A bug or an unexpected environment failure."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[HwrError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        Aborted,
        ResourceExhausted,
        PermissionDenied,
        Unavailable,
        DataLoss,
        Internal,
    )
}


_BY_REASON: dict[str, type[HwrError]] = {cls.reason: cls for cls in (UntrustedPublisher,)}


def status_code_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code for ``exc``; INTERNAL for anything not ours."""
    if isinstance(exc, HwrError):
        return exc.code
    return grpc.StatusCode.INTERNAL


def from_rpc_error(err: grpc.RpcError) -> HwrError:
    """Converts a failed call's status back into the daemon's error class.

    A connection failure (UNAVAILABLE) keeps its retryable meaning; a code we
    do not map (CANCELLED, DEADLINE_EXCEEDED, UNKNOWN) becomes Unavailable
    when retry is safe or Internal otherwise. A socket that could not be
    dialled says what is wrong and what to do (:func:`connect_failure`).
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    dial = connect_failure(details) if code == grpc.StatusCode.UNAVAILABLE else None
    if dial is not None:
        dial.__cause__ = err
        return dial
    cls = _BY_CODE.get(code)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for k, v in trailing or ():
        narrower = _BY_REASON.get(v) if k == REASON_METADATA and isinstance(v, str) else None
        if narrower is not None and cls is not None and issubclass(narrower, cls):
            cls = narrower  # only ever narrower than the code: never a different kind of error
    if cls is None:
        cls = Unavailable if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED) else Internal
        details = f"{code.name}: {details}"
    out = cls(details)
    out.__cause__ = err
    return out


# -- a socket that could not be dialled ------------------------------------------

#: grpc's words for a channel that reached none of its addresses.
_DIAL_FAILED = "failed to connect to all addresses"
#: The socket in grpc's text: ``addr: unix:PATH error: ...`` (grpc >= 1.60),
#: or ``unix:PATH: <strerror>`` (older).
_DIAL_ADDRESS = (re.compile(r"addr: unix:(\S+) error:"), re.compile(r"unix:(\S+?):? "))
#: Where a client is told which socket to use.
_POINT_IT = "or point the client at a running daemon's socket (`--socket PATH`, `HWR_SOCKET=PATH`, " \
            "or `hwr_client.connect(PATH)`)"


def connect_failure(details: str) -> HwrError | None:
    """The error a failed dial of the daemon's Unix socket deserves, from
    grpc's status text: what is wrong and what to do, in one line. None
    when ``details`` is not a failed dial (the caller maps it as usual).

    - no such file: no daemon there (Unavailable: start one, and a retry
      then succeeds);
    - connection refused: a socket file that nobody serves, left by a
      daemon that stopped (Unavailable, the same advice);
    - permission denied: the daemon's socket is there but this user may not
      use it (PermissionDenied: no retry helps; the fix is ``socket_group``).
    """
    if _DIAL_FAILED not in details:
        return None
    socket = next((m.group(1) for m in (rx.search(details) for rx in _DIAL_ADDRESS) if m), "")
    where = socket or "the daemon's socket"
    if "Permission denied" in details:
        return PermissionDenied(_refused_message(socket) if socket else
                                f"{where}: this user may not connect to it (Permission denied); "
                                "set the daemon's `socket_group` to a group of this user")
    if "No such file or directory" in details:
        return Unavailable(f"no HWR daemon at {where}: start one with `hwr serve` (it needs no options), "
                           f"{_POINT_IT}")
    if "Connection refused" in details:
        return Unavailable(f"no HWR daemon at {where}: the socket file is there but nothing serves it (a "
                           f"daemon that stopped); start `hwr serve`, {_POINT_IT}")
    return None


def _refused_message(socket: str) -> str:
    """Why this user was refused at ``socket``, and the fix: the socket's
    mode and group when it can be seen, else the directory in the way."""
    user = _name(pwd.getpwuid, os.geteuid(), "pw_name")
    try:
        st = os.stat(socket)
    except OSError:
        return (f"socket {socket}: this user ({user}) may not reach it: a directory on its path is closed to "
                f"this user (Permission denied). The daemon's socket directory must let the socket's group in "
                f"(mode 0750 and that group, as the systemd unit makes /run/hwr); then set the daemon's "
                f"`socket_group` to a group of this user and add the user to it (`usermod -aG GROUP {user}`)")
    group = _name(grp.getgrgid, st.st_gid, "gr_name")
    return (f"socket {socket} exists (mode {stat.S_IMODE(st.st_mode):04o}, group {group}) but this user ({user}) "
            f"may not use it (Permission denied). Fix: the daemon's `socket_group` (config file, or `hwr serve "
            f"--socket-group GROUP`) names the group that may; add this user to group {group} (`usermod -aG "
            f"{group} {user}`, then log in again), or set socket_group to a group this user is in")


def _name(lookup: Callable[[int], Any], ident: int, attr: str) -> str:
    """A user's or group's name, or its number when it has none."""
    try:
        return str(getattr(lookup(ident), attr))
    except KeyError:
        return str(ident)
