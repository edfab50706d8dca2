"""The content-addressed store (DESIGN §4): layout under the root, the
in-memory index rebuilt from manifests, and the operations on published
artifacts (get, list, quarantine, deep verify, delete, usage).

Layout::

    <root>/blobs/sha256/<hex>               payload files, 0444, named by their SHA-256
    <root>/artifacts/<key>/manifest.json    published artifacts, 0444
    <root>/staging/<publication-id>/        work in progress (never visible)
    <root>/quarantine/<key>.<reason>.<ts>/  artifacts that failed verification

Writing new artifacts is :mod:`hwr_server.publish.publication`; startup recovery is
:mod:`hwr_server.store.recovery`. Every rename that changes what is visible (the
commit, delete, quarantine) is a numbered sequence in :mod:`hwr_server.store.commit`.
This module owns the index; one lock (``_lock``, lent to those sequences as
:attr:`Store.visibility_lock`) serializes every change of what is visible.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import threading
from typing import Iterator

from hwr_client.core.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from hwr_client.core.identity import check_key
from hwr_client.core.manifest import Manifest
from hwr_server.access.files import Untrusted, read_stored
from hwr_server.access.publisher import Publisher, read as read_publisher
from hwr_server.access.shares import PeerShares
from hwr_server.config import ServerConfig
from hwr_server.interfaces import CapacityHook
from hwr_server.store import commit
from hwr_server.store.commit import dir_bytes
from hwr_server.store.records import ArtifactSummary, DirEntry, StoreFigures, VerifyResult, summary_of
from hwr_server.store.recovery import RecoveryReport, recover, verify_artifact
from hwr_server.store.scrub import ReportedVerify
from hwr_server.store.staging_io import file_identity, same_bytes

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: Free space kept on the disk beyond a publication's own bytes: 1% of the
#: disk, at most this much.
DISK_MARGIN_BYTES = 64 * 1024 * 1024


class Store:
    """The store under ``config.root``. Thread-safe.

    Args:
        config: resolved daemon configuration (``root``, ``capacity``,
            ``max_publications``, ``hash_threads`` are used here).
    """

    def __init__(self, config: ServerConfig):
        self.config = config
        self.root = os.path.abspath(config.root)
        self.blobs_dir = os.path.join(self.root, "blobs", "sha256")
        self.artifacts_dir = os.path.join(self.root, "artifacts")
        self.staging_dir = os.path.join(self.root, "staging")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        os.makedirs(self.root, mode=0o755, exist_ok=True)
        for d in (os.path.dirname(self.blobs_dir), self.blobs_dir, self.artifacts_dir, self.staging_dir,
                  self.quarantine_dir):
            _layout_dir(d)
        #: hook(nbytes, evict=, who=) run at publication plan (a dry run) and
        #: at its first payload chunk; raises ResourceExhausted.
        #: The daemon's wiring sets it once, before recovery, to the
        #: collector's hook (which collects first, then calls this default).
        self.capacity_hook: CapacityHook = self.default_capacity_hook
        self._lock = threading.RLock()
        self._index: dict[str, Manifest] = {}
        self._publishers: dict[str, Publisher] = {}  # key -> who published it (docs/trust.md)
        self._quarantined: dict[str, ArtifactSummary] = {}
        self._publishing: dict[str, str] = {}  # key -> publication id (single flight)
        self._pending_blobs: dict[str, set[str]] = {}  # key -> blobs installed, manifest not yet visible
        self._bad_blobs: set[str] = set()  # blobs a verification found corrupt
        self.publication_slots = threading.BoundedSemaphore(max(1, config.max_publications))
        #: Per-peer publication slots and reserved bytes (hwr_server.publish.publication).
        self.publication_peers = PeerShares()
        self._outcomes = dict.fromkeys(("committed", "already_published", "conflict", "rejected", "failed"), 0)
        self._publication_bytes = 0
        self._publication_seconds = 0.0
        self._verify_failures = 0
        self.last_recovery: RecoveryReport | None = None
        #: ReportCorruption's verifications: one per key at a time, a result
        #: reused for ``report_verify_interval_s`` (see ReportedVerify).
        self.reports = ReportedVerify(self, config.report_verify_interval_s)

    # -- paths ----------------------------------------------------------------

    def blob_path(self, digest: str) -> str:
        return os.path.join(self.blobs_dir, digest)

    def artifact_dir(self, key: str) -> str:
        return os.path.join(self.artifacts_dir, key)

    def blob_paths(self, manifest: Manifest) -> list[str]:
        return [self.blob_path(f.blob) for f in manifest.files]

    # -- startup --------------------------------------------------------------

    def recover(self) -> RecoveryReport:
        """Startup recovery (see :mod:`hwr_server.store.recovery`); returns its report."""
        self.last_recovery = recover(self)
        return self.last_recovery

    def load_index(self, manifests: dict[str, Manifest]) -> None:
        """Replaces the index (recovery calls this after its checks), with the publisher records."""
        pubs = {k: read_publisher(self.artifact_dir(k), key=k) for k in manifests}
        with self._lock:
            self._index = dict(manifests)
            self._publishers = pubs
            self._quarantined = {s.key: s for s in self._scan_quarantine()}

    # -- reads ----------------------------------------------------------------

    def get(self, key: str) -> tuple[Manifest, list[str]]:
        """The manifest and blob paths of a published artifact.

        Raises:
            InvalidArgument: a malformed key.
            NotFound: no artifact with that key.
            FailedPrecondition: the artifact is quarantined.
        """
        check_key(key)
        with self._lock:
            manifest = self._index.get(key)
            if manifest is None:
                q = self._quarantined.get(key)
                if q is not None:
                    raise FailedPrecondition(
                        f"artifact {key[:12]}: quarantined ({q.reason}) in quarantine/{q.entry}; "
                        "publish it again or remove it with `hwr gc`"
                    )
                raise NotFound(f"artifact {key[:12]}: not in the store; expected a published identity key")
        return manifest, self.blob_paths(manifest)

    def manifest_json(self, key: str) -> str:
        """The manifest.json text as stored (raises like :meth:`get`)."""
        self.get(key)
        what = f"artifact {key[:12]} manifest"
        try:
            # Bounded and never through a link: recovery checked this file,
            # but the store's directory is not the daemon's alone.
            raw = read_stored(os.path.join(self.artifact_dir(key), MANIFEST), what=what,
                              limit=self.config.max_stored_manifest_bytes)
        except FileNotFoundError:
            # Deleted (rm, GC) between the index check and the open.
            raise NotFound(f"artifact {key[:12]}: removed while being read; expected a published identity key") from None
        except Untrusted as exc:
            raise FailedPrecondition(f"{exc}; run `hwr verify {key[:12]}` or restart the daemon to quarantine it") from None
        return raw.decode("utf-8")

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def publisher(self, key: str) -> Publisher | None:
        """Who published ``key`` (indexed with its manifest: they change together); None if unpublished."""
        with self._lock:
            return self._publishers.get(key, Publisher("unrecorded")) if key in self._index else None

    def keys(self) -> list[str]:
        """Published keys, sorted."""
        with self._lock:
            return sorted(self._index)

    def summaries(self) -> list[ArtifactSummary]:
        """Published and quarantined artifacts, sorted by key."""
        with self._lock:
            rows = [summary_of(m) for m in self._index.values()]
            rows += list(self._quarantined.values())
        return sorted(rows, key=lambda s: (s.key, s.state))

    def quarantined(self, key: str) -> ArtifactSummary | None:
        with self._lock:
            return self._quarantined.get(key)

    def blob_refs(self) -> dict[str, set[str]]:
        """blob hex -> keys referencing it (published plus in-flight commits)."""
        refs: dict[str, set[str]] = {}
        with self._lock:
            for key, m in self._index.items():
                for f in m.files:
                    refs.setdefault(f.blob, set()).add(key)
            for key, blobs in self._pending_blobs.items():
                for b in blobs:
                    refs.setdefault(b, set()).add(key)
        return refs

    def blob_entries(self) -> list[DirEntry]:
        """Every file under blobs/sha256 (referenced or not) with its size."""
        out = []
        for name in sorted(os.listdir(self.blobs_dir)):
            try:
                out.append(DirEntry(name, os.lstat(self.blob_path(name)).st_size))
            except FileNotFoundError:
                pass
        return out

    def staging_entries(self) -> list[DirEntry]:
        """Staging directories; ``in_flight`` marks those a running publication
        (or a delete in progress) owns."""
        active = self._active_staging()
        return [
            DirEntry(n, dir_bytes(os.path.join(self.staging_dir, n)), n in active or n.startswith("delete-"))
            for n in sorted(os.listdir(self.staging_dir))
        ]

    def _active_staging(self) -> set[str]:
        with self._lock:
            return set(self._publishing.values())

    def quarantine_entries(self) -> list[DirEntry]:
        return [
            DirEntry(n, dir_bytes(os.path.join(self.quarantine_dir, n))) for n in sorted(os.listdir(self.quarantine_dir))
        ]

    def usage_bytes(self) -> int:
        """Bytes the store occupies: every blob, staging and quarantine entry."""
        return (
            sum(e.bytes for e in self.blob_entries())
            + sum(e.bytes for e in self.staging_entries())
            + sum(e.bytes for e in self.quarantine_entries())
        )

    @contextlib.contextmanager
    def delete_guard(self) -> Iterator[None]:
        """Holds the store's lock around a caller's "is it pinned?" check and
        its :meth:`delete`, so no lease grant can read the artifact
        (:meth:`get` takes the same lock) in between. Re-entrant:
        :meth:`delete` takes the lock again inside."""
        with self._lock:
            yield

    # -- capacity -------------------------------------------------------------

    def default_capacity_hook(self, nbytes: int, *, evict: bool = True, who: str = "") -> None:
        """Refuses a publication of ``nbytes`` that would exceed
        ``config.capacity`` or the disk's free space. Never collects, so
        ``evict`` (see :data:`~hwr_server.interfaces.CapacityHook`) changes
        nothing here; ``who`` names the transfer in the refusal.

        Raises:
            ResourceExhausted: naming the figures and the fix.
        """
        if self.config.capacity:
            used = self.usage_bytes()
            if used + nbytes > self.config.capacity:
                raise ResourceExhausted(
                    f"store {self.root}: publication of {nbytes} bytes needs {used + nbytes} bytes, capacity is "
                    f"{self.config.capacity} ({used} used); run `hwr gc` or `hwr rm KEY`, or raise capacity"
                )
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        margin = min(DISK_MARGIN_BYTES, st.f_blocks * st.f_frsize // 100)
        if nbytes + margin > free:
            raise ResourceExhausted(
                f"store {self.root}: {who or 'publication'} of {nbytes} bytes does not fit the disk's {free} free "
                f"bytes (keeping {margin} spare); free disk space or run `hwr gc`"
            )

    # -- publication support (used by hwr_server.publish.publication) -----------------

    def claim(self, key: str, pub_id: str) -> bool:
        """Single flight: claims ``key`` for one publication.

        Returns:
            True when the artifact is already published (nothing claimed).

        Raises:
            Aborted: another publication of the key is in flight.
        """
        with self._lock:
            if key in self._index:
                return True
            holder = self._publishing.get(key)
            if holder is not None:
                self.count("conflict")
                raise Aborted(
                    f"artifact {key[:12]}: publication {holder} of the same identity is in flight; "
                    "wait for it and look the key up, or retry"
                )
            self._publishing[key] = pub_id
            return False

    def release_claim(self, key: str, pub_id: str, *, moved_blobs: tuple[str, ...] = ()) -> None:
        """Ends a publication's claim. ``moved_blobs``: blobs it moved into
        blobs/ before failing; those no artifact references are unlinked so a
        failed commit leaves no bytes behind."""
        with self._lock:
            if self._publishing.get(key) == pub_id:
                del self._publishing[key]
            self._pending_blobs.pop(key, None)
            if key in self._index or os.path.lexists(self.artifact_dir(key)):
                # Committed (or past the publish point): a visible manifest references
                # these blobs, and unlinking them would leave it without its payload.
                return
            refs = self.blob_refs()
            for digest in moved_blobs:
                if digest not in refs:
                    try:
                        os.unlink(self.blob_path(digest))
                    except FileNotFoundError:
                        pass

    def install_blob(self, key: str, staged: str, digest: str, size: int) -> bool:
        """Moves a finished, fsynced staging file to blobs/<digest>. When a
        blob of that digest is already there it is reused only if its bytes
        equal the staged copy's, which were just hashed to ``digest``: a
        stored copy that rotted (same size, other bytes) is replaced by the
        fresh one, never trusted by its name and size alone.

        Returns:
            True if the staged file was moved into blobs/ (the caller's
            cleanup unlinks it on a failure before the publish point).
        """
        dest = self.blob_path(digest)
        stored = file_identity(dest)
        if stored is not None and stored == file_identity(staged):
            # A pull hard-linked the stored blob into staging: the same
            # inode, nothing to compare (the blob is reused as it is).
            same: tuple[int, int] | None = stored
        else:
            # Outside the lock: comparing may read gigabytes, and every lookup,
            # lease and commit waits on the lock. The inode compared is checked
            # again under the lock below.
            same = same_bytes(dest, staged, size)
        with self._lock:
            self._pending_blobs.setdefault(key, set()).add(digest)
            if same is not None and digest not in self._bad_blobs and file_identity(dest) == same:
                os.unlink(staged)
                return False
            if os.path.lexists(dest):
                log.warning("blob %s: the stored copy differs from the bytes just published and hashed; "
                            "replaced by them (artifact %s)", digest[:12], key[:12])
            os.chmod(staged, 0o444)
            # rename is atomic: readers see the old blob or the whole new one,
            # and a process that maps the old inode keeps its bytes.
            os.rename(staged, dest)
            self._bad_blobs.discard(digest)
            return True

    # -- index changes (used by the sequences in hwr_server.store.commit) ------------

    @property
    def visibility_lock(self) -> threading.RLock:
        """The lock the durable sequences hold around their visible steps, so
        no reader sees a rename without the matching index change."""
        return self._lock

    def indexed(self, key: str) -> Manifest | None:
        """The published manifest of ``key``, or None."""
        with self._lock:
            return self._index.get(key)

    def known_bad_blobs(self) -> set[str]:
        """Blobs a verification found corrupt (a copy)."""
        with self._lock:
            return set(self._bad_blobs)

    def index_published(self, key: str, manifest: Manifest, publisher: Publisher) -> None:
        """Records a committed artifact and who published it (commit step 6)."""
        with self._lock:
            self._index[key] = manifest
            self._publishers[key] = publisher
            self._quarantined.pop(key, None)
            self._pending_blobs.pop(key, None)

    def index_unpublished(self, key: str, *, quarantine_entry: str = "", reason: str = "",
                          manifest: Manifest | None = None) -> None:
        """Forgets a deleted artifact, or lists it as quarantined in
        ``quarantine_entry`` (with ``manifest`` when one was readable)."""
        with self._lock:
            self._index.pop(key, None)
            self._publishers.pop(key, None)
            if quarantine_entry:
                self._quarantined[key] = (
                    summary_of(manifest, "quarantined", reason=reason, entry=quarantine_entry)
                    if manifest is not None else
                    ArtifactSummary(key, "quarantined", reason=reason, entry=quarantine_entry)
                )

    def new_staging(self, pub_id: str) -> str:
        """Creates the staging directory of publication ``pub_id``; returns its path."""
        _check_entry(pub_id)
        path = os.path.join(self.staging_dir, pub_id)
        os.mkdir(path, 0o700)
        return path

    def remove_staging(self, name: str) -> bool:
        """Removes one staging directory that no running publication owns.

        Returns:
            False when it is in flight (kept), True when removed.
        """
        _check_entry(name)
        if name in self._active_staging():
            return False
        shutil.rmtree(os.path.join(self.staging_dir, name), ignore_errors=True)
        return True

    def remove_quarantine(self, name: str) -> None:
        """Removes one quarantine directory and forgets it."""
        _check_entry(name)
        shutil.rmtree(os.path.join(self.quarantine_dir, name), ignore_errors=True)
        with self._lock:
            self._quarantined = {k: v for k, v in self._quarantined.items() if v.entry != name}

    def count(self, outcome: str, *, nbytes: int = 0, seconds: float = 0.0) -> None:
        """Counts one publication's end (``outcome`` as in :class:`StoreFigures`)."""
        with self._lock:
            self._outcomes[outcome] += 1
            self._publication_bytes += nbytes
            self._publication_seconds += seconds

    # -- verify, quarantine, delete -------------------------------------------

    def verify(self, key: str) -> VerifyResult:
        """Deep verification: re-hashes every file, tensor and block and
        parses every header; lists EVERY mismatch. Quarantines nothing
        (callers decide); remembers corrupt blobs so no publication reuses them.

        Raises:
            NotFound / FailedPrecondition: as :meth:`get`.
        """
        manifest, paths = self.get(key)
        problems, bad, checked = verify_artifact(manifest, paths, threads=self._threads())
        with self._lock:
            self._bad_blobs.update(bad)
            if problems:
                self._verify_failures += 1
        return VerifyResult(key, not problems, tuple(problems), checked, tuple(bad))

    def _threads(self) -> int:
        return self.config.hash_threads or os.cpu_count() or 1

    def quarantine(self, key: str, reason: str, *, bad_blobs: tuple[str, ...] = (),
                   manifest: Manifest | None = None, blobs: tuple[str, ...] = ()) -> str:
        """Moves a published artifact to quarantine/<key>.<reason>.<ts>/,
        together with its corrupt blobs and the blobs no other artifact uses
        (the sequence is :func:`hwr_server.store.commit.quarantine`).

        Args:
            manifest: the artifact's manifest when it is not in the index
                (recovery), so its exclusive blobs move along.
            blobs: without a manifest, the blobs it may reference (recovery
                found them in a manifest that did not parse).

        Returns:
            The quarantine entry name.

        Raises:
            NotFound: the key is not published.
        """
        return commit.quarantine(self, key, reason, bad_blobs=bad_blobs, manifest=manifest, blobs=blobs)

    def delete(self, key: str) -> int:
        """Unpublishes an artifact and unlinks its blobs that no other
        artifact uses (the sequence is :func:`hwr_server.store.commit.delete`).
        Never truncates: mapped readers keep valid bytes. No lease check here
        (callers check leases).

        Returns:
            Bytes freed.

        Raises:
            NotFound: the key is not published.
        """
        check_key(key)
        return commit.delete(self, key)

    # -- quarantine listing ---------------------------------------------------

    def _scan_quarantine(self) -> list[ArtifactSummary]:
        out = []
        for name in sorted(os.listdir(self.quarantine_dir)):
            parts = name.split(".")
            key, reason = parts[0], (parts[1] if len(parts) > 2 else "unknown")
            try:
                # read_stored: a quarantined manifest is whatever failed the
                # checks (a link to a FIFO or to /dev/zero among them).
                raw = read_stored(os.path.join(self.quarantine_dir, name, "artifact", MANIFEST),
                                  what=f"quarantine/{name} manifest", limit=self.config.max_stored_manifest_bytes)
                out.append(summary_of(Manifest.from_json(raw), "quarantined", reason=reason, entry=name))
            except Exception:  # noqa: BLE001 - a corrupt manifest is why it is here
                out.append(ArtifactSummary(key, "quarantined", reason=reason, entry=name))
        return out

    # -- stats ----------------------------------------------------------------

    def figures(self) -> StoreFigures:
        """Counters and sizes now (named for GetStats by hwr_server.metrics)."""
        quarantined_bytes = sum(e.bytes for e in self.quarantine_entries())
        staging_bytes = sum(e.bytes for e in self.staging_entries())
        with self._lock:
            return StoreFigures(
                publications=dict(self._outcomes), publication_bytes=self._publication_bytes,
                publication_seconds=self._publication_seconds, verify_failures=self._verify_failures,
                artifacts_published=len(self._index), artifacts_quarantined=len(self._quarantined),
                # Unique blob bytes: identical files are stored once.
                bytes_published=sum({f.blob: f.size for m in self._index.values() for f in m.files}.values()),
                bytes_quarantined=quarantined_bytes, bytes_staging=staging_bytes,
            )


def _layout_dir(path: str) -> None:
    """Creates one directory of the store's layout, or checks the one there.

    Every store path is built as ``<root>/<layout dir>/<name>``, so a layout
    directory replaced by a symbolic link would redirect every blob, staging
    file or delete into wherever it points (another disk, another user's
    files). Such a store is refused at start rather than followed; the root
    itself may be a link (the operator's choice of where the store lives).

    Raises:
        FailedPrecondition: naming the path and what it is instead.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        os.mkdir(path, 0o755)
        return
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise FailedPrecondition(
            f"store layout directory {path} is a symbolic link (to {target!r}); expected a real directory "
            "inside the store root (the daemon never follows a link out of its store); replace the link with "
            "the directory, or point --root at the store's real location"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"store layout directory {path} is {stat.filemode(st.st_mode)}, not a directory; "
                                 "expected a real directory inside the store root")


def _check_entry(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\x00" in name:
        raise InvalidArgument(f"store entry {name!r}: expected a plain directory name")


__all__ = ["ArtifactSummary", "DirEntry", "Store", "StoreFigures", "VerifyResult", "dir_bytes", "summary_of"]
