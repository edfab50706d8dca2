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
durable commit of :func:`hwr_server.store.commit.publish` (payload fsync, blobs/,
manifest, the rename into artifacts/, its fsync, the index), and only then
the reply. Any failure before the publish point leaves nothing visible and
removes the staging directory and the blobs this attempt moved.

Limits (DESIGN §16), each a ServerConfig field: the plan's counts are
checked on the wire message before any object is built from it, its exact
header and manifest sizes before anything is staged (:func:`plan_limits`);
a peer runs at most ``max_publications_per_peer`` publications and, beyond
its first, reserves at most ``peer_reserved_bytes`` (:class:`PeerShares`);
a publication that receives nothing for ``publication_idle_s`` ends ABORTED
(:class:`RequestPump`). Payload files are opened lazily, a few at a time, so
a plan of many files holds few descriptors; running out of descriptors is
RESOURCE_EXHAUSTED.

What a publication may evict: only room for payload bytes that arrived.
At plan the capacity check is a dry run: a plan that cannot fit even after
collecting is refused at once, one that fits only after collecting is
accepted and nothing is deleted yet. Then each valid chunk is admitted
before it is written (:class:`~hwr_server.store.capacity.ArrivalAdmission`),
a step of at least 4 MiB and 1/64 of the plan at a time, and the collector
deletes only what that step needs; so a plan cancelled or left idle costs
no other artifact, and one chunk of a large plan costs at most one step.
The collector logs every such collection with the peer and the publication.

The hashers live in :mod:`hwr_server.store.hashing` (deep verification uses them too).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import Aborted, FailedPrecondition, HwrError, InvalidArgument, NotFound, ResourceExhausted
from hwr_client.core.plan import CheckedPlan, build_manifest, check_plan, check_plan_message, check_plan_sizes, from_proto
from hwr_server.access.files import Untrusted, open_stored
from hwr_server.access.peers import ANONYMOUS, Peer
from hwr_server.access.publisher import published_by
from hwr_server.publish.limits import declared_tensors, plan_limits, uid_publication_cap
from hwr_server.store import commit as durable
from hwr_server.store.capacity import ArrivalAdmission
from hwr_server.store.hashing import WholeHasher, _Stage, parts_from_plan, readback, set_native_thread_name
from hwr_server.store.staging_io import Coverage, fsync_close, os_error, pwrite_all

log = logging.getLogger(__name__)

#: Payload files a publication keeps open at once (unordered mode: the most
#: recently written; ordered mode needs one). More are reopened by path, so a
#: plan of a thousand files never holds a thousand descriptors.
MAX_OPEN_FILES = 8
#: Finished files (ordered mode) whose background fsync may be pending, each
#: holding its descriptor until fsynced; the writer waits beyond that.
MAX_PENDING_FSYNCS = 8


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

    def __init__(self, store: Any, checked: CheckedPlan, pub_id: str, declared_tensors: dict[str, str],
                 peer: Peer = ANONYMOUS, *, max_pending_fsyncs: int = MAX_PENDING_FSYNCS):
        if max_pending_fsyncs < 1:
            raise InvalidArgument(f"max_pending_fsyncs {max_pending_fsyncs}: expected at least 1")
        self.store = store
        self.max_pending_fsyncs = max_pending_fsyncs
        self.checked = checked
        self.key = checked.plan.identity.key
        self.pub_id = pub_id
        self.peer = peer
        self.declared_tensors = declared_tensors
        self.already_published = False
        self.staging = ""
        self.n_files = len(checked.layouts)
        self.bytes_written = 0
        self.started = time.monotonic()
        self._slot = False
        self._peer_slot = False
        self._reserved = 0  # bytes counted in the peer's reservation
        self._claimed = False
        self._admission: ArrivalAdmission | None = None  # capacity, from the first chunk on
        self._done = False
        self._counted = False
        self._open_fds: collections.OrderedDict[int, int] = collections.OrderedDict()  # file -> fd, LRU order
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
    def begin(cls, store: Any, msg: pb.PublishPlan, *, peer: Peer = ANONYMOUS,
              is_active: Callable[[], bool] = lambda: True,
              max_pending_fsyncs: int = MAX_PENDING_FSYNCS) -> "Publication":
        """Validates a plan, claims its key, takes the peer's and a global
        slot, reserves its bytes, checks capacity (without collecting),
        creates staging and writes the headers.

        Args:
            store: the store it publishes into.
            msg: the wire plan.
            peer: who asks; per-peer slots and bytes are counted by ``peer.key``.
            is_active: False once the caller went away (ends a wait for a slot).
            max_pending_fsyncs: finished files (ordered mode) whose fsync may
                be pending at once (:data:`MAX_PENDING_FSYNCS`).

        Raises:
            InvalidArgument: bad plan. Aborted: the key is being published.
            ResourceExhausted: a plan limit, the peer's share, capacity or
                disk space (each names its limit).
        """
        try:
            # Counts first, on the wire message: nothing is built from a plan
            # over the limits (a 40 MB plan of 2.5M tensors once took 4 GB).
            limits = plan_limits(store.config)
            check_plan_message(msg, limits)
            checked = check_plan(from_proto(msg))
            check_plan_sizes(checked, limits)
            declared = declared_tensors(msg)
        except HwrError:
            store.count("rejected")
            raise
        pub = cls(store, checked, uuid.uuid4().hex[:16], declared, peer, max_pending_fsyncs=max_pending_fsyncs)
        try:
            pub._open(is_active)
        except BaseException:
            pub.close()
            raise
        return pub

    def _what(self) -> str:
        return f"publication {self.pub_id} ({self.peer.key})"

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
        cfg, shares = self.store.config, self.store.publication_peers
        # The peer's and its uid's own shares first (max_publications_per_peer,
        # max_publications_per_uid), so one over them waits without holding
        # one of the global slots.
        shares.acquire_slot(self.peer.key, max(1, min(cfg.max_publications_per_peer, cfg.max_publications)),
                            is_active, self._what(), uid=self.peer.uid_key, uid_cap=uid_publication_cap(cfg, self.peer))
        self._peer_slot = True
        # Wait for a publication slot (config.max_publications); give up when the caller left.
        while not self.store.publication_slots.acquire(timeout=0.5):
            if not is_active():
                raise InvalidArgument(f"publication {self.pub_id}: caller went away while waiting for a slot")
        self._slot = True
        total = self.checked.total_bytes
        try:
            shares.reserve(self.peer.key, total, self._peer_byte_cap(), self._what())
            self._reserved = total
            # A dry run: refuses what cannot fit even after collecting, deletes
            # nothing (a publication evicts only once its payload arrives).
            self.store.capacity_hook(total, evict=False, who=self._what())
        except HwrError:
            self.store.count("rejected")
            self._counted = True
            raise
        try:
            self.staging = self.store.new_staging(self.pub_id)
            os.mkdir(os.path.join(self.staging, "artifact"), 0o755)
            for i, lay in enumerate(self.checked.layouts):
                # Create each file with its header now, its descriptor closed
                # again: a plan of many files holds none while it waits.
                fd = os.open(self._file_path(i), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    pwrite_all(fd, lay.header, 0)
                finally:
                    os.close(fd)
        except OSError as exc:
            raise os_error(exc, f"{self._what()} staging") from None
        log.info("publication %s of %s for %s: %d files, %d bytes, ordered=%s", self.pub_id, self.key[:12],
                 self.peer.key, self.n_files, total, self.checked.plan.ordered)

    def _peer_byte_cap(self) -> int:
        """config.peer_reserved_bytes, or by default half of the capacity
        (half of the disk without one)."""
        cfg = self.store.config
        if cfg.peer_reserved_bytes:
            return int(cfg.peer_reserved_bytes)
        if cfg.capacity:
            return int(cfg.capacity) // 2
        st = os.statvfs(self.store.root)
        return st.f_blocks * st.f_frsize // 2

    def _start_payload(self) -> None:
        """At the first chunk (or a commit without one): the admission of the
        bytes as they arrive, and the ordered-mode hashers. Nothing is
        preallocated: room is made for the bytes that came, never for the
        plan's claim (:mod:`hwr_server.store.capacity`); a full disk is the
        filesystem's ENOSPC at pwrite (RESOURCE_EXHAUSTED)."""
        if self._admission is not None:
            return
        self._admission = ArrivalAdmission(self.store.capacity_hook, self.checked.total_bytes, who=self._what())
        if self.checked.plan.ordered:
            self._stages = [
                _Stage(lambda it: self._whole[it[0]].update(it[1]), f"hwr-sha-file-{self.pub_id[:6]}"),
                _Stage(lambda it: self._parts[it[0]].update(it[1]), f"hwr-sha-tensor-{self.pub_id[:6]}"),
            ]
            for s in self._stages:
                s.start()

    def _file_path(self, i: int) -> str:
        return os.path.join(self.staging, f"{i:05d}.safetensors")

    def _fd(self, i: int) -> int:
        """An open descriptor of file ``i``: from the few kept open (least
        recently used closed first), else opened again by path.

        Raises:
            OSError: from open (EMFILE: see _os_error).
        """
        fd = self._open_fds.get(i)
        if fd is not None:
            self._open_fds.move_to_end(i)
            return fd
        while len(self._open_fds) >= MAX_OPEN_FILES:
            # Closing without fsync loses nothing: the commit fsyncs every
            # file again by path, and Linux reports a writeback error to the
            # next fsync of the file through any descriptor (errseq).
            os.close(self._open_fds.popitem(last=False)[1])
        fd = os.open(self._file_path(i), os.O_RDWR | os.O_CLOEXEC)
        self._open_fds[i] = fd
        return fd

    def accepted(self) -> pb.PublishAccepted:
        return pb.PublishAccepted(
            key=self.key, publication_id=self.pub_id, max_chunk_bytes=self.store.config.max_chunk_bytes,
            already_published=self.already_published,
            files=[pb.FileLayout(data_size=lay.data_size, tensor_offsets=list(lay.tensor_offsets))
                   for lay in self.checked.layouts],
        )

    # -- chunks -----------------------------------------------------------------

    def write(self, file_index: int, offset: int, data: bytes) -> None:
        """Writes one chunk, after the capacity its bytes need (see _start_payload).

        Raises:
            InvalidArgument: bad index/offset/size, out of order, overlap.
            ResourceExhausted: disk full, capacity, file descriptors.
        """
        what = f"publication {self.pub_id} file {file_index}"
        if self.already_published:
            raise InvalidArgument(f"{what}: artifact {self.key[:12]} is already published; send commit without payload")
        if not data or len(data) > self.store.config.max_chunk_bytes:
            raise InvalidArgument(f"{what}: chunk of {len(data)} bytes; expected 1..{self.store.config.max_chunk_bytes}")
        if not 0 <= file_index < self.n_files:
            raise InvalidArgument(f"{what}: file index out of range; the plan has {self.n_files} files")
        lay = self.checked.layouts[file_index]
        if offset + len(data) > lay.data_size:
            raise InvalidArgument(
                f"{what}: chunk [{offset}, {offset + len(data)}) runs past the planned data size {lay.data_size} "
                "(more payload than planned)"
            )
        if self.checked.plan.ordered:
            self._check_order(file_index, offset, what)
            self._admit(len(data))
            self._write_ordered(file_index, offset, data, what)
        else:
            self._coverage[file_index].add(offset, offset + len(data), what)
            self._admit(len(data))
            self._pwrite(file_index, offset, data, what)
        self.bytes_written += len(data)

    def _admit(self, nbytes: int) -> None:
        self._start_payload()  # capacity for a valid chunk's bytes, before they are written
        self._admission.admit(nbytes)  # type: ignore[union-attr]

    def _check_order(self, fi: int, offset: int, what: str) -> None:
        while self._cur < self.n_files - 1 and self._pos == self.checked.layouts[self._cur].data_size:
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
            # Durability of this file proceeds in the background while the next
            # file's bytes flow; the fsync task owns the descriptor and closes it.
            self._synced.add(fi)
            fd = self._open_fds.pop(fi)
            pending = [f for f in self._fsyncs if not f.done()]
            if len(pending) >= self.max_pending_fsyncs:
                try:
                    pending[0].result()  # each pending fsync holds a descriptor: bound them
                except OSError as exc:
                    raise os_error(exc, f"{what}: fsync") from None
            self._fsyncs.append(self._fsync_pool.submit(fsync_close, fd))

    def _pwrite(self, fi: int, offset: int, data: bytes, what: str) -> None:
        try:
            pwrite_all(self._fd(fi), data, self.checked.layouts[fi].data_start + offset)
        except OSError as exc:
            raise os_error(exc, what) from None

    # -- commit -----------------------------------------------------------------

    def commit(self) -> Committed:
        """Makes the artifact durable and visible (see the module docstring).

        Raises:
            InvalidArgument: missing payload or non-zero padding.
            FailedPrecondition: a declared digest does not match.
            ResourceExhausted: disk full, or the manifest over max_manifest_bytes.
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
        self._start_payload()  # a plan whose files hold no data bytes gets no chunk
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
        # The plan's estimate was exact; this check makes "a manifest that
        # cannot be served is never published" hold whatever the estimate.
        size = len(manifest.to_json().encode("utf-8"))
        limit = plan_limits(self.store.config).max_manifest_bytes
        if size > limit:
            raise ResourceExhausted(f"{self._what()}: manifest of {size} bytes exceeds the limit {limit} "
                                    "(ServerConfig.max_manifest_bytes); split the artifact")
        staged = durable.Staged(
            self.key, os.path.join(self.staging, "artifact"),
            [self._file_path(i) for i in range(self.n_files)], self._sync_payload,
        )
        try:
            text = durable.publish(self.store, staged, manifest, self._moved,
                                   publisher=published_by(self.peer, self.pub_id))
        except OSError as exc:
            raise os_error(exc, f"publication {self.pub_id} commit") from None
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
            # The staging file is opened once, refused unless it is still a
            # regular file of ours (no link planted in its place), and read
            # through that fd only.
            try:
                fd, _ = open_stored(self._file_path(i), what=f"{self._what()} file {i}")
            except (FileNotFoundError, Untrusted) as exc:
                raise FailedPrecondition(f"{self._what()} file {i}: staging file cannot be read back ({exc}); "
                                         "publish again") from None
            try:
                readback(fd, self._whole[i], self._parts[i], lay.data_start, lay.file_size)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(max_workers=self._threads(), thread_name_prefix="hwr-readback") as pool:
            for fut in [pool.submit(one, i) for i in range(self.n_files)]:
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
        rest = [i for i in range(self.n_files) if i not in self._synced]
        if self.checked.plan.ordered:
            self._fsyncs += [self._fsync_pool.submit(self._fsync_file, i) for i in rest]
            rest = []
        with ThreadPoolExecutor(max_workers=self._threads(), thread_name_prefix="hwr-fsync") as pool:
            futures = self._fsyncs + [pool.submit(self._fsync_file, i) for i in rest]
            for fut in futures:
                fut.result()  # raises the fsync's OSError: nothing moves into blobs/

    def _fsync_file(self, i: int) -> None:
        """fsyncs file ``i`` through its open descriptor, or one opened for it
        (the few kept open are not touched by the writer meanwhile: the
        commit runs after the last chunk)."""
        fd = self._open_fds.get(i)
        if fd is not None:
            os.fsync(fd)
            return
        fsync_close(os.open(self._file_path(i), os.O_RDONLY | os.O_CLOEXEC))

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
        # Waits for queued fsyncs: each owns and closes a descriptor.
        self._fsync_pool.shutdown(wait=True)
        for fd in self._open_fds.values():
            os.close(fd)
        self._open_fds.clear()
        if self.staging:
            # After a commit only emptied directories remain; otherwise this drops the payload.
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = ""
        if self._claimed:
            self.store.release_claim(self.key, self.pub_id, moved_blobs=tuple(self._moved))
            self._claimed = False
        if self._reserved:
            self.store.publication_peers.unreserve(self.peer.key, self._reserved)
            self._reserved = 0
        if self._slot:
            self.store.publication_slots.release()
            self._slot = False
        if self._peer_slot:
            self.store.publication_peers.release_slot(self.peer.key, uid=self.peer.uid_key)
            self._peer_slot = False
        if not self._done and not self._counted and not self.already_published:
            self._counted = True
            self.store.count("failed", nbytes=0, seconds=time.monotonic() - self.started)
            log.info("publication %s of %s ended without commit; staging removed", self.pub_id, self.key[:12])
