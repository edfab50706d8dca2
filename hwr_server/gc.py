"""Garbage collection: a pure reachability function, a plan, and its execution.

Shaped like containerd's ``pkg/gc``: :func:`reachable` is a pure graph walk;
:func:`plan` turns a :class:`Snapshot` of the store into a :class:`GcPlan`
(what would go, in execution order, and the bytes freed: the dry run);
:func:`execute` carries a plan out in a fixed order and only ever unlinks.

What goes, in this order, until usage is at or below the target:

1. staging leftovers that no publication is writing (never visible);
2. quarantined artifacts (never served);
3. unleased published artifacts, least recently leased first (then oldest
   first); a payload blob goes only when no remaining artifact references it.

Pinned artifacts (an active lease, or a persisted lease still inside the
post-restart grace period) are never candidates, and :func:`execute` checks
the pin again right before each delete because a lease may have arrived since
planning. Files are unlinked, never truncated or rewritten, so a process that
still maps a deleted payload keeps reading valid bytes; those bytes stay on
disk until it unmaps, which is why usage counts "deleted but still mapped".

:class:`Collector` is the daemon component: capacity watermarks, the
background thread, the publication capacity hook and the figures.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Callable, Hashable, Iterable, Mapping

from hwr_client.core.errors import FailedPrecondition, Internal, NotFound, ResourceExhausted

log = logging.getLogger(__name__)


# -- records -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArtifactRecord:
    """One published artifact as GC sees it."""

    key: str
    #: (blob sha256 hex, size in bytes) of each payload file.
    blobs: tuple[tuple[str, int], ...]
    #: Unix seconds of the last lease, 0 if never leased.
    last_leased: int = 0
    #: Unix seconds of publication.
    created: int = 0


@dataclasses.dataclass(frozen=True)
class DirRecord:
    """A staging or quarantine directory: its name and bytes on disk."""

    name: str
    bytes: int
    #: Staging only: a publication is still writing it (never collected).
    in_flight: bool = False


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the store holds at one moment; the only input of :func:`plan`."""

    artifacts: tuple[ArtifactRecord, ...] = ()
    staging: tuple[DirRecord, ...] = ()
    quarantine: tuple[DirRecord, ...] = ()
    #: Payload bytes already unlinked but still mapped by a lease holder.
    deleted_mapped_bytes: int = 0
    #: Unix seconds the snapshot was taken (for "last leased N s ago").
    taken_unix: float = 0.0

    @functools.cached_property
    def blob_sizes(self) -> dict[str, int]:
        """blob -> size, each blob once (computed once per snapshot)."""
        return {b: size for a in self.artifacts for b, size in a.blobs}

    @functools.cached_property
    def usage(self) -> int:
        """Accounted bytes: each blob once, staging, quarantine, deleted-mapped."""
        return (sum(self.blob_sizes.values()) + sum(d.bytes for d in self.staging)
                + sum(d.bytes for d in self.quarantine) + self.deleted_mapped_bytes)


@dataclasses.dataclass(frozen=True)
class GcItem:
    """One thing a plan removes."""

    #: "staging", "quarantine", "artifact" or "blob".
    kind: str
    #: Directory name, identity key or blob sha256 hex.
    name: str
    #: Bytes this item frees (an artifact's bytes are listed on its blobs).
    bytes: int
    #: Why it goes, for the operator.
    reason: str
    #: For a blob: the artifact whose removal drops its last reference.
    owner: str = ""


@dataclasses.dataclass(frozen=True)
class GcPlan:
    """The dry run: items in execution order and the figures they add up to."""

    items: tuple[GcItem, ...]
    usage_before: int
    target_bytes: int

    @property
    def bytes_freed(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def usage_after(self) -> int:
        return self.usage_before - self.bytes_freed

    def artifact_keys(self) -> list[str]:
        return [i.name for i in self.items if i.kind == "artifact"]


@dataclasses.dataclass(frozen=True)
class GcResult:
    """What :func:`execute` actually removed."""

    items: tuple[GcItem, ...]
    #: (item, why) for every planned item that was left in place.
    skipped: tuple[tuple[GcItem, str], ...]
    usage_before: int

    @property
    def bytes_freed(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def usage_after(self) -> int:
        return self.usage_before - self.bytes_freed


# -- the pure part -----------------------------------------------------------------


def reachable(roots: Iterable[Hashable], refs: Mapping[Hashable, Iterable[Hashable]]) -> set[Hashable]:
    """Every node reachable from ``roots`` along ``refs`` (roots included).

    Pure: no I/O, inputs untouched. Nodes missing from ``refs`` have no
    outgoing edges; cycles are fine.

    Args:
        roots: the live set (artifacts that stay).
        refs: node -> the nodes it references (artifact -> its blobs).

    Returns:
        The set of live nodes.

    Example:
        >>> sorted(reachable(["a"], {"a": ["x"], "b": ["x", "y"]}))
        ['a', 'x']
    """
    seen: set[Hashable] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(n for n in refs.get(node, ()) if n not in seen)
    return seen


def _age(now: float, then: int) -> str:
    return f"{max(0, int(now - then))} s ago"


def _artifact_reason(a: ArtifactRecord, now: float) -> str:
    if a.last_leased:
        return f"unleased, last leased {_age(now, a.last_leased)}"
    return f"unleased, never leased (published {_age(now, a.created)})"


def plan(snapshot: Snapshot, *, target_bytes: int, pinned: Iterable[str] = ()) -> GcPlan:
    """What to remove so that usage is at most ``target_bytes``.

    Pure. Staging leftovers and quarantined artifacts always go (they are
    waste); then unleased artifacts, least recently leased first, until the
    target is met. A blob is listed right after the artifact whose removal
    drops its last reference; shared blobs of surviving artifacts stay.
    If the target cannot be met (everything left is pinned), the plan removes
    all it may and ``usage_after`` says how far it got.

    Args:
        snapshot: the store's contents.
        target_bytes: usage to collect down to.
        pinned: identity keys that must survive (leased or in grace).

    Returns:
        The plan, items in execution order.

    Raises:
        Internal: the incremental accounting disagrees with :func:`reachable`
            (a bug; nothing has been deleted).
    """
    pinned = set(pinned)
    now = snapshot.taken_unix or time.time()
    items: list[GcItem] = []
    items += [GcItem("staging", d.name, d.bytes, "staging leftover, no publication writing it")
              for d in snapshot.staging if not d.in_flight]
    items += [GcItem("quarantine", d.name, d.bytes, "quarantined artifact") for d in snapshot.quarantine]
    usage = snapshot.usage - sum(i.bytes for i in items)
    sizes = snapshot.blob_sizes
    refcount = collections.Counter(b for a in snapshot.artifacts for b in {b for b, _ in a.blobs})
    candidates = sorted((a for a in snapshot.artifacts if a.key not in pinned),
                        key=lambda a: (a.last_leased, a.created, a.key))
    removed: set[str] = set()
    for a in candidates:
        if usage <= target_bytes:
            break
        removed.add(a.key)
        items.append(GcItem("artifact", a.key, 0, _artifact_reason(a, now)))
        for blob in sorted({b for b, _ in a.blobs}):
            refcount[blob] -= 1
            if refcount[blob] == 0:
                items.append(GcItem("blob", blob, sizes[blob], f"last reference ({a.key[:12]}) removed", owner=a.key))
                usage -= sizes[blob]
    _check_against_reachability(snapshot, removed, {i.name for i in items if i.kind == "blob"})
    return GcPlan(tuple(items), snapshot.usage, target_bytes)


def _check_against_reachability(snapshot: Snapshot, removed: set[str], freed: set[str]) -> None:
    """The blobs the plan frees must be exactly those no kept artifact reaches."""
    refs = {("a", a.key): [("b", b) for b, _ in a.blobs] for a in snapshot.artifacts}
    live = reachable([("a", a.key) for a in snapshot.artifacts if a.key not in removed], refs)
    dead = {b for b in snapshot.blob_sizes if ("b", b) not in live}
    if dead != freed:
        raise Internal(f"gc plan: blobs freed {sorted(freed)} differ from unreachable blobs {sorted(dead)}")


# -- execution -------------------------------------------------------------------------


def execute(
    gc_plan: GcPlan,
    *,
    store: object,
    is_pinned: Callable[[str], bool],
    guard: Callable[[], object] | None = None,
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
        gc_plan: from :func:`plan`.
        store: the Store (``delete``, ``remove_staging``, ``remove_quarantine``,
            ``root``).
        is_pinned: called right before each artifact delete.
        guard: optional context-manager factory held around check+delete so
            no lease can be granted in between (the lease manager's lock).

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


def _execute_one(item: GcItem, store: object, is_pinned: Callable[[str], bool],
                 guard: Callable[[], object] | None, deleted: set[str]) -> str:
    """Removes one item; returns "" on success or why it was kept."""
    if item.kind == "staging":
        store.remove_staging(item.name)  # type: ignore[attr-defined]
    elif item.kind == "quarantine":
        store.remove_quarantine(item.name)  # type: ignore[attr-defined]
    elif item.kind == "artifact":
        return _delete_artifact(item.name, store, is_pinned, guard, deleted)
    elif item.kind == "blob":
        if item.owner not in deleted:
            return f"its artifact {item.owner[:12]} was kept"
        if os.path.exists(os.path.join(store.root, "blobs", "sha256", item.name)):  # type: ignore[attr-defined]
            return "still referenced (a publication or a kept artifact uses it)"
    else:
        raise Internal(f"gc item kind {item.kind!r}: expected staging, quarantine, artifact or blob")
    log.info("gc: removed %s %s (%d bytes): %s", item.kind, item.name[:16], item.bytes, item.reason)
    return ""


def _delete_artifact(key: str, store: object, is_pinned: Callable[[str], bool],
                     guard: Callable[[], object] | None, deleted: set[str]) -> str:
    if guard is None:
        if is_pinned(key):
            return "leased since planning"
        store.delete(key)  # type: ignore[attr-defined]
    else:
        with guard():  # type: ignore[attr-defined]
            # Under the lease manager's lock: no lease can be granted between
            # this check and the unlink.
            if is_pinned(key):
                return "leased since planning"
            store.delete(key)  # type: ignore[attr-defined]
    deleted.add(key)
    log.info("gc: removed artifact %s", key[:16])
    return ""


# -- the daemon component ------------------------------------------------------------


def _field(entry: object, *names: str, default: object = None) -> object:
    """Reads a record field whether the store returns tuples or records."""
    for n in names:
        if hasattr(entry, n):
            return getattr(entry, n)
    return default


def _dir_records(entries: Iterable[object], *, staging: bool) -> tuple[DirRecord, ...]:
    out = []
    for e in entries:
        if isinstance(e, tuple):
            name, nbytes, *rest = e
            # A staging tuple without an in-flight flag: assume it is being
            # written (never collect what a publication may still need).
            in_flight = bool(rest[0]) if rest else staging
        else:
            name = _field(e, "name")
            nbytes = _field(e, "bytes", "size_bytes", "nbytes", default=0)
            in_flight = bool(_field(e, "in_flight", "active", default=staging))
        out.append(DirRecord(str(name), int(nbytes), in_flight if staging else False))
    return tuple(out)


class Collector:
    """Keeps the store within ``config.capacity``.

    Above ``gc_high_watermark`` of the capacity the background thread collects
    down to ``gc_low_watermark``; a publication whose plan would cross the high
    watermark collects first (synchronously, in the store's capacity hook) and
    fails with ResourceExhausted if it still cannot fit. Nothing is collected
    while the lease manager is inside its post-restart grace period.

    Args:
        config: the daemon's ServerConfig.
        store: the Store (may be None while that module is absent).
        leases: the LeaseManager (may be None: then nothing is pinned).
    """

    def __init__(self, config: object, store: object, leases: object):
        self.config = config
        self.store = store
        self.leases = leases
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
        self._fallback_hook = getattr(store, "capacity_hook", None)
        if store is not None:
            store.capacity_hook = self.capacity_hook  # type: ignore[attr-defined]

    # -- capacity --------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return int(getattr(self.config, "capacity", 0) or 0)

    @property
    def high_bytes(self) -> int:
        return int(self.capacity * self.config.gc_high_watermark)  # type: ignore[attr-defined]

    @property
    def low_bytes(self) -> int:
        return int(self.capacity * self.config.gc_low_watermark)  # type: ignore[attr-defined]

    def deferred_reason(self) -> str:
        """Non-empty while GC must not run (the post-restart lease grace)."""
        if self.leases is None or not self.leases.in_grace():  # type: ignore[attr-defined]
            return ""
        left = getattr(self.leases, "grace_left_s", None)
        if callable(left):
            return f"lease grace period after restart: {left():.0f} s left"
        return f"lease grace period after restart ({self.config.lease_grace_s:.0f} s)"  # type: ignore[attr-defined]

    def pinned(self) -> set[str]:
        """Keys GC must keep: leased (or awaiting re-attach), plus any the
        store reports busy (e.g. a publication answering "already published")."""
        out: set[str] = set()
        if self.leases is not None:
            out |= set(self.leases.pinned_keys())  # type: ignore[attr-defined]
        busy = getattr(self.store, "busy_keys", None)
        if callable(busy):
            out |= set(busy())
        return out

    def _is_pinned(self, key: str) -> bool:
        if key in self.pinned():
            return True
        return self.leases is not None and bool(self.leases.holders(key))  # type: ignore[attr-defined]

    def _guard(self) -> Callable[[], object] | None:
        """The store's lock, held around each pin check + delete.

        A lease grant first reads the artifact (``store.get``, under this
        lock), then records the lease. With the lock held from our pin check
        to the unlink, no grant can read the artifact in between: one that
        read it before our check has either recorded its lease (we see the
        pin and keep the artifact) or records it afterwards, and its client
        then fails to open the unlinked files and releases (FailedPrecondition).
        The remaining gap (a client opening the files in the instant before
        the unlink) closes when the lease manager re-checks
        ``store.contains(key)`` after recording a lease. Lock order: store,
        then leases (the lease manager never calls the store under its lock).
        """
        lock = getattr(self.store, "lock", None) or getattr(self.store, "_lock", None)
        return (lambda: lock) if lock is not None else None

    # -- snapshot -------------------------------------------------------------------

    def _blob_path(self, blob: str) -> str:
        return os.path.join(self.store.root, "blobs", "sha256", blob)  # type: ignore[attr-defined]

    def _blobs_of(self, key: str) -> tuple[tuple[str, int], ...] | None:
        cached = self._blobs_by_key.get(key)
        if cached is not None and all(os.path.exists(self._blob_path(b)) for b, _ in cached):
            return cached
        try:
            manifest, _paths = self.store.get(key)  # type: ignore[attr-defined]
        except (NotFound, FailedPrecondition):
            return None  # deleted or quarantined since keys(): not ours to plan
        blobs = tuple((f.blob, int(f.size)) for f in manifest.files)
        self._blobs_by_key[key] = blobs
        self._created[key] = int(manifest.created_unix)
        return blobs

    def snapshot(self) -> Snapshot:
        """The store's contents now, plus the deleted-but-mapped bytes."""
        if self.store is None:
            return Snapshot(taken_unix=time.time())
        last = getattr(self.leases, "last_leased", None)
        with self._cache_lock:
            keys = list(self.store.keys())  # type: ignore[attr-defined]
            arts = []
            for key in keys:
                blobs = self._blobs_of(key)
                if blobs is not None:
                    arts.append(ArtifactRecord(key, blobs, int(last(key) or 0) if last else 0,
                                               self._created.get(key, 0)))
            dm = self._refresh_deleted_mapped(set(keys))
            snap = Snapshot(
                artifacts=tuple(arts),
                staging=_dir_records(self.store.staging_entries(), staging=True),  # type: ignore[attr-defined]
                quarantine=_dir_records(self.store.quarantine_entries(), staging=False),  # type: ignore[attr-defined]
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

    def capacity_hook(self, nbytes: int) -> None:
        """Called by the store at publication plan, before any payload.

        Collects if the new bytes would cross the high watermark; raises if
        they still cannot fit, without deleting anything in that case.

        Raises:
            ResourceExhausted: the publication cannot fit within capacity.
        """
        cap = self.capacity
        if cap > 0:
            with self._run_lock:
                self._make_room(int(nbytes), cap)
        if self._fallback_hook is not None:
            self._fallback_hook(nbytes)  # the store's own check (disk free space)

    def _make_room(self, nbytes: int, cap: int) -> None:
        what = f"publication of {nbytes} bytes"
        if nbytes > cap:
            raise ResourceExhausted(f"{what}: larger than the store capacity {cap} bytes; raise `capacity`")
        snap = self.snapshot()
        if snap.usage + nbytes <= self.high_bytes:
            return
        deferred = self.deferred_reason()
        if deferred:
            if snap.usage + nbytes <= cap:
                return  # fits; collect after the grace period
            raise ResourceExhausted(f"{what}: usage {snap.usage} + {nbytes} exceeds capacity {cap} bytes and "
                                    f"GC cannot run yet ({deferred}); retry later")
        gc_plan = plan(snap, target_bytes=max(0, self.low_bytes - nbytes), pinned=self.pinned())
        if gc_plan.usage_after + nbytes > cap:
            raise ResourceExhausted(
                f"{what}: usage {snap.usage} bytes ({snap.usage - gc_plan.bytes_freed} leased, in flight or "
                f"still mapped) + {nbytes} exceeds capacity {cap} bytes even after collecting; release "
                f"leases or raise `capacity`")
        result = self._execute(gc_plan, why=what)
        if result.usage_after + nbytes > cap:
            raise ResourceExhausted(f"{what}: usage {result.usage_after} + {nbytes} bytes exceeds capacity "
                                    f"{cap} bytes after collecting (leases arrived meanwhile); retry later")

    # -- background thread -------------------------------------------------------------

    def check(self) -> GcResult | None:
        """One automatic check: collects when usage is above the high watermark."""
        if self.capacity <= 0 or self.store is None or self.deferred_reason():
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
        wait = float(self.config.gc_interval_s)  # type: ignore[attr-defined]
        left = getattr(self.leases, "grace_left_s", None)
        if callable(left) and self.leases.in_grace():  # type: ignore[attr-defined]
            wait = min(wait, float(left()) + 0.1)
        return max(0.01, wait)

    def start(self) -> None:
        """Starts the background thread (the daemon calls this after recovery)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hwr-gc", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
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
