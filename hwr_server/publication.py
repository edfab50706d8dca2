"""One publication (DESIGN §5): plan → staging → chunks → commit.

Ordered mode: chunks arrive strictly sequentially; each is written once and
hashed from the same in-memory bytes by two pipeline threads (file SHA-256 +
xxh3 in one, tensor SHA-256 + block xxh3 + padding check in the other), so
the payload is never read back. Each finished file goes to a background
fsync while the next file's bytes flow.

Unordered mode: chunks carry offsets, are written with ``pwrite`` and their
coverage is tracked (an overlap is refused at once, a gap at commit); the
files are hashed at commit by a parallel read-back.

Commit: every byte received and every digest computed; declared digests
checked (FAILED_PRECONDITION on mismatch); the manifest built; then the
durable commit of :func:`hwr_server.commit.publish` (payload fsync, blobs/,
manifest, the rename into artifacts/, its fsync, the index), and only then
the reply. Any failure before the publish point leaves nothing visible and
removes the staging directory and the blobs this attempt moved.

The hashers live in :mod:`hwr_server.hashing` (deep verification uses them too).
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import logging
import os
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import (
    Aborted,
    FailedPrecondition,
    HwrError,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from hwr_client.core.manifest import build_manifest
from hwr_client.core.plan import CheckedPlan, check_plan, from_proto
from hwr_server import commit as durable
from hwr_server.hashing import WholeHasher, _Stage, parts_from_plan, readback, set_native_thread_name

log = logging.getLogger(__name__)

_HEX_DIGITS = "0123456789abcdef"


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def _os_error(exc: OSError, what: str) -> HwrError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{what}: the disk is full ({exc.strerror}); free space or run `hwr gc`")
    return Internal(f"{what}: {exc.strerror or exc}")


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    mv = memoryview(data)
    while mv:
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


class Coverage:
    """Which byte ranges of a data region have been written (unordered mode)."""

    def __init__(self, size: int):
        self.size = size
        self._begins: list[int] = []
        self._ends: list[int] = []
        self.covered = 0

    def add(self, begin: int, end: int, what: str) -> None:
        """Records [begin, end).

        Raises:
            InvalidArgument: the range overlaps bytes already written.
        """
        i = bisect.bisect_right(self._begins, begin)
        if (i > 0 and self._ends[i - 1] > begin) or (i < len(self._begins) and self._begins[i] < end):
            raise InvalidArgument(f"{what}: chunk [{begin}, {end}) overlaps bytes already sent")
        if i > 0 and self._ends[i - 1] == begin:  # merge with the left neighbour
            i -= 1
            self._ends[i] = end
        else:
            self._begins.insert(i, begin)
            self._ends.insert(i, end)
        if i + 1 < len(self._begins) and self._begins[i + 1] == self._ends[i]:  # and the right one
            self._ends[i] = self._ends.pop(i + 1)
            self._begins.pop(i + 1)
        self.covered += end - begin

    def first_gap(self) -> tuple[int, int] | None:
        pos = 0
        for b, e in zip(self._begins, self._ends):
            if b > pos:
                return pos, b
            pos = e
        return (pos, self.size) if pos < self.size else None


@dataclasses.dataclass(frozen=True)
class Committed:
    key: str
    manifest_json: str
    bytes_written: int
    already_published: bool


class Publication:
    """One publication attempt; build with :meth:`begin`. Not thread-safe:
    one gRPC stream drives it. :meth:`close` is idempotent and removes the
    staging directory unless the commit completed."""

    def __init__(self, store: Any, checked: CheckedPlan, pub_id: str, declared_tensors: dict[str, str]):
        self.store = store
        self.checked = checked
        self.key = checked.plan.identity.key
        self.pub_id = pub_id
        self.declared_tensors = declared_tensors
        self.already_published = False
        self.staging = ""
        self.fds: list[int] = []
        self.bytes_written = 0
        self.started = time.monotonic()
        self._slot = False
        self._claimed = False
        self._done = False
        self._counted = False
        self._synced: set[int] = set()
        self._moved: list[str] = []  # blobs this attempt moved into blobs/
        self._cur = 0  # ordered: current file and data-region position
        self._pos = 0
        self._fsyncs: list[Future] = []
        self._fsync_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hwr-fsync-{pub_id[:6]}")
        self._fsync_pool.submit(set_native_thread_name, "hwr-fsync")
        self._whole = [WholeHasher(lay.header) for lay in checked.layouts]
        self._parts = [parts_from_plan(checked, i) for i in range(len(checked.layouts))]
        self._coverage = [Coverage(lay.data_size) for lay in checked.layouts]
        self._stages: list[_Stage] = []

    # -- plan -------------------------------------------------------------------

    @classmethod
    def begin(cls, store: Any, msg: pb.PublishPlan, *, is_active: Callable[[], bool] = lambda: True) -> "Publication":
        """Validates a plan, claims its key, checks capacity, creates staging.

        Raises:
            InvalidArgument: bad plan. Aborted: the key is being published.
            ResourceExhausted: capacity or disk space.
        """
        try:
            checked = check_plan(from_proto(msg))
            declared = _declared_tensors(msg)
        except HwrError:
            store.count("rejected")
            raise
        pub = cls(store, checked, uuid.uuid4().hex[:16], declared)
        try:
            pub._open(is_active)
        except BaseException:
            pub.close()
            raise
        return pub

    def _open(self, is_active: Callable[[], bool]) -> None:
        try:
            published = self.store.claim(self.key, self.pub_id)
        except HwrError:
            self._counted = True  # counted as a conflict by the store
            raise
        if published:
            self.already_published = True
            return
        self._claimed = True
        # Wait for a publication slot (config.max_publications); give up when the caller left.
        while not self.store.publication_slots.acquire(timeout=0.5):
            if not is_active():
                raise InvalidArgument(f"publication {self.pub_id}: caller went away while waiting for a slot")
        self._slot = True
        try:
            self.store.capacity_hook(self.checked.total_bytes)
        except HwrError:
            self.store.count("rejected")
            self._counted = True
            raise
        self.staging = self.store.new_staging(self.pub_id)
        os.mkdir(os.path.join(self.staging, "artifact"), 0o755)
        for i, lay in enumerate(self.checked.layouts):
            path = self._file_path(i)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            self.fds.append(fd)
            try:
                # Preallocate so a full disk fails here, not in the middle of the payload.
                os.posix_fallocate(fd, 0, lay.file_size)
                _pwrite_all(fd, lay.header, 0)
            except OSError as exc:
                raise _os_error(exc, f"publication {self.pub_id} file {i}") from None
        if self.checked.plan.ordered:
            self._stages = [
                _Stage(lambda it: self._whole[it[0]].update(it[1]), f"hwr-sha-file-{self.pub_id[:6]}"),
                _Stage(lambda it: self._parts[it[0]].update(it[1]), f"hwr-sha-tensor-{self.pub_id[:6]}"),
            ]
            for s in self._stages:
                s.start()
        log.info("publication %s of %s: %d files, %d bytes, ordered=%s", self.pub_id, self.key[:12],
                 len(self.fds), self.checked.total_bytes, self.checked.plan.ordered)

    def _file_path(self, i: int) -> str:
        return os.path.join(self.staging, f"{i:05d}.safetensors")

    def accepted(self) -> pb.PublishAccepted:
        return pb.PublishAccepted(
            key=self.key, publication_id=self.pub_id, max_chunk_bytes=self.store.config.max_chunk_bytes,
            already_published=self.already_published,
            files=[pb.FileLayout(data_size=lay.data_size, tensor_offsets=list(lay.tensor_offsets))
                   for lay in self.checked.layouts],
        )

    # -- chunks -----------------------------------------------------------------

    def write(self, file_index: int, offset: int, data: bytes) -> None:
        """Writes one chunk.

        Raises:
            InvalidArgument: bad index/offset/size, out of order, overlap.
            ResourceExhausted: disk full.
        """
        what = f"publication {self.pub_id} file {file_index}"
        if self.already_published:
            raise InvalidArgument(f"{what}: artifact {self.key[:12]} is already published; send commit without payload")
        if not data or len(data) > self.store.config.max_chunk_bytes:
            raise InvalidArgument(f"{what}: chunk of {len(data)} bytes; expected 1..{self.store.config.max_chunk_bytes}")
        if not 0 <= file_index < len(self.fds):
            raise InvalidArgument(f"{what}: file index out of range; the plan has {len(self.fds)} files")
        lay = self.checked.layouts[file_index]
        if offset + len(data) > lay.data_size:
            raise InvalidArgument(
                f"{what}: chunk [{offset}, {offset + len(data)}) runs past the planned data size {lay.data_size} "
                "(more payload than planned)"
            )
        if self.checked.plan.ordered:
            self._check_order(file_index, offset, what)
            self._write_ordered(file_index, offset, data, what)
        else:
            self._coverage[file_index].add(offset, offset + len(data), what)
            self._pwrite(file_index, offset, data, what)
        self.bytes_written += len(data)

    def _check_order(self, fi: int, offset: int, what: str) -> None:
        while self._cur < len(self.fds) - 1 and self._pos == self.checked.layouts[self._cur].data_size:
            self._cur, self._pos = self._cur + 1, 0  # previous file complete: the next one starts
        if (fi, offset) != (self._cur, self._pos):
            raise InvalidArgument(
                f"{what}: out-of-order chunk at offset {offset}; ordered mode expects file {self._cur} "
                f"offset {self._pos} (use ordered=false to send chunks at arbitrary offsets)"
            )

    def _write_ordered(self, fi: int, offset: int, data: bytes, what: str) -> None:
        for s in self._stages:
            if s.error is not None:
                raise s.error
        self._pwrite(fi, offset, data, what)
        for s in self._stages:
            s.q.put((fi, data))  # blocks when the hasher is behind: bounded memory
        self._pos = offset + len(data)
        if self._pos == self.checked.layouts[fi].data_size:
            # Durability of this file proceeds in the background while the next file's bytes flow.
            self._synced.add(fi)
            self._fsyncs.append(self._fsync_pool.submit(os.fsync, self.fds[fi]))

    def _pwrite(self, fi: int, offset: int, data: bytes, what: str) -> None:
        try:
            _pwrite_all(self.fds[fi], data, self.checked.layouts[fi].data_start + offset)
        except OSError as exc:
            raise _os_error(exc, what) from None

    # -- commit -----------------------------------------------------------------

    def commit(self) -> Committed:
        """Makes the artifact durable and visible (see the module docstring).

        Raises:
            InvalidArgument: missing payload or non-zero padding.
            FailedPrecondition: a declared digest does not match.
            ResourceExhausted: disk full.
        """
        if self.already_published:
            self._done = True
            self.store.count("already_published")
            try:
                manifest_json = self.store.manifest_json(self.key)
            except NotFound:
                # GC or rm removed it after the plan was answered: nothing
                # was written, so publishing again is safe.
                raise Aborted(
                    f"publication {self.pub_id}: artifact {self.key[:12]} was removed after the plan said "
                    "already_published; publish again"
                ) from None
            return Committed(self.key, manifest_json, 0, True)
        self._check_complete()
        # Every digest (the payload fsyncs are the commit's first step).
        digests = self._digests_ordered() if self.checked.plan.ordered else self._digests_readback()
        file_digests, tensor_digests, block_xxh = digests
        # Declared digests: a mismatch refuses the publication before anything moves.
        self._check_declared(file_digests, tensor_digests)
        manifest = build_manifest(self.checked, file_digests, tensor_digests, block_xxh)
        if self.checked.plan.declared_content_digest and manifest.content_digest != self.checked.plan.declared_content_digest:
            raise FailedPrecondition(
                f"publication {self.pub_id}: content digest {manifest.content_digest}, declared "
                f"{self.checked.plan.declared_content_digest}"
            )
        staged = durable.Staged(
            self.key, os.path.join(self.staging, "artifact"),
            [self._file_path(i) for i in range(len(self.fds))], self._sync_payload,
        )
        try:
            text = durable.publish(self.store, staged, manifest, self._moved)
        except OSError as exc:
            raise _os_error(exc, f"publication {self.pub_id} commit") from None
        self._done = True
        seconds = time.monotonic() - self.started
        self.store.count("committed", nbytes=self.bytes_written, seconds=seconds)
        log.info("publication %s committed %s: %d bytes in %.2f s", self.pub_id, self.key[:12], self.bytes_written, seconds)
        return Committed(self.key, text, self.bytes_written, False)

    def _check_complete(self) -> None:
        for i, (lay, cov) in enumerate(zip(self.checked.layouts, self._coverage)):
            if self.checked.plan.ordered:
                got = lay.data_size if i < self._cur else (self._pos if i == self._cur else 0)
                if got != lay.data_size:
                    raise InvalidArgument(
                        f"publication {self.pub_id} file {i}: commit after {got} of {lay.data_size} payload bytes "
                        "(too few bytes)"
                    )
            elif (gap := cov.first_gap()) is not None:
                b, e = gap
                raise InvalidArgument(
                    f"publication {self.pub_id} file {i}: commit with bytes [{b}, {e}) never sent (too few bytes)"
                )

    def _digests_ordered(self) -> tuple[list, dict, list]:
        stages, self._stages = self._stages, []
        for s in stages:
            s.finish()  # waits until every queued chunk is hashed
        return self._collect()

    def _digests_readback(self) -> tuple[list, dict, list]:
        def one(i: int) -> None:
            lay = self.checked.layouts[i]
            self._whole[i] = WholeHasher()  # the read-back sees the header too
            readback(self._file_path(i), self._whole[i], self._parts[i], lay.data_start, lay.file_size)

        with ThreadPoolExecutor(max_workers=self._threads(), thread_name_prefix="hwr-readback") as pool:
            for fut in [pool.submit(one, i) for i in range(len(self.fds))]:
                fut.result()
        return self._collect()

    def _threads(self) -> int:
        return max(1, (self.store.config.hash_threads or os.cpu_count() or 2) // 2)

    def _sync_payload(self) -> None:
        """Commit step 1: every payload file durable before blobs/ or a
        manifest refers to it. Ordered mode fsynced each finished file in the
        background while the next one's bytes flowed; this waits for those
        and fsyncs the rest (files without data bytes; every file when
        unordered, in parallel like the read-back)."""
        rest = [fd for i, fd in enumerate(self.fds) if i not in self._synced]
        if self.checked.plan.ordered:
            self._fsyncs += [self._fsync_pool.submit(os.fsync, fd) for fd in rest]
            rest = []
        with ThreadPoolExecutor(max_workers=self._threads(), thread_name_prefix="hwr-fsync") as pool:
            futures = self._fsyncs + [pool.submit(os.fsync, fd) for fd in rest]
            for fut in futures:
                fut.result()  # raises the fsync's OSError: nothing moves into blobs/

    def _collect(self) -> tuple[list, dict, list]:
        problems = [p for parts in self._parts for p in parts.problems]
        if problems:
            raise InvalidArgument("; ".join(problems[:5]))
        tensors: dict[str, str] = {}
        blocks: dict[int, str] = {}
        for parts in self._parts:
            tensors.update(parts.tensor_digests())
            blocks.update(parts.block_digests())
        return [w.digests() for w in self._whole], tensors, [blocks[b.index] for b in self.checked.blocks]

    def _check_declared(self, file_digests: list, tensor_digests: dict[str, str]) -> None:
        bad = []
        for i, f in enumerate(self.checked.plan.files):
            if f.declared_sha256 and f.declared_sha256 != file_digests[i][0]:
                bad.append(f"file {i} ({f.name}): sha256 {file_digests[i][0]}, declared {f.declared_sha256}")
        for name, want in self.declared_tensors.items():
            if tensor_digests[name] != want:
                bad.append(f"tensor {name!r}: sha256 {tensor_digests[name]}, declared {want}")
        if bad:
            raise FailedPrecondition(f"publication {self.pub_id} of {self.key[:12]}: " + "; ".join(bad))

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Ends the attempt: stops hashers, closes files, removes staging and
        releases the claim. Idempotent; counts a failure if not committed."""
        for s in self._stages:
            s.error = s.error or InvalidArgument("aborted")  # skip the queued chunks
            try:
                s.finish()
            except BaseException:  # noqa: BLE001 - the attempt is over; its error was reported
                pass
        self._stages = []
        self._fsync_pool.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self.staging:
            # After a commit only emptied directories remain; otherwise this drops the payload.
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = ""
        if self._claimed:
            self.store.release_claim(self.key, self.pub_id, moved_blobs=tuple(self._moved))
            self._claimed = False
        if self._slot:
            self.store.publication_slots.release()
            self._slot = False
        if not self._done and not self._counted and not self.already_published:
            self._counted = True
            self.store.count("failed", nbytes=0, seconds=time.monotonic() - self.started)
            log.info("publication %s of %s ended without commit; staging removed", self.pub_id, self.key[:12])


def _declared_tensors(msg: pb.PublishPlan) -> dict[str, str]:
    out = {}
    for f in msg.files:
        for t in f.tensors:
            if t.declared_sha256:
                if len(t.declared_sha256) != 64 or any(c not in _HEX_DIGITS for c in t.declared_sha256):
                    raise InvalidArgument(f"publication plan: tensor {t.name!r} declared_sha256 must be 64 lowercase hex")
                out[t.name] = t.declared_sha256
    return out

