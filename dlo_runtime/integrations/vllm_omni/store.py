"""vLLM-Omni's ``HostWeightStore`` on the HWR node daemon.

:class:`HwrHostWeightStore` has the constructor of vLLM-Omni's filesystem
store (``domain, capacity, integrity, *, wait``), so its runtime builds it
where it built that one (:mod:`dlo_runtime.integrations.vllm_omni.installer`).
What it does with each input:

* ``domain.root``: the store's scratch directory lives under it
  (``<root>/.hwr-vllm-omni/``: the build locks and the staged payload of a
  build in progress); the artifacts live in the daemon's store (``hwr ls``).
  The resolved root, scope and domain id are part of every HWR identity
  this store writes (:class:`~dlo_runtime.integrations.vllm_omni.records.Domain`).
  With ``require_trusted_permissions`` the root and the scratch directory
  must be this user's and writable by nobody else (other users could plant
  staged files there). NUMA placement options are refused, as by
  vLLM-Omni's own store. ``storage_class`` is not checked: the daemon's
  root is where the bytes live.
* ``capacity``: ``max_artifact_bytes`` and ``min_free_bytes`` bound the
  staging of one build; ``max_store_bytes`` is the daemon's business (its
  ``capacity`` setting) and is logged, not enforced, here.
* ``integrity.local_lookup``: MANIFEST_AND_METADATA or FULL_CHECKSUM (HWR's
  lease-time ``verify="full"``); FS_VERITY is refused as unsupported.
* ``wait.coordination_timeout_seconds``: vLLM-Omni's runtime turns it into
  the ``deadline`` of each call; the store waits that long at most for
  another builder of the same key.

Every public method returns a value (``StoreResult``, a failure or None);
none raises, whatever the daemon does (:mod:`.failures`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
import uuid
from typing import ClassVar

from vllm_omni.host_weight_runtime import (
    BuildRequest,
    CapacityPolicy,
    FailureCode,
    HostWeightError,
    HostWeightFailure,
    IntegrityPolicy,
    ResolutionStage,
    StorageDomainPolicy,
    StoreResult,
    StoreStatus,
    ValidationLevel,
    WaitPolicy,
    WeightArtifactIdentity,
    WeightProducer,
)

from dlo_runtime.integrations.vllm_omni import build
from dlo_runtime.integrations.vllm_omni.failures import error_failure, failed, failure, lookup_result, unexpected
from dlo_runtime.integrations.vllm_omni.leases import VERIFY, open_lease
from dlo_runtime.integrations.vllm_omni.records import Domain, IncompatibleArtifact, hwr_identity
from hwr_client.client import Client, connect
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import (
    FailedPrecondition,
    HwrError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)

log = logging.getLogger(__name__)

#: The store's directory under the vLLM-Omni root.
SCRATCH_DIR = ".hwr-vllm-omni"


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """What :func:`~dlo_runtime.integrations.vllm_omni.install` binds into
    the store class the runtime builds.

    ``socket``: the daemon's runtime socket (None: ``HWR_SOCKET`` or the
    daemon's default, read when the first call dials). ``admin_socket``:
    its admin socket, used only by :meth:`HwrHostWeightStore.cleanup`.
    """

    socket: str | None = None
    admin_socket: str | None = None


_clients: dict[tuple[int, str | None, str | None], Client] = {}
_clients_lock = threading.Lock()


def _client(settings: StoreSettings) -> Client:
    """One HWR client per process and socket: its session carries the
    leases of every store of the process (a forked child makes its own)."""
    key = (os.getpid(), settings.socket, settings.admin_socket)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = connect(settings.socket, admin_socket=settings.admin_socket)
        return client


class HwrHostWeightStore:
    """vLLM-Omni's ``HostWeightStore`` on the HWR daemon (see the module doc).

    Args:
        domain: vLLM-Omni's storage domain (its root holds the scratch directory).
        capacity: bounds of one build's staging.
        integrity: the lookup validation and the permission rule.
        wait: accepted for the filesystem store's signature (the runtime
            passes deadlines to each call).

    Raises:
        HostWeightError: an unsupported policy (UNSUPPORTED), a root that
            cannot be created (DOMAIN_UNAVAILABLE, retryable) or that other
            users control (DOMAIN_UNAVAILABLE, not retryable): the runtime
            records it as its initialization failure.
    """

    #: Bound by install(); the base class dials HWR_SOCKET or the default.
    settings: ClassVar[StoreSettings] = StoreSettings()

    def __init__(self, domain: StorageDomainPolicy, capacity: CapacityPolicy, integrity: IntegrityPolicy, *,
                 wait: WaitPolicy = WaitPolicy()) -> None:
        self.domain_policy, self.capacity_policy, self.integrity_policy = domain, capacity, integrity
        self.wait_policy = wait
        _refuse_unsupported(domain, integrity)
        self.root = domain.root.expanduser().resolve()
        self.scratch = self.root / SCRATCH_DIR
        self.locks_dir, self.staging_dir = self.scratch / "locks", self.scratch / "staging"
        self._prepare_directories()
        self.domain = Domain(str(self.root), domain.scope.value, domain.domain_id)
        self.domain_uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"hwr+vllm-omni:{self.root}#{domain.domain_id}").hex
        if capacity.max_store_bytes is not None:
            log.warning("vLLM-Omni HWR store %s: CapacityPolicy.max_store_bytes=%d is not enforced here; the "
                        "daemon's capacity setting bounds its store", self.root, capacity.max_store_bytes)
        build.remove_stale_staging(self.staging_dir)

    def _prepare_directories(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            for d in (self.scratch, self.locks_dir, self.staging_dir):
                d.mkdir(exist_ok=True, mode=0o700)
        except OSError as exc:
            raise HostWeightError(failure(ResolutionStage.DOMAIN, FailureCode.DOMAIN_UNAVAILABLE,
                                          f"cannot initialize {self.scratch}: {exc}", retryable=True)) from exc
        if self.integrity_policy.require_trusted_permissions:
            for d in (self.root, self.scratch, self.locks_dir, self.staging_dir):
                st = d.lstat()
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                    raise HostWeightError(failure(
                        ResolutionStage.DOMAIN, FailureCode.DOMAIN_UNAVAILABLE,
                        f"{d}: expected a directory of uid {os.geteuid()} writable by no one else (mode "
                        f"{stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}); staged payload there could be replaced"))

    @property
    def client(self) -> Client:
        """The process's HWR client for this store's sockets."""
        return _client(self.settings)

    def key(self, identity: WeightArtifactIdentity) -> str:
        """The HWR identity key of ``identity`` in this store's domain.

        Raises:
            InvalidArgument: the identity has no HWR form (its dtype).
        """
        return hwr_identity(identity, self.domain).key

    def _probe(self, key: str) -> Client:
        """A unary Lookup of ``key`` (its manifest left unparsed) before any
        lease: a miss needs no session, and a daemon that is gone answers
        at once (Unavailable) instead of after the session's reconnect wait.
        Returns the client.

        Raises:
            HwrError: the daemon's answer (NotFound, FailedPrecondition,
                Unavailable, ...).
        """
        client = self.client
        client.call(client.runtime.Lookup, pb.LookupRequest(key=key))
        return client

    # -- HostWeightStore ---------------------------------------------------------

    def lookup(self, identity: WeightArtifactIdentity, *, validation: ValidationLevel,
               deadline: float | None = None) -> StoreResult:
        """HIT with a lease, MISS, INVALID (quarantined, damaged, not
        exactly this identity) or FAILED (unreachable daemon: retryable).
        ``deadline`` bounds nothing here: a lookup waits for no lock."""
        try:
            return self._lookup(identity, validation)
        except Exception as exc:  # a store returns values; see failures.unexpected
            return unexpected(exc, f"lookup of {identity.key[:12]}")

    def _lookup(self, identity: WeightArtifactIdentity, validation: ValidationLevel) -> StoreResult:
        if validation not in VERIFY:
            return failed(ResolutionStage.VALIDATION, FailureCode.UNSUPPORTED,
                          f"validation {validation.value} is not supported by the HWR store")
        try:
            key = self.key(identity)
        except InvalidArgument as exc:
            return failed(ResolutionStage.CONFIGURATION, FailureCode.UNSUPPORTED, str(exc))
        try:
            client = self._probe(key)
        except HwrError as exc:
            return lookup_result(exc, key)
        denied = FailureCode.CHECKSUM_MISMATCH if validation is ValidationLevel.FULL_CHECKSUM \
            else FailureCode.ARTIFACT_DENIED
        try:
            lease = open_lease(client, key, identity, self.domain, validation, domain_uuid=self.domain_uuid)
        except IncompatibleArtifact as exc:
            return StoreResult(StoreStatus.INVALID, failure=failure(
                ResolutionStage.VALIDATION, FailureCode.MANIFEST_INCOMPATIBLE, str(exc)))
        except HwrError as exc:
            return lookup_result(exc, key, denied=denied)
        except ValueError as exc:  # HostWeightLease refused the tensors
            return StoreResult(StoreStatus.INVALID, failure=failure(
                ResolutionStage.VALIDATION, FailureCode.MANIFEST_INCOMPATIBLE, f"HWR artifact {key[:12]}: {exc}"))
        except OSError as exc:
            return failed(ResolutionStage.DOMAIN, FailureCode.DOMAIN_UNAVAILABLE,
                          f"HWR artifact {key[:12]}: {exc}", retryable=True)
        return StoreResult(StoreStatus.HIT, lease=lease)

    def get_or_build(self, request: BuildRequest, producer: WeightProducer, *, validation: ValidationLevel,
                     deadline: float) -> StoreResult:
        """HIT (present), JOINED (another builder published it, or the same
        content was already there), BUILT (this call published it) or a
        typed failure; the producer runs at most once per call, and only
        while this process holds the key's build lock (see :mod:`.build`)."""
        try:
            return build.get_or_build(self, request.identity, producer, validation=validation, deadline=deadline)
        except Exception as exc:  # a store returns values; see failures.unexpected
            return unexpected(exc, f"get_or_build of {request.identity.key[:12]}")

    # -- beyond the Protocol (vLLM-Omni's filesystem store has them too) ---------

    def cleanup(self, identity: WeightArtifactIdentity) -> HostWeightFailure | None:
        """Removes the artifact of ``identity`` from the daemon's store
        unless it is leased or being built; None on success (or when there
        was none). Needs the daemon's admin socket (``hwr rm`` does the same).
        """
        try:
            key = self.key(identity)
            with build.build_lock(self.locks_dir, key, deadline=None) as held:
                if not held:
                    return failure(ResolutionStage.LIFECYCLE, FailureCode.ACTIVE_BUILD_TIMEOUT,
                                   f"HWR artifact {key[:12]} has an active builder", retryable=True)
                self.client.call(self.client.admin.DeleteArtifact, pb.DeleteArtifactRequest(key=key))
        except NotFound:
            return None
        except FailedPrecondition as exc:
            return failure(ResolutionStage.LIFECYCLE, FailureCode.ACTIVE_LEASE, str(exc), retryable=True)
        except PermissionDenied as exc:
            return failure(ResolutionStage.LIFECYCLE, FailureCode.QUARANTINE_FAILED,
                           f"{exc}; removing an artifact needs the daemon's admin socket (install(admin_socket=...))")
        except HwrError as exc:
            return error_failure(exc, f"cleanup of HWR artifact: {exc}", stage=ResolutionStage.LIFECYCLE)
        except Exception as exc:  # returns values, never raises (as above)
            result = unexpected(exc, f"cleanup of {identity.key[:12]}")
            return result.failure
        return None

    def __repr__(self) -> str:
        return f"<HwrHostWeightStore root={self.root} socket={self.settings.socket or 'default'}>"


def _refuse_unsupported(domain: StorageDomainPolicy, integrity: IntegrityPolicy) -> None:
    """What vLLM-Omni's filesystem store refuses at construction, refused the
    same way (a configuration failure, not retryable)."""
    reasons = []
    if integrity.local_lookup is ValidationLevel.FS_VERITY:
        reasons.append("filesystem-verity validation is not implemented")
    if domain.numa_prefault or domain.verify_numa_residency:
        reasons.append("enforced NUMA placement and residency verification are not implemented")
    if integrity.background_scrub:
        reasons.append("background integrity scrubbing is the daemon's (hwr verify / scrub settings)")
    if reasons:
        raise HostWeightError(failure(ResolutionStage.CONFIGURATION, FailureCode.UNSUPPORTED, "; ".join(reasons)))
