"""Garbage collection, the daemon side: the snapshot, the execution of a
plan, and the :class:`Collector` component (capacity watermarks, the
background thread, the publication capacity hook and the figures).

The pure part (records, :func:`~hwr_server.gc.plan.reachable`,
:func:`~hwr_server.gc.plan.plan`) is :mod:`hwr_server.gc.plan`. Here
:func:`execute` carries a plan out in a fixed order and only ever unlinks; it
checks the pin again right before each delete because a lease may have
arrived since planning. Files are unlinked, never truncated or rewritten, so
a process that still maps a deleted payload keeps reading valid bytes; those
bytes stay on disk until it unmaps, which is why usage counts "deleted but
still mapped".

The Collector reaches the store and the lease manager only through
:class:`~hwr_server.interfaces.GcStore` and
:class:`~hwr_server.interfaces.GcLeases`; the daemon wires them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, ContextManager, Iterable

from hwr_client.core.errors import FailedPrecondition, Internal, NotFound, ResourceExhausted
from hwr_server.config import ServerConfig
from hwr_server.gc.plan import ArtifactRecord, DirRecord, GcItem, GcPlan, GcResult, Snapshot, plan
from hwr_server.interfaces import CapacityHook, DirInfo, GcLeases, GcStore

log = logging.getLogger(__name__)

#: Makes the context manager held around each pin check + delete.
Guard = Callable[[], ContextManager[object]]

# -- execution -------------------------------------------------------------------------


def execute(
    gc_plan: GcPlan,
    *,
    store: GcStore,
    is_pinned: Callable[[str], bool],
    guard: Guard | None = None,
) -> GcResult:
    """Carries out a plan in its (fixed) order; only unlinks.

    Order, and why:

    1. staging leftovers: never visible, nothing references them;
    2. quarantine directories: never served, nothing new can lease them;
    3. artifacts in plan order (least recently leased first). For each, the
       pin is checked again right before the delete (a lease may have been
       granted since planning); the store removes the manifest directory
       first, so the artifact can no longer be resolved, then the blobs no
       other artifact references.
    4. blob items are not separate deletions: they record what step 3 freed,
       and count only if the blob file is really gone afterwards (a skipped
       artifact keeps its shared blobs).

    Args:
        gc_plan: from :func:`~hwr_server.gc.plan.plan`.
        store: the store (``delete``, ``remove_staging``, ``remove_quarantine``,
            ``root``).
        is_pinned: called right before each artifact delete.
        guard: optional context-manager factory held around check+delete so
            no lease can be granted in between (``GcStore.delete_guard``).

    Returns:
        What was removed and what was skipped (with why).
    """
    done: list[GcItem] = []
    skipped: list[tuple[GcItem, str]] = []
    deleted: set[str] = set()
    for item in gc_plan.items:
        try:
            why = _execute_one(item, store, is_pinned, guard, deleted)
        except (NotFound, FailedPrecondition) as exc:
            why = f"{type(exc).__name__}: {exc}"
        except OSError as exc:
            log.warning("gc: %s %s: %s", item.kind, item.name, exc)
            why = f"OSError: {exc.strerror or exc}"
        if why:
            log.info("gc: kept %s %s: %s", item.kind, item.name[:16], why)
            skipped.append((item, why))
        else:
            done.append(item)
    return GcResult(tuple(done), tuple(skipped), gc_plan.usage_before)


def _execute_one(item: GcItem, store: GcStore, is_pinned: Callable[[str], bool],
                 guard: Guard | None, deleted: set[str]) -> str:
    """Removes one item; returns "" on success or why it was kept."""
    if item.kind == "staging":
        if not store.remove_staging(item.name):
            # A publication claimed it after the snapshot: its bytes are
            # still on disk, so they must not be reported as freed.
            return "claimed by a publication since planning"
    elif item.kind == "quarantine":
        store.remove_quarantine(item.name)
    elif item.kind == "artifact":
        return _delete_artifact(item.name, store, is_pinned, guard, deleted)
    elif item.kind == "blob":
        if item.owner not in deleted:
            return f"its artifact {item.owner[:12]} was kept"
        if os.path.exists(os.path.join(store.root, "blobs", "sha256", item.name)):
            return "still referenced (a publication or a kept artifact uses it)"
    else:
        raise Internal(f"gc item kind {item.kind!r}: expected staging, quarantine, artifact or blob")
    log.info("gc: removed %s %s (%d bytes): %s", item.kind, item.name[:16], item.bytes, item.reason)
    return ""


def _delete_artifact(key: str, store: GcStore, is_pinned: Callable[[str], bool],
                     guard: Guard | None, deleted: set[str]) -> str:
    if guard is None:
        if is_pinned(key):
            return "leased since planning"
        store.delete(key)
    else:
        with guard():
            # Under the store's delete guard: no lease can be granted between
            # this check and the unlink (see Collector._guard).
            if is_pinned(key):
                return "leased since planning"
            store.delete(key)
    deleted.add(key)
    log.info("gc: removed artifact %s", key[:16])
    return ""


# -- the daemon component ------------------------------------------------------------


def _dir_records(entries: Iterable[DirInfo], *, staging: bool) -> tuple[DirRecord, ...]:
    """The store's directory listing as plan input; only staging can be in flight."""
    return tuple(DirRecord(e.name, int(e.bytes), bool(e.in_flight) if staging else False) for e in entries)


class Collector:
    """Keeps the store within ``config.capacity``.

    Above ``gc_high_watermark`` of the capacity the background thread collects
    down to ``gc_low_watermark``; a publication whose plan would cross the high
    watermark collects first (synchronously, in :meth:`capacity_hook`, which
    the daemon installs as the store's hook) and fails with ResourceExhausted
    if it still cannot fit. Nothing is collected while the lease manager is
    inside its post-restart grace period.

    Args:
        config: the daemon's ServerConfig (capacity, watermarks, interval).
        store: what GC needs of the store (snapshot, delete, delete guard).
        leases: what GC needs of the lease manager (pins, grace, last use).
        fallback_hook: the store's own capacity check (capacity and the
            disk's free space), run after any collection this hook does.
    """

    def __init__(self, config: ServerConfig, store: GcStore, leases: GcLeases, *, fallback_hook: CapacityHook):
        self.config = config
        self.store = store
        self.leases = leases
        self._fallback_hook = fallback_hook
        #: One collection (plan + execute) at a time, automatic or not.
        self._run_lock = threading.Lock()
        #: Guards the caches below (stats() reads them from other threads).
        self._cache_lock = threading.Lock()
        self._blobs_by_key: dict[str, tuple[tuple[str, int], ...]] = {}
        self._created: dict[str, int] = {}
        self._deleted_mapped = 0
        self._last_usage = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs_total = 0
        self.bytes_freed_total = 0
        self.artifacts_deleted_total = 0
        self.deferred_total = 0

    # -- capacity --------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """The byte budget (0 = unlimited: only waste is collected)."""
        return int(self.config.capacity or 0)

    @property
    def high_bytes(self) -> int:
        return int(self.capacity * self.config.gc_high_watermark)

    @property
    def low_bytes(self) -> int:
        return int(self.capacity * self.config.gc_low_watermark)

    def deferred_reason(self) -> str:
        """Non-empty while GC must not run (the post-restart lease grace)."""
        if not self.leases.in_grace():
            return ""
        return f"lease grace period after restart: {self.leases.grace_left_s():.0f} s left"

    def pinned(self) -> set[str]:
        """Keys GC must keep: leased, or awaiting re-attach after a restart.

        Nothing else needs pinning, and this is why (an earlier version also
        asked the store for ``busy_keys()``, which no store ever had):

        - a key a publication has claimed but not committed is not in
          ``store.keys()``, so it is never a candidate;
        - a running publication's staging directory is ``in_flight`` in the
          snapshot, and ``remove_staging`` re-checks that under the store lock;
        - payload blobs a committing publication installed or reuses by
          dedup are referenced in ``store.blob_refs()`` (its pending blobs)
          under the store lock, so ``store.delete`` of another artifact never
          unlinks them and their plan item is reported kept;
        - a publication answered ``already_published`` at plan may see that
          unleased artifact collected before its commit; the commit then
          answers Aborted ("publish again") having written nothing. Pinning
          the key until the commit would not protect the caller anyway:
          nothing pins it after the commit either, until the caller's own
          lease, and only a lease keeps an artifact.

        tests/server/test_gc_collector.py runs the last two against the real Store.
        """
        return set(self.leases.pinned_keys())

    def _is_pinned(self, key: str) -> bool:
        return key in self.pinned() or bool(self.leases.holders(key))

    def _guard(self) -> Guard:
        """The store's delete guard, held around each pin check + delete.

        A lease grant first reads the artifact (``store.get``, under the
        store's lock), then records the lease. With the guard held from our
        pin check to the unlink, no grant can read the artifact in between:
        one that read it before our check has either recorded its lease (we
        see the pin and keep the artifact) or records it afterwards, and its
        client then fails to open the unlinked files and releases
        (FailedPrecondition). The remaining gap (a client opening the files
        in the instant before the unlink) closes when the lease manager
        re-checks ``store.contains(key)`` after recording a lease. Lock
        order: store, then leases (the lease manager never calls the store
        under its lock).
        """
        return self.store.delete_guard

    # -- snapshot -------------------------------------------------------------------

    def _blob_path(self, blob: str) -> str:
        return os.path.join(self.store.root, "blobs", "sha256", blob)

    def _blobs_of(self, key: str) -> tuple[tuple[str, int], ...] | None:
        cached = self._blobs_by_key.get(key)
        if cached is not None and all(os.path.exists(self._blob_path(b)) for b, _ in cached):
            return cached
        try:
            manifest, _paths = self.store.get(key)
        except (NotFound, FailedPrecondition):
            return None  # deleted or quarantined since keys(): not ours to plan
        blobs = tuple((f.blob, int(f.size)) for f in manifest.files)
        self._blobs_by_key[key] = blobs
        self._created[key] = int(manifest.created_unix)
        return blobs

    def snapshot(self) -> Snapshot:
        """The store's contents now, plus the deleted-but-mapped bytes."""
        with self._cache_lock:
            keys = list(self.store.keys())
            arts = []
            for key in keys:
                blobs = self._blobs_of(key)
                if blobs is not None:
                    arts.append(ArtifactRecord(key, blobs, int(self.leases.last_leased(key) or 0),
                                               self._created.get(key, 0)))
            dm = self._refresh_deleted_mapped(set(keys))
            snap = Snapshot(
                artifacts=tuple(arts),
                staging=_dir_records(self.store.staging_entries(), staging=True),
                quarantine=_dir_records(self.store.quarantine_entries(), staging=False),
                deleted_mapped_bytes=dm,
                taken_unix=time.time(),
            )
            self._last_usage = snap.usage
            return snap

    def _refresh_deleted_mapped(self, published: set[str]) -> int:
        """Bytes of blobs unlinked while a lease still maps them (a forced
        delete of a leased artifact). They stay on disk until the lease ends."""
        pinned = self.pinned()
        for key in [k for k in self._blobs_by_key if k not in published and k not in pinned]:
            del self._blobs_by_key[key]  # gone and unmapped: forget it
            self._created.pop(key, None)
        gone = {b: size for k in pinned if k not in published
                for b, size in self._blobs_by_key.get(k, ()) if not os.path.exists(self._blob_path(b))}
        self._deleted_mapped = sum(gone.values())
        return self._deleted_mapped

    # -- collecting -------------------------------------------------------------------

    def collect(self, *, target_bytes: int = 0, dry_run: bool = False) -> tuple[GcPlan, GcResult | None, str]:
        """Plans, and unless ``dry_run`` or deferred, executes a collection.

        Args:
            target_bytes: usage to collect down to; 0 = the low watermark (or,
                without a capacity, only staging leftovers and quarantine).
            dry_run: only plan.

        Returns:
            (plan, result or None when not executed, deferred reason or "").
        """
        with self._run_lock:
            snap = self.snapshot()
            if not target_bytes:
                target_bytes = self.low_bytes if self.capacity else snap.usage
            gc_plan = plan(snap, target_bytes=target_bytes, pinned=self.pinned())
            deferred = self.deferred_reason()
            if dry_run or deferred:
                self.deferred_total += bool(deferred and not dry_run)
                return gc_plan, None, deferred
            return gc_plan, self._execute(gc_plan, why="requested"), ""

    def _execute(self, gc_plan: GcPlan, *, why: str) -> GcResult:
        """Runs a plan and counts it; caller holds ``_run_lock``."""
        result = execute(gc_plan, store=self.store, is_pinned=self._is_pinned, guard=self._guard())
        self.runs_total += 1
        self.bytes_freed_total += result.bytes_freed
        self.artifacts_deleted_total += sum(1 for i in result.items if i.kind == "artifact")
        log.info("gc (%s): freed %d bytes in %d items (%d kept); usage %d -> %d, target %d", why,
                 result.bytes_freed, len(result.items), len(result.skipped), result.usage_before,
                 result.usage_after, gc_plan.target_bytes)
        return result

    def capacity_hook(self, nbytes: int, *, evict: bool = True, who: str = "") -> None:
        """Called by a publication or a pull: at plan with ``evict=False`` for
        all its bytes, then with ``evict=True`` for each step of the bytes
        that arrive (:class:`hwr_server.store.capacity.ArrivalAdmission`).

        The eviction policy: a transfer may make the collector delete
        unleased artifacts only for payload bytes that have arrived (a plan
        that is cancelled or left idle, or a registry that claims sizes and
        sends nothing, costs no other artifact), only when those bytes would
        cross the high watermark, only if they then fit (nothing is deleted
        for a transfer that cannot fit anyway), and only as much as they
        need: usage is brought to the high watermark less ``nbytes``, not
        to the low watermark (the background thread's hysteresis), so one
        chunk of a large plan deletes at most what that chunk needs. Least
        recently leased first, never a leased artifact; the log names the
        publication or pull and its peer (``who``).

        The dry run (``evict=False``) refuses what cannot fit even after
        collecting and otherwise returns, deleting nothing; the store's own
        check (capacity, disk space) then runs unless room is still to be
        made, in which case it runs after the collection at the first chunk.

        Raises:
            ResourceExhausted: the publication cannot fit within capacity.
        """
        cap = self.capacity
        if cap > 0:
            with self._run_lock:
                if self._make_room(int(nbytes), cap, evict=evict, who=who or "a publication") and not evict:
                    return  # fits once collected; the store's check runs after that collection
        self._fallback_hook(nbytes, who=who)  # the store's own check (disk free space)

    def _make_room(self, nbytes: int, cap: int, *, evict: bool, who: str) -> bool:
        """Collects (``evict``) or checks that collecting would make room.

        Returns:
            True when room had to be made (collected, or still to collect
            when not ``evict``); False when the bytes fit as things are.
        """
        what = f"{who}: {nbytes} bytes"
        if nbytes > cap:
            raise ResourceExhausted(f"{what}: larger than the store capacity {cap} bytes; raise `capacity`")
        snap = self.snapshot()
        if snap.usage + nbytes <= self.high_bytes:
            return False
        deferred = self.deferred_reason()
        if deferred:
            if snap.usage + nbytes <= cap:
                return False  # fits; collect after the grace period
            raise ResourceExhausted(f"{what}: usage {snap.usage} + {nbytes} exceeds capacity {cap} bytes and "
                                    f"GC cannot run yet ({deferred}); retry later")
        # Just enough for these bytes (see capacity_hook): the dry run checks
        # that the whole plan could fit; each arriving step collects its own.
        gc_plan = plan(snap, target_bytes=max(0, self.high_bytes - nbytes), pinned=self.pinned())
        if gc_plan.usage_after + nbytes > cap:
            raise ResourceExhausted(
                f"{what}: usage {snap.usage} bytes ({snap.usage - gc_plan.bytes_freed} leased, in flight or "
                f"still mapped) + {nbytes} exceeds capacity {cap} bytes even after collecting; release "
                f"leases or raise `capacity`")
        if not evict:
            log.info("gc: %s fits once %d bytes are collected; collecting as its payload arrives", what,
                     gc_plan.bytes_freed)
            return True
        log.info("gc: collecting %d bytes in %d items for %s", gc_plan.bytes_freed, len(gc_plan.items), what)
        result = self._execute(gc_plan, why=what)
        if result.usage_after + nbytes > cap:
            raise ResourceExhausted(f"{what}: usage {result.usage_after} + {nbytes} bytes exceeds capacity "
                                    f"{cap} bytes after collecting (leases arrived meanwhile); retry later")
        return True

    # -- background thread -------------------------------------------------------------

    def check(self) -> GcResult | None:
        """One automatic check: collects when usage is above the high watermark."""
        if self.capacity <= 0 or self.deferred_reason():
            return None
        with self._run_lock:
            snap = self.snapshot()
            if snap.usage <= self.high_bytes:
                return None
            gc_plan = plan(snap, target_bytes=self.low_bytes, pinned=self.pinned())
            return self._execute(gc_plan, why="above high watermark")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a failed pass must not end the thread
                log.exception("gc: automatic collection failed")
            # Sleep until the next interval, or just past the end of the
            # lease grace period; an event, not a sleep, so stop() is prompt.
            self._wake.wait(self._next_wait())
            self._wake.clear()

    def _next_wait(self) -> float:
        wait = float(self.config.gc_interval_s)
        if self.leases.in_grace():
            wait = min(wait, float(self.leases.grace_left_s()) + 0.1)
        return max(0.01, wait)

    def start(self) -> None:
        """Starts the background thread (the daemon calls this after recovery)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hwr-gc", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops the background thread; a collection in progress finishes first."""
        self._stop.set()
        # Wakes the thread out of its interval wait so it sees _stop now.
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def stats(self) -> dict[str, float]:
        """GC counters, capacity figures and deleted-but-mapped bytes."""
        try:
            usage = self.snapshot().usage
        except Exception:  # noqa: BLE001 - figures must not fail a scrape
            log.exception("gc: snapshot for stats failed")
            usage = self._last_usage
        return {
            "hwr_gc_runs_total": self.runs_total,
            "hwr_gc_bytes_freed_total": self.bytes_freed_total,
            "hwr_gc_artifacts_deleted_total": self.artifacts_deleted_total,
            "hwr_gc_deferred_total": self.deferred_total,
            'hwr_store_bytes{state="deleted_mapped"}': self._deleted_mapped,
            "hwr_store_accounted_bytes": usage,
            "hwr_store_capacity_bytes": self.capacity,
            "hwr_gc_in_grace": 1.0 if self.deferred_reason() else 0.0,
        }


__all__ = ["Collector", "execute"]
