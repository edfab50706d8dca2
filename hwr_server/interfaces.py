"""The seams between the daemon's components: one small ``Protocol`` each.

Each component is handed the narrow interface it uses, never the whole
concrete class, and :mod:`hwr_server.daemon` is the one place that builds the
concrete components and wires them together. The protocols are structural:
:class:`hwr_server.store.store.Store` and :class:`hwr_server.leases.manager.LeaseManager`
satisfy them without naming them, and a test fake satisfies them by having
the same methods. What they buy is the type check: a component that calls a
method its seam does not declare, or a store that stops offering one, is a
mypy error in ``.ci/run`` instead of a protection that silently never runs
(``getattr(store, "busy_keys", None)`` once looked for a method no store had).

Seams::

    GC        -> store:  GcStore        (snapshot, delete, delete_guard)
    GC        -> leases: GcLeases       (pins, grace period, last use)
    scrub     -> store:  ScrubStore     (keys, verify, quarantine)
    scrub     -> leases: Pins           (pinned keys)
    leases    -> store:  LeaseStore     (get, contains)
    recovery  -> store:  RecoveryStore  (layout, load_index, quarantine)
    remote    -> store:  RemoteStore    (get, claim, staging, the commit's SequenceStore)
    metrics   -> each:   StatsSource    (flat figures)
    registration -> leases: a ``session_id -> bool`` liveness callable
                 (LeaseManager.keepalive); leases -> registration: the
                 ``on_session_end`` hook (RegistrationAdmission.end_session)
    daemon    -> each:   Lifecycle      (start, stop)
"""

from __future__ import annotations

import threading
from typing import ContextManager, Mapping, Protocol, Sequence

from hwr_client.core.manifest import Manifest
from hwr_server.access.publisher import Publisher


class CapacityHook(Protocol):
    """Called with a publication's or a pull's payload bytes before they
    are written; raises ResourceExhausted when they cannot fit.

    ``evict=False`` (at plan, for the whole claim) is a dry run: it refuses
    what cannot fit even after collecting, and deletes nothing.
    ``evict=True`` (for each step of bytes as they arrive,
    :mod:`hwr_server.store.capacity`) may collect unleased artifacts to make
    room for that step. ``who`` names the transfer and its peer in the log
    of what was collected and in a refusal.
    """

    def __call__(self, nbytes: int, *, evict: bool = True, who: str = "") -> None: ...


# -- records the seams exchange ---------------------------------------------------


class DirInfo(Protocol):
    """A staging or quarantine directory as the store lists it."""

    @property
    def name(self) -> str: ...

    @property
    def bytes(self) -> int: ...

    @property
    def in_flight(self) -> bool:
        """Staging only: a publication (or a delete) is using it now."""
        ...


class VerifyOutcome(Protocol):
    """The result of a deep verification of one artifact."""

    @property
    def ok(self) -> bool: ...

    @property
    def problems(self) -> tuple[str, ...]: ...

    @property
    def bytes_checked(self) -> int: ...

    @property
    def bad_blobs(self) -> tuple[str, ...]: ...


# -- what components need of the store ----------------------------------------------


class LeaseStore(Protocol):
    """What the lease manager needs of the store."""

    def get(self, key: str) -> tuple[Manifest, list[str]]:
        """The manifest and blob paths of a published artifact.

        Raises:
            NotFound: not published. FailedPrecondition: quarantined.
        """
        ...

    def contains(self, key: str) -> bool:
        """Whether ``key`` is published now (re-checked after a grant)."""
        ...

class GcStore(Protocol):
    """What garbage collection needs of the store."""

    @property
    def root(self) -> str:
        """The store root; payload blobs live under ``blobs/sha256/``."""
        ...

    def keys(self) -> list[str]: ...

    def get(self, key: str) -> tuple[Manifest, list[str]]: ...

    def staging_entries(self) -> Sequence[DirInfo]: ...

    def quarantine_entries(self) -> Sequence[DirInfo]: ...

    def delete(self, key: str) -> int:
        """Unpublishes ``key`` and unlinks the blobs nothing else references
        (published artifacts and in-flight commits); returns bytes freed."""
        ...

    def remove_staging(self, name: str) -> bool: ...

    def remove_quarantine(self, name: str) -> None: ...

    def delete_guard(self) -> ContextManager[None]:
        """Held around "is it pinned?" + :meth:`delete`: no lease grant can
        read the artifact in between (see ``Store.delete_guard``)."""
        ...


class ScrubStore(Protocol):
    """What the background scrub needs of the store."""

    def keys(self) -> list[str]: ...

    def verify(self, key: str) -> VerifyOutcome: ...

    def quarantine(self, key: str, reason: str, *, bad_blobs: tuple[str, ...] = ()) -> str: ...


class RecoveryStore(Protocol):
    """What start-up recovery (:mod:`hwr_server.store.recovery`) needs of the store:
    its layout, the index it rebuilds and quarantine for what fails checks."""

    @property
    def blobs_dir(self) -> str: ...

    @property
    def artifacts_dir(self) -> str: ...

    @property
    def staging_dir(self) -> str: ...

    @property
    def quarantine_dir(self) -> str: ...

    def blob_path(self, digest: str) -> str: ...

    def artifact_dir(self, key: str) -> str: ...

    def load_index(self, manifests: dict[str, Manifest]) -> None: ...

    def quarantine(self, key: str, reason: str, *, bad_blobs: tuple[str, ...] = (),
                   manifest: Manifest | None = None) -> str: ...


class SequenceStore(Protocol):
    """What the durable sequences (:mod:`hwr_server.store.commit`) need from
    the store (:class:`hwr_server.store.store.Store`)."""

    blobs_dir: str
    artifacts_dir: str
    staging_dir: str
    quarantine_dir: str

    @property
    def visibility_lock(self) -> threading.RLock: ...
    def blob_path(self, digest: str) -> str: ...
    def artifact_dir(self, key: str) -> str: ...
    def install_blob(self, key: str, staged: str, digest: str, size: int) -> bool: ...
    def blob_refs(self) -> dict[str, set[str]]: ...
    def known_bad_blobs(self) -> set[str]: ...
    def indexed(self, key: str) -> Manifest | None: ...
    def index_published(self, key: str, manifest: Manifest, publisher: Publisher) -> None: ...
    def index_unpublished(self, key: str, *, quarantine_entry: str = "", reason: str = "",
                          manifest: Manifest | None = None) -> None: ...


class RemoteStore(SequenceStore, Protocol):
    """What push and pull (:mod:`hwr_server.remote.remote`) need of the store: the
    published artifacts and their blobs (push), and a publication's claim,
    staging, capacity check and durable commit (pull)."""

    capacity_hook: CapacityHook

    def get(self, key: str) -> tuple[Manifest, list[str]]: ...

    def manifest_json(self, key: str) -> str: ...

    def contains(self, key: str) -> bool: ...

    def keys(self) -> list[str]:
        """Published keys (a push finds a weight artifact's compile artifacts)."""
        ...

    def indexed(self, key: str) -> Manifest | None:
        """The published manifest of ``key``, or None."""
        ...

    def publisher(self, key: str) -> Publisher | None:
        """Who published ``key`` (a push spreads only trusted artifacts);
        None when it is not published."""
        ...

    def claim(self, key: str, pub_id: str) -> bool:
        """Single flight with publications; True when already published."""
        ...

    def release_claim(self, key: str, pub_id: str, *, moved_blobs: tuple[str, ...] = ()) -> None: ...

    def new_staging(self, pub_id: str) -> str: ...


# -- what components need of the lease manager ----------------------------------------


class Pins(Protocol):
    """Which artifacts are pinned by a lease."""

    def pinned_keys(self) -> set[str]:
        """Keys with an attached lease or one awaiting re-attach."""
        ...


class LeaseHolder(Protocol):
    """One lease as GC and delete see it."""

    @property
    def key(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def acquired_unix(self) -> int: ...


class GcLeases(Pins, Protocol):
    """What garbage collection needs of the lease manager."""

    def holders(self, key: str) -> Sequence[LeaseHolder]:
        """Leases on ``key`` now (checked again right before each delete)."""
        ...

    def in_grace(self) -> bool:
        """True while leases from before a restart may still re-attach; GC
        does not run then."""
        ...

    def grace_left_s(self) -> float: ...

    def last_leased(self, key: str) -> int:
        """Unix seconds of the last acquire or release of ``key``; 0 if never."""
        ...


# -- what the daemon needs of every component ----------------------------------------------


class StatsSource(Protocol):
    """A component with figures for GetStats and Prometheus."""

    def stats(self) -> Mapping[str, float]:
        """Flat figures keyed by Prometheus name with inline labels."""
        ...


class Lifecycle(Protocol):
    """A component with background work: started after recovery, stopped at
    shutdown in reverse order."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


__all__ = [
    "CapacityHook", "DirInfo", "GcLeases", "GcStore", "LeaseHolder", "LeaseStore", "Lifecycle", "Pins",
    "RecoveryStore", "RemoteStore", "ScrubStore", "StatsSource", "VerifyOutcome",
]
