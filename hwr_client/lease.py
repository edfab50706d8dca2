"""Leases on the client: a pinned artifact mapped read-only, with zero-copy
tensor views (DESIGN §7).

:func:`acquire` asks the daemon for a lease on the process's session, maps
every payload file ``PROT_READ`` + ``MAP_SHARED`` (one copy per node in the
page cache; a write through a view faults), and optionally verifies the
mapped bytes against the manifest before anyone uses them:

* ``verify="none"`` (default): trust the store (it verified at publication).
* ``"fast"``: xxh3-128 of every file (one pass: every byte of every
  block); the blocks of a mismatching file are hashed too, to name them.
* ``"full"``: SHA-256 of every file and the digest of every tensor (the
  manifest format's: xxh3-128, or SHA-256 for format 1), one pass per file.

A mismatch is reported to the daemon (which re-verifies on its own and
quarantines only if it agrees), the lease is closed, and FailedPrecondition
is raised.

A :class:`Lease` is process-local: it refuses pickling. ``close()`` releases
the lease in the daemon and drops OUR references to the mappings; it never
unmaps (views handed out earlier stay valid — see hwr_client.mapping).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Protocol

import torch
import xxhash

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core._proto import hwr_pb2_grpc as pb_grpc
from hwr_client.core.errors import DataLoss, FailedPrecondition, HwrError, InvalidArgument
from hwr_client.core.identity import check_key
from hwr_client.core.manifest import BlockEntry, Manifest
from hwr_client.mapping import MappedArtifact, Region
from hwr_client.session import Session

log = logging.getLogger(__name__)

VERIFY_MODES = ("none", "fast", "full")
#: Bytes hashed per update: small enough to stay in L2 while the second
#: hasher (block or tensor) reads the same chunk.
_CHUNK = 1 << 20


class LeaseClient(Protocol):
    """What :func:`acquire` needs of a client: the process's session and
    the runtime stub (to report corruption). :class:`hwr_client.Client` is
    one."""

    @property
    def runtime(self) -> pb_grpc.RuntimeStub: ...

    def call(self, method: Callable[..., Any], request: Any, *, timeout: float | None = ...) -> Any: ...

    def session(self) -> Session: ...


class Lease:
    """A leased, mapped artifact. Exposes the MappedArtifact API.

    Args:
        key: identity key.
        lease_id: the daemon's lease id (a secret of this process).
        mapped: the read-only mappings.
        release: called once with ``lease_id`` by :meth:`close` (None: no
            daemon lease behind it, e.g. a local artifact).
        session: the daemon session the lease is bound to (None for a
            local artifact); host registration asks the daemon through it
            (:func:`hwr_client.registration.broker_for`).
    """

    def __init__(self, key: str, lease_id: str, mapped: MappedArtifact,
                 release: Callable[[str], Any] | None = None, *, session: Session | None = None):
        self.key = key
        self.session = session
        self.lease_id = lease_id
        self._mapped = mapped
        self.manifest: Manifest = mapped.manifest
        self.paths = mapped.paths
        self._release = release
        self._lock = threading.Lock()
        self._closed = False
        self._lost = False
        #: Who published the artifact, as the daemon recorded it
        #: (docs/trust.md), e.g. "uid 0 (pid 4242, python3)"; "" when not known.
        self.publisher = ""

    # -- MappedArtifact API ---------------------------------------------------

    def tensors(self, *, storage: str = "shared") -> dict[str, torch.Tensor]:
        """Zero-copy read-only views with the manifest's names, dtypes, shapes.

        Args:
            storage: ``"shared"`` (default: the views of one file share its
                storage) or ``"per-tensor"`` (each view has a storage of
                exactly its bytes, over the same mapped pages; see
                :mod:`hwr_client.mapping`).
        """
        return self._mapped.tensors(storage=storage)

    def block_bytes(self, index: int) -> torch.Tensor:
        """A read-only uint8 view of block ``index``'s contiguous bytes."""
        return self._mapped.block_bytes(index)

    def block_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """The views of block ``index``'s tensors."""
        return self._mapped.block_tensors(index)

    def file_bytes(self, index: int) -> torch.Tensor:
        """A read-only uint8 view of payload file ``index``."""
        return self._mapped.file_bytes(index)

    @property
    def blocks(self) -> tuple[BlockEntry, ...]:
        """The manifest's blocks, in execution order."""
        return self._mapped.blocks

    def regions(self) -> list[Region]:
        """The mapped ranges (path, address, length) for CUDA registration."""
        return self._mapped.regions()

    def check_unchanged(self) -> None:
        """Raises DataLoss if a mapped blob changed in place since it was
        mapped (size or mtime; :class:`hwr_client.mapping.MappedFileGuard`).
        One fstat per file; the offload backend calls it before each block
        copy. After :meth:`close` there is nothing to check."""
        self._mapped.check_unchanged()

    def verify(self, mode: str = "fast") -> "VerifyReport":
        """Hashes the mapped bytes against the manifest (see
        :func:`verify_mapped`); reports, never raises for a mismatch."""
        return verify_mapped(self._mapped, mode)

    # -- state ------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    @property
    def lost(self) -> bool:
        """True when the daemon no longer holds this lease (it restarted and
        the grace period passed, or the session timed out). The mapped bytes
        stay valid; the artifact is merely no longer pinned."""
        return self._lost

    def _mark_lost(self) -> None:
        if not self._lost:
            self._lost = True
            log.warning("lease %s… on artifact %s is lost: the daemon no longer pins it; mapped bytes stay valid",
                        self.lease_id[:8], self.key[:12])

    def close(self) -> None:
        """Releases the lease in the daemon and drops the mapping references.
        Idempotent; never raises for a daemon that is gone (logged)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            # At release too: a change since the last check (the last block
            # fetch) may have reached the outputs; say so, never raise here.
            self._mapped.check_unchanged()
        except DataLoss as exc:
            log.error("lease %s… on %s: %s; outputs computed since the last check may be wrong", self.lease_id[:8],
                      self.key[:12], exc)
        try:
            if self._release is not None and not self._lost:
                self._release(self.lease_id)
        except HwrError as exc:
            # The daemon releases it anyway when our session ends or its
            # grace period passes; a close must not fail a teardown path.
            log.warning("lease %s… on %s: release failed (%s); the daemon drops it with the session",
                        self.lease_id[:8], self.key[:12], exc)
        finally:
            self._mapped.release()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self):
        raise TypeError("Lease is process-local (mapped memory, bound to this process's session) and cannot be "
                        "pickled; acquire a lease in the other process")

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("lost" if self._lost else "open")
        return f"<Lease {self.key[:12]} id={self.lease_id[:8]}… {state}>"


# -- verification ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What a lease-time verification found and how much it hashed."""

    mode: str
    problems: tuple[str, ...]
    bytes_hashed: int  # bytes fed to a hasher
    digests: int  # digests compared

    @property
    def ok(self) -> bool:
        """True when every digest compared matched."""
        return not self.problems


def _hash_file(data: memoryview, ranges: list[tuple[int, int]], new: Callable[[], Any],
               new_part: Callable[[], Any] | None = None) -> tuple[str, list[str]]:
    """One pass over ``data``: the whole-file digest (``new``) and one digest
    per (disjoint, sorted) range (``new_part``, default ``new``), each chunk
    read once and fed to both."""
    whole, parts, pos = new(), [], 0
    for begin, end in ranges:
        for a in range(pos, begin, _CHUNK):
            whole.update(data[a:min(a + _CHUNK, begin)])
        part = (new_part or new)()
        for a in range(begin, end, _CHUNK):
            chunk = data[a:min(a + _CHUNK, end)]
            whole.update(chunk)
            part.update(chunk)
        parts.append(part.hexdigest())
        pos = end
    for a in range(pos, len(data), _CHUNK):
        whole.update(data[a:min(a + _CHUNK, len(data))])
    return whole.hexdigest(), parts


def _file_problems(mapped: MappedArtifact, index: int, mode: str) -> tuple[list[str], int, int]:
    """Verifies one payload file; returns (problems, bytes hashed, digests
    compared)."""
    m = mapped.manifest
    entry = m.files[index]
    data = mapped.file_bytes(index).numpy().data  # a memoryview of the mapping, no copy
    if mode == "fast":
        # One xxh3 pass over the file covers every byte of every block in
        # it (the manifest's block digests were computed from these same
        # bytes). Only a mismatch pays a second pass, over the file's
        # blocks, to name the damaged ones. xxhash holds the GIL, so a
        # second pass always would halve the throughput.
        whole, _ = _hash_file(data, [], xxhash.xxh3_128)
        if whole == entry.xxh3_128:
            return [], len(data), 1
        blocks = sorted((b for b in m.blocks if b.file == index), key=lambda b: b.begin)
        expected = [(f"block {b.index} ({b.prefix})", b.xxh3_128) for b in blocks]
        parts = [_hash_file(data[b.begin:b.end], [], xxhash.xxh3_128)[0] for b in blocks]
        file_expected, algo = entry.xxh3_128, "xxh3-128"
        part_algo = algo
        hashed = len(data) + sum(b.nbytes for b in blocks)
    else:
        # Full: every tensor's digest too, in the same pass (each chunk is
        # read once and fed to both hashers). The file's SHA-256 proves every
        # byte; a tensor's digest is the manifest format's (xxh3-128; SHA-256
        # in format 1) and names the damaged tensor.
        tensors = sorted((t for t in m.tensors if t.file == index), key=lambda t: t.offset)
        ranges = [(t.offset, t.offset + t.nbytes) for t in tensors]
        expected = [(f"tensor {t.name!r}", t.digest) for t in tensors]
        part = hashlib.sha256 if m.format_version == 1 else xxhash.xxh3_128
        whole, parts = _hash_file(data, ranges, hashlib.sha256, part)
        file_expected, algo = entry.blob, "sha256"
        part_algo = "sha256" if m.format_version == 1 else "xxh3-128"
        hashed = len(data)
    problems = []
    if whole != file_expected:
        problems.append(f"file {index} ({entry.name}): {algo} {whole}, expected {file_expected}")
    problems += [f"{what}: {part_algo} {got}, expected {want}" for (what, want), got in zip(expected, parts)
                 if got != want]
    return problems, hashed, 1 + len(expected)


def verify_mapped(mapped: MappedArtifact, mode: str, *, threads: int = 4) -> VerifyReport:
    """Hashes the mapped bytes and compares with the manifest.

    Args:
        mapped: the mapped artifact.
        mode: ``"fast"`` (xxh3-128 of every file; of every block of a file
            that mismatches, to name them) or ``"full"`` (SHA-256 of every
            file and every tensor).
        threads: files hashed in parallel in full mode (hashlib releases
            the GIL; xxhash does not, so fast mode runs on one thread).

    Returns:
        The report; ``ok`` is False with every mismatch listed.

    Raises:
        InvalidArgument: unknown mode.
    """
    if mode not in ("fast", "full"):
        raise InvalidArgument(f"verify mode {mode!r}: expected 'fast' or 'full'")
    files = range(len(mapped.manifest.files))
    workers = 1 if mode == "fast" else max(1, min(threads, len(files)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda i: _file_problems(mapped, i, mode), files))
    return VerifyReport(mode, tuple(p for r in results for p in r[0]), sum(r[1] for r in results),
                        sum(r[2] for r in results))


# -- acquire ----------------------------------------------------------------------


def _check_verify(verify: str) -> str:
    if verify not in VERIFY_MODES:
        raise InvalidArgument(f"verify={verify!r}: expected one of {', '.join(VERIFY_MODES)}")
    return verify


def acquire(client: LeaseClient, key: str, *, verify: str = "none") -> Lease:
    """Takes a lease on a published artifact and maps it read-only.

    Args:
        client: a connected :class:`hwr_client.Client`.
        key: identity key (64 lowercase hex).
        verify: ``"none"``, ``"fast"`` or ``"full"`` (see the module doc).

    Returns:
        An open :class:`Lease`; close it (or use ``with``) when done.

    Raises:
        InvalidArgument: malformed key or verify mode.
        NotFound: no published artifact with that key.
        FailedPrecondition: quarantined, damaged, or failed verification
            (reported to the daemon, which re-verifies and quarantines).
        Unavailable: the daemon cannot be reached.

    Example:
        >>> with client.acquire(key, verify="fast") as lease:   # doctest: +SKIP
        ...     w = lease.tensors()["blocks.0.attn.qkv.weight"]
    """
    check_key(key)
    _check_verify(verify)
    session = client.session()
    reply = session.acquire(key)
    return lease_from_grant(client, session, key, reply, verify=verify)


def lease_from_grant(client: LeaseClient, session: Session, key: str, grant: Any, *, verify: str = "none") -> Lease:
    """The :class:`Lease` of a grant the daemon made on ``session``
    (an AcquireLeaseReply, or a ResolveLeaseReply of a hit: ``lease_id``,
    ``manifest_json``, ``blob_paths``): the manifest parsed and checked
    against ``key``, the files mapped, the lease tracked on the session,
    then verified as ``verify`` asks. A failure before the Lease exists
    releases the grant.

    Raises:
        FailedPrecondition: the manifest names another key, a blob is
            missing or of the wrong size, or verification failed.
        InvalidArgument: a bad manifest or verify mode.
    """
    _check_verify(verify)
    try:
        manifest = Manifest.from_json(grant.manifest_json, what=f"artifact {key[:12]} manifest")
        if manifest.key != key:
            raise FailedPrecondition(f"artifact {key[:12]}: daemon returned the manifest of {manifest.key[:12]}")
        mapped = MappedArtifact(manifest, list(grant.blob_paths))
    except BaseException:
        _release_quietly(session, grant.lease_id, key)
        raise
    lease = Lease(key, grant.lease_id, mapped, release=session.release, session=session)
    lease.publisher = grant.publisher.text
    session.track(grant.lease_id, lease)
    if verify != "none":
        _verify_or_close(client, lease, verify)
    return lease


def _release_quietly(session: Session, lease_id: str, key: str) -> None:
    try:
        session.release(lease_id)
    except HwrError as exc:
        log.warning("lease %s… on %s: release after a failed acquire failed: %s", lease_id[:8], key[:12], exc)


def _verify_or_close(client: LeaseClient, lease: Lease, mode: str) -> None:
    report = lease.verify(mode)
    if report.ok:
        return
    detail = "; ".join(report.problems[:20])
    log.error("artifact %s: lease-time %s verification failed: %s", lease.key[:12], mode, detail)
    quarantined, daemon_problems = _report_corruption(client, lease.key, detail)
    lease.close()
    verdict = ("the daemon confirmed it and quarantined the artifact" if quarantined
               else "the daemon's own check did not confirm it")
    raise FailedPrecondition(
        f"artifact {lease.key[:12]}: {mode} verification of the mapped bytes failed ({len(report.problems)} "
        f"mismatch(es): {detail}); {verdict}; run `hwr verify {lease.key}`"
        + (f" (daemon: {'; '.join(daemon_problems[:5])})" if daemon_problems else "")
    )


def _report_corruption(client: LeaseClient, key: str, detail: str) -> tuple[bool, list[str]]:
    try:
        reply = client.call(client.runtime.ReportCorruption, pb.ReportCorruptionRequest(key=key, detail=detail),
                            timeout=600.0)
        return reply.quarantined, list(reply.problems)
    except HwrError as exc:
        log.warning("artifact %s: ReportCorruption failed: %s", key[:12], exc)
        return False, [f"report failed: {exc}"]


def local_lease(manifest: Manifest, paths: Iterable[str]) -> Lease:
    """A Lease over files outside any store (tests, benchmarks, the local
    writer): the same views, nothing to release in a daemon."""
    return Lease(manifest.key, "local", MappedArtifact(manifest, list(paths)), release=None)
