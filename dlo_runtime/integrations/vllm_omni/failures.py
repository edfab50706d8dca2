"""HWR errors as vLLM-Omni's typed failures: the ONE place where a
:mod:`hwr_client.core.errors` class becomes a ``HostWeightFailure`` and a
``StoreResult``.

vLLM-Omni's runtime decides from a failure's ``retryable`` flag whether a
preferred-mode startup may fall back to a canonical load (retryable) or
must fail (not retryable: identity, configuration, incompatibility). The
table below keeps that meaning: a daemon that cannot be reached, is busy
or is out of space is retryable (a canonical load does not need it); a
refused configuration (permissions) or a request the daemon calls malformed
is not.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_omni.host_weight_runtime import (
    CanonicalJson,
    FailureCode,
    HostWeightFailure,
    ResolutionStage,
    StoreResult,
    StoreStatus,
)

from hwr_client.core.errors import (
    DataLoss,
    FailedPrecondition,
    HwrError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)

log = logging.getLogger(__name__)


def failure(stage: ResolutionStage, code: FailureCode, message: str, *, retryable: bool = False,
            details: dict[str, Any] | None = None) -> HostWeightFailure:
    """A ``HostWeightFailure`` (details as canonical JSON)."""
    return HostWeightFailure(stage=stage, code=code, retryable=retryable, message=message,
                             details=CanonicalJson.from_value(details or {}))


def failed(stage: ResolutionStage, code: FailureCode, message: str, *, retryable: bool = False,
           details: dict[str, Any] | None = None) -> StoreResult:
    """A FAILED ``StoreResult`` carrying :func:`failure`."""
    return StoreResult(StoreStatus.FAILED, failure=failure(stage, code, message, retryable=retryable, details=details))


def invalid(code: FailureCode, message: str) -> StoreResult:
    """An INVALID ``StoreResult``: the artifact exists and must not be used."""
    return StoreResult(StoreStatus.INVALID, failure=failure(ResolutionStage.VALIDATION, code, message))


def timeout(message: str) -> StoreResult:
    """A TIMEOUT ``StoreResult``: another builder held the key past the deadline."""
    return StoreResult(StoreStatus.TIMEOUT, failure=failure(ResolutionStage.PRODUCTION,
                                                            FailureCode.ACTIVE_BUILD_TIMEOUT, message,
                                                            retryable=True))


def lookup_result(exc: HwrError, key: str, *, denied: FailureCode = FailureCode.ARTIFACT_DENIED) -> StoreResult:
    """What a lookup or a lease ends in when the daemon raised ``exc``.

    NOT_FOUND is an ordinary miss. FAILED_PRECONDITION (quarantined,
    damaged, a lease-time verification that failed) makes the artifact
    INVALID with code ``denied`` (a lease taken with verification passes
    CHECKSUM_MISMATCH); DATA_LOSS is INVALID with CHECKSUM_MISMATCH.
    vLLM-Omni then rebuilds it (the daemon accepts a new publication of a
    quarantined key). A malformed manifest is INVALID too. Everything else
    is a FAILED value, retryable or not as :func:`error_failure` says.
    """
    what = f"HWR artifact {key[:12]}: {exc}"
    if isinstance(exc, NotFound):
        return StoreResult(StoreStatus.MISS)
    if isinstance(exc, (FailedPrecondition, DataLoss)):
        return invalid(FailureCode.CHECKSUM_MISMATCH if isinstance(exc, DataLoss) else denied, what)
    if isinstance(exc, InvalidArgument):
        return invalid(FailureCode.MANIFEST_CORRUPT, what)
    return StoreResult(StoreStatus.FAILED, failure=error_failure(exc, what, stage=ResolutionStage.LOOKUP))


def error_failure(exc: HwrError, message: str, *, stage: ResolutionStage) -> HostWeightFailure:
    """The FAILED form of any HWR error (see the module doc for the table).

    Args:
        exc: what the client raised.
        message: names the operation and the artifact.
        stage: the stage for errors that have no stage of their own.
    """
    if isinstance(exc, ResourceExhausted):
        return failure(ResolutionStage.CAPACITY, FailureCode.INSUFFICIENT_CAPACITY, message, retryable=True)
    if isinstance(exc, PermissionDenied):
        return failure(ResolutionStage.CONFIGURATION, FailureCode.DOMAIN_POLICY_MISMATCH,
                       f"{message} (the worker may not use this daemon socket: check its group and mode)")
    if isinstance(exc, (InvalidArgument, FailedPrecondition)):
        return failure(stage, FailureCode.PUBLICATION_FAILED, message)
    # Unavailable, Aborted (retryable by definition), and Internal: a daemon
    # that failed in a way nobody planned is still no reason to refuse a
    # canonical load, which does not need it.
    return failure(ResolutionStage.DOMAIN, FailureCode.DOMAIN_UNAVAILABLE, message, retryable=True)


def unexpected(exc: BaseException, what: str) -> StoreResult:
    """The last resort of the store's public methods, which return values and
    never raise: logged with its traceback, FAILED and retryable (a
    canonical load does not depend on this code)."""
    log.error("vLLM-Omni HWR store: %s failed unexpectedly", what, exc_info=exc)
    return failed(ResolutionStage.LIFECYCLE, FailureCode.DOMAIN_UNAVAILABLE,
                  f"{what} failed unexpectedly: {type(exc).__name__}: {exc}", retryable=True,
                  details={"exception_type": type(exc).__name__})
