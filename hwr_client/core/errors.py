"""One error hierarchy for the daemon, the client and the runtime.

The daemon raises these; the servicer turns them into a gRPC status in ONE
place (:func:`status_code_of`), and the client turns a status back into the
same class in ONE place (:func:`from_rpc_error`), so a ``NotFound`` raised in
the daemon arrives as ``NotFound`` in the worker.

Messages name the object and the expectation, and the fix where there is one:
``artifact 3f2a…: blob size 1048576, expected 2097152; run `hwr verify 3f2a…```.
"""

from __future__ import annotations

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
    (README "Trust"): a miss in preferred mode, FAILED in required mode."""

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
    when retry is safe or Internal otherwise.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
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
