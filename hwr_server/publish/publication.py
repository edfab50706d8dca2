"""One publication (DESIGN §5): plan → staging → payload → commit.

The payload reaches the staging files by one of two transports, chosen at
the plan: the handoff transport (:mod:`hwr_server.publish.handed`: the
client writes the files through descriptors the daemon hands it, the daemon
seals and hashes them; the default for a local client) or the message
transport (:mod:`hwr_server.publish.streamed`: chunks in messages). Either
hands the commit the same :class:`~hwr_server.publish.payload.Digests`,
computed by the daemon from the bytes: one SHA-256 pass per payload byte.

Commit: every byte in and every digest computed; declared digests checked
(FAILED_PRECONDITION on mismatch); the manifest built; then the durable
commit of :func:`hwr_server.store.commit.publish` (payload fsync, blobs/,
manifest, the rename into artifacts/, its fsync, the index), and only then
the reply. Any failure before the publish point leaves nothing visible and
removes the staging directory and the blobs this attempt moved.

Limits (DESIGN §16), each a ServerConfig field: the plan's counts are
checked on the wire message before any object is built from it, its exact
header and manifest sizes before anything is staged (:func:`plan_limits`);
a peer runs at most ``max_publications_per_peer`` publications and, beyond
its first, reserves at most ``peer_reserved_bytes`` (:class:`PeerShares`);
a publication that receives nothing for ``publication_idle_s`` ends ABORTED
or brings fewer than ``publication_min_bytes_per_s`` per second the daemon
waits for it (:class:`RequestPump`; on the handoff transport the bytes
counted are those each ``written`` newly reports, see
:meth:`Publication.reported_bytes`); a uid runs at most
``max_publications_per_uid`` (:func:`uid_publication_cap`). Running out of
descriptors is RESOURCE_EXHAUSTED.

What a publication may evict: only room for payload bytes that arrive.
At plan the capacity check is a dry run: a plan that cannot fit even after
collecting is refused at once, one that fits only after collecting is
accepted and nothing is deleted yet. Then bytes are admitted
(:class:`~hwr_server.store.capacity.ArrivalAdmission`: a step of at least
4 MiB and 1/64 of the plan at a time, the collector deleting only what that
step needs) before they can be written: each valid chunk on the message
transport; a file's data size the first time its descriptor is handed out
on the handoff transport. Nothing is preallocated (a full disk is the
writer's ENOSPC: RESOURCE_EXHAUSTED), so a plan cancelled or left idle
costs no other artifact. The collector logs every collection with the peer
and the publication.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
import uuid
from typing import Any, Callable

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import Aborted, FailedPrecondition, HwrError, InvalidArgument, NotFound, ResourceExhausted
from hwr_client.core.plan import CheckedPlan, build_manifest, check_plan, check_plan_message, check_plan_sizes, from_proto
from hwr_server.access.peers import ANONYMOUS, Peer
from hwr_server.access.publisher import published_by
from hwr_server.publish.handed import HandedPayload
from hwr_server.publish.handoff import HandoffListener
from hwr_server.publish.limits import declared_tensors, plan_limits, uid_publication_cap
from hwr_server.publish.payload import Digests, Payload, StagedFiles
from hwr_server.publish.streamed import StreamedPayload
from hwr_server.store import commit as durable
from hwr_server.store.capacity import ArrivalAdmission
from hwr_server.store.staging_io import os_error, pwrite_all

log = logging.getLogger(__name__)

#: Finished files whose background fsync may be pending at once (ordered
#: message transport: each holds its descriptor until fsynced, the writer
#: waits beyond that; handoff transport: fsync threads).
MAX_PENDING_FSYNCS = 8


@dataclasses.dataclass(frozen=True)
class Committed:
    key: str
    manifest_json: str
    bytes_written: int
    already_published: bool


class Publication:
    """One publication attempt; build with :meth:`begin`. One gRPC stream
    drives it (the handoff socket's threads only ask its payload for
    descriptors). :meth:`close` is idempotent and removes the staging
    directory unless the commit completed."""

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
        self.payload: Payload | None = None
        #: The handoff transport's token ("" on the message transport).
        self.handoff_token = ""
        self._slot = False
        self._peer_slot = False
        self._reserved = 0  # bytes counted in the peer's reservation
        self._claimed = False
        self._admission: ArrivalAdmission | None = None  # capacity, from the first payload byte on
        self._done = False
        self._counted = False
        self._moved: list[str] = []  # blobs this attempt moved into blobs/

    # -- plan -------------------------------------------------------------------

    @classmethod
    def begin(cls, store: Any, msg: pb.PublishPlan, *, peer: Peer = ANONYMOUS,
              is_active: Callable[[], bool] = lambda: True,
              max_pending_fsyncs: int = MAX_PENDING_FSYNCS,
              handoff: HandoffListener | None = None) -> "Publication":
        """Validates a plan, claims its key, takes the peer's and a global
        slot, reserves its bytes, checks capacity (without collecting),
        creates staging, writes the headers and sets up the transport.

        Args:
            store: the store it publishes into.
            msg: the wire plan.
            peer: who asks; per-peer slots and bytes are counted by ``peer.key``.
            is_active: False once the caller went away (ends a wait for a slot).
            max_pending_fsyncs: finished files whose fsync may be pending at
                once (:data:`MAX_PENDING_FSYNCS`).
            handoff: the handoff socket; with it, a plan asking for
                ``file_handoff`` gets the handoff transport, else (or
                without it) the message transport.

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
            if not pub.already_published:
                pub._transport(handoff if msg.file_handoff and handoff is not None and handoff.serving else None)
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

    def _transport(self, handoff: HandoffListener | None) -> None:
        cfg = self.store.config
        files = StagedFiles(
            self.checked, [self._file_path(i) for i in range(self.n_files)], self._what(),
            threads=max(1, int(cfg.hash_threads or os.cpu_count() or 2)), max_chunk_bytes=int(cfg.max_chunk_bytes),
            max_pending_fsyncs=self.max_pending_fsyncs, admit=self.admit,
            sha256_tensors=self._sha256_tensors(), nice=int(cfg.publication_nice),
        )
        if handoff is not None:
            handed = HandedPayload(files, self.pub_id[:6], listener=handoff, peer_uid=self.peer.uid)
            self.payload, self.handoff_token = handed, handed.token
        else:
            self.payload = StreamedPayload(files, self.pub_id[:6])
        log.info("publication %s: %s transport", self.pub_id, "handoff" if handoff is not None else "message")

    def _sha256_tensors(self) -> frozenset[str]:
        """The tensors hashed with SHA-256 as well: every one where the plan
        asks for ``tensor_sha256`` (a format-1 manifest), else the declared ones."""
        if self.checked.plan.tensor_sha256:
            return frozenset(spec.name for lay in self.checked.layouts for spec in lay.tensors)
        return frozenset(self.declared_tensors)

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

    def admit(self, nbytes: int) -> None:
        """Capacity for ``nbytes`` payload bytes about to be written (a
        chunk; a handed-over file's data region), before they are: see the
        module docstring. Called by one thread at a time (the stream's, or
        a handoff thread under the handed payload's lock).

        Raises:
            ResourceExhausted: capacity or disk space; none of them may be written.
        """
        if self._admission is None:
            self._admission = ArrivalAdmission(self.store.capacity_hook, self.checked.total_bytes, who=self._what())
        self._admission.admit(nbytes)

    def _file_path(self, i: int) -> str:
        return os.path.join(self.staging, f"{i:05d}.safetensors")

    def accepted(self) -> pb.PublishAccepted:
        return pb.PublishAccepted(
            key=self.key, publication_id=self.pub_id, max_chunk_bytes=self.store.config.max_chunk_bytes,
            already_published=self.already_published,
            files=[pb.FileLayout(data_size=lay.data_size, tensor_offsets=list(lay.tensor_offsets))
                   for lay in self.checked.layouts],
            handoff_token=self.handoff_token,
        )

    # -- payload ----------------------------------------------------------------

    def reported_bytes(self, req: pb.PublishRequest) -> int:
        """The payload bytes a request brings, as the rate floor counts them
        (``RequestPump(size_of=)``): a chunk's length; what a ``written``
        newly reports for its file (each file counted up to its data size,
        once). Handed bytes go into a file the daemon does not watch, so
        they are the client's word; a client that claims them early gains at
        most one rate window, since no file's bytes count twice."""
        kind = req.WhichOneof("kind")
        if kind == "chunk":
            return len(req.chunk.data)
        if kind == "written" and self.payload is not None:
            w = req.written
            return self.payload.reported_bytes(w.file_index, w.data_bytes, w.complete)
        return 0

    def _payload(self, what: str) -> Payload:
        if self.already_published or self.payload is None:
            raise InvalidArgument(f"{what}: artifact {self.key[:12]} is already published; send commit without payload")
        return self.payload

    def write(self, file_index: int, offset: int, data: bytes) -> None:
        """Writes one message chunk (message transport), after the capacity
        its bytes need (:meth:`admit`).

        Raises:
            InvalidArgument: bad index/offset/size, out of order, overlap,
                or a publication on the handoff transport.
            ResourceExhausted: disk full, capacity, file descriptors.
        """
        payload = self._payload(f"publication {self.pub_id} file {file_index}")
        self.bytes_written += payload.write(file_index, offset, data)

    def written(self, file_index: int, data_bytes: int, complete: bool) -> None:
        """Progress on, or the completion of, a staging file the client
        wrote through a handed-over descriptor (handoff transport).

        Raises:
            InvalidArgument: bad index, out of order, a publication on the
                message transport. FailedPrecondition: a writable descriptor
                is still open, or the file's size is not the planned one.
        """
        self._payload(f"publication {self.pub_id} file {file_index}").written(file_index, data_bytes, complete)

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
        payload = self._payload(f"publication {self.pub_id}")
        # Every digest, from the bytes the staging files hold (the payload
        # fsyncs, the commit's first step, are under way meanwhile).
        digests = payload.digests()
        if isinstance(payload, HandedPayload):
            self.bytes_written = payload.bytes_written
        # Declared digests: a mismatch refuses the publication before anything moves.
        self._check_declared(digests)
        tensor_digests = digests.tensor_sha256 if self.checked.plan.tensor_sha256 else digests.tensors
        manifest = build_manifest(self.checked, digests.files, tensor_digests, digests.blocks)
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
            [self._file_path(i) for i in range(self.n_files)], payload.sync,
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

    def _check_declared(self, digests: Digests) -> None:
        bad = []
        for i, f in enumerate(self.checked.plan.files):
            if f.declared_sha256 and f.declared_sha256 != digests.files[i][0]:
                bad.append(f"file {i} ({f.name}): sha256 {digests.files[i][0]}, declared {f.declared_sha256}")
        for name, want in self.declared_tensors.items():
            got = digests.tensor_sha256[name]  # hashed with SHA-256 because it was declared
            if got != want:
                bad.append(f"tensor {name!r}: sha256 {got}, declared {want}")
        if bad:
            raise FailedPrecondition(f"publication {self.pub_id} of {self.key[:12]}: " + "; ".join(bad))

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Ends the attempt: stops hashers, closes files, removes staging and
        releases the claim. Idempotent; counts a failure if not committed."""
        if self.payload is not None:
            # Its threads and descriptors end before the staging goes (no
            # hash pass maps a file being removed, no descriptor is handed out).
            self.payload.close()
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

