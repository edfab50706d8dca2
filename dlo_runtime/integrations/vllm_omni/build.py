"""``get_or_build`` of the vLLM-Omni store: one builder per key, publish
once, then a lease.

Who builds. The daemon's single flight per identity key is what guarantees
that an artifact is published once: a second publication of a key in flight
is refused at its plan (ABORTED) and writes nothing. To also keep a second
process from running its producer for nothing, builders of one key on one
vLLM-Omni root take an advisory lock in the scratch directory first
(``locks/<key>.build.lock``, ``flock``). The lock only saves work; nothing
correct rests on it (a builder without it, e.g. another user's, still meets
the daemon's single flight).

The sequence (numbered in :func:`get_or_build`):

1. refuse producers vLLM-Omni's own store refuses (another coordination
   scope, other outputs);
2. look up: a HIT (or a failure) ends here;
3. take the build lock, waiting until ``deadline`` (TIMEOUT after it);
4. look up again: a HIT now means another builder published it: JOINED;
5. run the producer into a :class:`~.writer.StagingWriter` (its failure,
   typed or not, is the result; the staging is removed);
6. publish the staged files in one ordered stream, with the vLLM-Omni
   record in the manifest's annotations;
7. the daemon says the key was published meanwhile (already published, or
   ABORTED while another publication runs and then present): compare the
   CONTENT (tensor digests and record) with ours: equal is JOINED, different
   is FAILED with IDENTITY_COLLISION (the same identity produced other bytes);
8. look up: BUILT with its lease.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator, Protocol

import torch
import xxhash
from vllm_omni.host_weight_runtime import (
    CapacityPolicy,
    CoordinationScope,
    FailureCode,
    HostWeightError,
    ResolutionStage,
    StoreResult,
    StoreStatus,
    TensorKind,
    ValidationLevel,
    WeightArtifactIdentity,
    WeightProducer,
)

from dlo_runtime.integrations.vllm_omni.failures import error_failure, failed, timeout
from dlo_runtime.integrations.vllm_omni.records import Domain, Record, annotations, hwr_identity, read_record
from dlo_runtime.integrations.vllm_omni.writer import Staged, StagingWriter
from hwr_client.client import Client
from hwr_client.core.errors import Aborted, HwrError
from hwr_client.core.identity import Identity
from hwr_client.core.layout import TensorSpec
from hwr_client.core.manifest import Manifest, content_digest
from hwr_client.core.plan import BlockSpec, FileSpec, PlanSpec, derive_blocks
from hwr_client.publish import publish_plan
from hwr_client.tensors import dtype_name

log = logging.getLogger(__name__)

#: How often a waiting builder looks again (the lock, or another
#: publication of the key). Seconds.
POLL_S = 0.05
#: What steps 5-7 end in when they publish: this call committed the
#: artifact, or another publisher did with equal content.
BUILT, JOINED = "built", "joined"


class BuildStore(Protocol):
    """What a build needs of its store (:class:`~.store.HwrHostWeightStore`
    is one): the daemon, the domain, the scratch directories, the capacity
    policy, and its own lookup."""

    domain: Domain
    locks_dir: Path
    staging_dir: Path
    capacity_policy: CapacityPolicy

    @property
    def client(self) -> Client: ...

    def lookup(self, identity: WeightArtifactIdentity, *, validation: ValidationLevel,
               deadline: float | None = None) -> StoreResult: ...


def get_or_build(store: BuildStore, identity: WeightArtifactIdentity, producer: WeightProducer, *,
                 validation: ValidationLevel, deadline: float) -> StoreResult:
    """The sequence of the module doc. Returns a ``StoreResult``; raises
    only for a bug (the store turns that into a FAILED value)."""
    # 1. What vLLM-Omni's filesystem store refuses, refused alike.
    refused = _refuse_producer(identity, producer)
    if refused is not None:
        return refused
    # 2. Present already (or failing): nothing to build.
    first = store.lookup(identity, validation=validation, deadline=deadline)
    if first.status in (StoreStatus.HIT, StoreStatus.FAILED, StoreStatus.TIMEOUT):
        return first
    ident = hwr_identity(identity, store.domain)
    # 3. One builder per key on this root (a saving, not a guarantee: see the module doc).
    with build_lock(store.locks_dir, ident.key, deadline=deadline) as held:
        if not held:
            return timeout(f"HWR artifact {ident.key[:12]}: another builder held it past the deadline")
        # 4. Built by the builder we waited for.
        again = store.lookup(identity, validation=validation, deadline=deadline)
        if again.status is StoreStatus.HIT:
            assert again.lease is not None
            return StoreResult(StoreStatus.JOINED, lease=again.lease)
        if again.status in (StoreStatus.FAILED, StoreStatus.TIMEOUT):
            return again
        # 5-7. Produce, publish, settle a concurrent publication.
        scratch = store.staging_dir / f"{ident.key}.{os.getpid()}.{uuid.uuid4().hex[:12]}"
        try:
            outcome = _produce_and_publish(store, identity, ident, producer, scratch, deadline)
        finally:
            remove_scratch(scratch)
        if isinstance(outcome, StoreResult):
            return outcome
    # 8. The lease on what was published (by us: BUILT; equal content by another: JOINED).
    found = store.lookup(identity, validation=validation, deadline=deadline)
    if found.status is not StoreStatus.HIT:
        return found
    return StoreResult(StoreStatus.BUILT if outcome == BUILT else StoreStatus.JOINED, lease=found.lease)


def _refuse_producer(identity: WeightArtifactIdentity, producer: WeightProducer) -> StoreResult | None:
    spec = producer.spec
    if spec.coordination_scope is not CoordinationScope.SINGLE_PROCESS:
        return failed(ResolutionStage.PRODUCTION, FailureCode.PRODUCER_UNSUPPORTED,
                      f"coordination scope {spec.coordination_scope.value} is not implemented")
    if tuple(o.key for o in spec.outputs) != (identity.key,):
        return failed(ResolutionStage.PRODUCTION, FailureCode.PRODUCER_UNAVAILABLE,
                      "producer does not declare exactly the requested artifact identity")
    return None


def _produce_and_publish(store: BuildStore, identity: WeightArtifactIdentity, ident: Identity,
                         producer: WeightProducer, scratch: Path, deadline: float) -> StoreResult | str:
    """Steps 5-7: :data:`BUILT` or :data:`JOINED` when the key is now
    published with our content; else the failure."""
    staged = _produce(store, identity, producer, scratch)
    if isinstance(staged, StoreResult):
        return staged
    record = Record(staged.metadata.producer_schema, staged.metadata.restorer_schema,
                    staged.metadata.format_metadata,
                    {n: (TensorKind(kind), role) for n, (kind, role) in staged.classes().items()})
    plan = staged_plan(ident, staged)
    try:
        report = publish_plan(store.client, plan, staged.tensors())
    except Aborted:
        # Another publication of the key is in flight (a builder that did
        # not take our lock): it commits or fails; wait for its manifest.
        return _await_other(store, ident.key, staged, record, deadline)
    except HwrError as exc:
        return StoreResult(StoreStatus.FAILED, failure=error_failure(
            exc, f"publication of HWR artifact {ident.key[:12]}: {exc}", stage=ResolutionStage.LIFECYCLE))
    finally:
        staged.close()
    if report.already_published:
        return _settle(report.manifest, staged, record)
    log.info("vLLM-Omni HWR store: published %s (%s) for vLLM-Omni identity %s: %d bytes",
             ident.key[:12], store.domain.root, identity.key[:12], report.bytes_written)
    return BUILT


def _produce(store: BuildStore, identity: WeightArtifactIdentity, producer: WeightProducer,
             scratch: Path) -> Staged | StoreResult:
    """Step 5: the producer's output, staged; or its failure, typed."""
    writer: StagingWriter | None = None
    try:
        scratch.mkdir(mode=0o700)
        cap = store.capacity_policy
        writer = StagingWriter(scratch, max_artifact_bytes=cap.max_artifact_bytes, min_free_bytes=cap.min_free_bytes)
        metadata = producer.produce(writer)
        return writer.finish(identity, metadata)
    except HostWeightError as exc:  # the producer's own typed failure, passed through
        return StoreResult(StoreStatus.FAILED, failure=exc.failure)
    except OSError as exc:
        enospc = exc.errno in (errno.ENOSPC, errno.EDQUOT)  # the scratch disk is full
        return failed(ResolutionStage.CAPACITY if enospc else ResolutionStage.PRODUCTION,
                      FailureCode.ENOSPC if enospc else FailureCode.PRODUCER_FAILED,
                      f"artifact production failed: {exc}", retryable=enospc)
    except Exception as exc:
        return failed(ResolutionStage.PRODUCTION, FailureCode.PRODUCER_FAILED, f"artifact producer failed: {exc}",
                      details={"exception_type": type(exc).__name__})
    finally:
        if writer is not None:
            writer.abort()  # files a failed producer left open; none after finish


def staged_plan(ident: Identity, staged: Staged) -> PlanSpec:
    """The HWR plan of a staged artifact: one payload file per producer file
    (its name, its tensors in name order), the vLLM-Omni record as
    annotations, and the streamable blocks when every one of them lies in
    one file (else none: vLLM-Omni streams from the mapped regions, not by
    HWR block)."""
    files = tuple(FileSpec(f.name, tuple(TensorSpec(s.name, dtype_name(s.dtype), s.shape) for s in f.specs))
                  for f in staged.files)
    where = {t.name: fi for fi, f in enumerate(files) for t in f.tensors}
    groups = derive_blocks(sorted(where))
    blocks: tuple[BlockSpec, ...] = ()
    if groups and all(len({where[n] for n in names}) == 1 for _, names in groups):
        # Names in a file are sorted, so a block's names (one prefix) are adjacent there.
        blocks = tuple(BlockSpec(i, prefix, tuple(sorted(names))) for i, (prefix, names) in enumerate(groups))
    # vLLM-Omni's manifest holds each tensor's SHA-256: the HWR manifest
    # records those (format 1) rather than xxh3-128s (records.vllm_manifest).
    return PlanSpec(ident, files, blocks, ordered=True,
                    annotations=annotations(staged.metadata, staged.classes()), tensor_sha256=True)


def _staged_digest(staged: Staged, format_version: int) -> str:
    """HWR's content digest of the staged tensors with the tensor digest of
    manifest format ``format_version`` (one pass over them; paid only when
    another publisher got there first)."""
    new = hashlib.sha256 if format_version == 1 else xxhash.xxh3_128
    rows = []
    try:
        for name, t in staged.tensors().items():
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            rows.append((name, dtype_name(t.dtype), tuple(t.shape), new(raw).hexdigest()))
    finally:
        staged.close()
    return content_digest(rows)


def _settle(existing: Manifest, staged: Staged, record: Record) -> StoreResult | str:
    """Step 7: the key was published by someone else. Same content and
    record: :data:`JOINED`; else FAILED with IDENTITY_COLLISION."""
    try:
        theirs = read_record(existing)
    except HwrError as exc:
        theirs, problem = None, str(exc)
    else:
        problem = ""
    ours_digest = _staged_digest(staged, existing.format_version)
    if theirs == record and existing.content_digest == ours_digest:
        return JOINED
    detail = problem or (f"content {existing.content_digest} against ours {ours_digest}"
                         if existing.content_digest != ours_digest else "vLLM-Omni record (kind/role/metadata) differs")
    return failed(ResolutionStage.VALIDATION, FailureCode.IDENTITY_COLLISION,
                  f"HWR artifact {existing.key[:12]}: the same identity was published with different content: {detail}")


def _await_other(store: BuildStore, key: str, staged: Staged, record: Record,
                 deadline: float) -> StoreResult | str:
    """Step 7 for ABORTED: look the key up until it is published (then
    settle) or the deadline passes (TIMEOUT)."""
    client = store.client
    while time.monotonic() < deadline:
        try:
            manifest = client.lookup(key)
        except HwrError:
            time.sleep(POLL_S)
            continue
        return _settle(manifest, staged, record)
    return timeout(f"HWR artifact {key[:12]}: another publication of the key did not finish before the deadline")


@contextlib.contextmanager
def build_lock(locks_dir: Path, key: str, *, deadline: float | None) -> Iterator[bool]:
    """Holds ``locks/<key>.build.lock`` (flock, exclusive) for the block;
    yields False if it could not be taken by ``deadline`` (None: one try).

    The lock file is never removed: unlinking it while another process
    waits on its descriptor would let a third take a lock on a new file.
    """
    fd = os.open(locks_dir / f"{key}.build.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is None or time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(POLL_S)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def remove_stale_staging(staging_dir: Path) -> None:
    """Removes staging left by builders that died (``<key>.<pid>.<id>``
    whose pid no longer runs). A reused pid leaves an entry for a later
    start; it is never read."""
    try:
        entries = list(staging_dir.iterdir())
    except OSError:
        return
    for entry in entries:
        parts = entry.name.split(".")
        if len(parts) == 3 and parts[1].isdigit() and not _running(int(parts[1])):
            remove_scratch(entry)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_scratch(path: Path) -> None:
    """Removes a build's scratch directory; a failure is logged (it holds
    nothing anyone reads, and the next store start removes it)."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("vLLM-Omni HWR store: cannot remove staging %s: %s", path, exc)


__all__ = ["build_lock", "get_or_build", "remove_scratch", "remove_stale_staging", "staged_plan"]
