"""Garbage collection, the pure part: records, reachability and the plan.

Shaped like containerd's ``pkg/gc``: :func:`reachable` is a pure graph walk;
:func:`plan` turns a :class:`Snapshot` of the store into a :class:`GcPlan`
(what would go, in execution order, and the bytes freed: the dry run) and
checks its own accounting against :func:`reachable` before anything is
deleted. Nothing here does I/O; :mod:`hwr_server.gc.collector` takes the snapshot and
carries the plan out.

What goes, in this order, until usage is at or below the target:

1. staging leftovers that no publication is writing (never visible);
2. quarantined artifacts (never served);
3. unleased published artifacts, least recently leased first (then oldest
   first); a payload blob goes only when no remaining artifact references it.

Pinned artifacts (an active lease, or a persisted lease still inside the
post-restart grace period) are never candidates.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Hashable, Iterable, Mapping, TypeVar

from hwr_client.core.errors import Internal

#: A node of the reference graph (an artifact or a blob).
N = TypeVar("N", bound=Hashable)

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


class _Figures:
    """What a plan and a result both add up to: the bytes their items free
    and the usage left after them."""

    items: tuple[GcItem, ...]
    usage_before: int

    @property
    def bytes_freed(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def usage_after(self) -> int:
        return self.usage_before - self.bytes_freed


@dataclasses.dataclass(frozen=True)
class GcPlan(_Figures):
    """The dry run: items in execution order and the figures they add up to."""

    items: tuple[GcItem, ...]
    usage_before: int
    target_bytes: int

    def artifact_keys(self) -> list[str]:
        return [i.name for i in self.items if i.kind == "artifact"]


@dataclasses.dataclass(frozen=True)
class GcResult(_Figures):
    """What :func:`hwr_server.gc.collector.execute` actually removed."""

    items: tuple[GcItem, ...]
    #: (item, why) for every planned item that was left in place.
    skipped: tuple[tuple[GcItem, str], ...]
    usage_before: int


# -- the pure part -----------------------------------------------------------------


def reachable(roots: Iterable[N], refs: Mapping[N, Iterable[N]]) -> set[N]:
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
    seen: set[N] = set()
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


__all__ = ["ArtifactRecord", "DirRecord", "GcItem", "GcPlan", "GcResult", "Snapshot", "plan", "reachable"]
