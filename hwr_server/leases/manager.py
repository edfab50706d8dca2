"""Session-bound leases (DESIGN §7): what pins a published artifact while a
worker maps it.

Model:
  * A **session** is one client process's stream. It has a secret id
    (``secrets.token_urlsafe``) that AcquireLease/ReleaseLease must present,
    so one process can neither see nor release another's leases.
  * A **lease** pins one artifact key for one session. It ends on explicit
    release, when its session ends (the stream closed: exit, crash,
    SIGKILL), or when the session misses keepalives for
    ``config.keepalive_timeout_ms`` (a hung or stopped client). A background
    reaper thread enforces the timeout.
  * Lease records are persisted in ``<root>/index.sqlite`` (table
    ``leases``), keyed by the SHA-256 of the lease id so the file holds no
    usable secret. After a daemon restart the surviving records become
    **awaiting-reattach** for ``config.lease_grace_s``: a client that
    re-opens its session with ``reattach_lease_ids`` gets them back; the
    rest are dropped when the grace period ends. Until then they pin their
    keys, so GC and delete cannot remove anything leased before the restart.
  * A graceful shutdown (``begin_shutdown``) ends the session streams but
    keeps the records: a restart must not look like every client exiting.

GC and delete use :meth:`LeaseManager.holders`, :meth:`pinned_keys`,
:meth:`in_grace` and :meth:`last_leased`; this module never deletes anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
import sqlite3
import threading
import time
from typing import Callable, Iterable

from hwr_client.core.errors import FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from hwr_client.core.identity import check_key
from hwr_client.core.manifest import Manifest
from hwr_server import db
from hwr_server.access.admission import stream_capacity
from hwr_server.config import ServerConfig
from hwr_server.interfaces import LeaseStore

log = logging.getLogger(__name__)

ATTACHED = "attached"
AWAITING = "awaiting-reattach"
#: A client name is a label for operators, stored with every lease record:
#: longer ones are cut here so a client cannot bloat the index. Characters.
_MAX_CLIENT_NAME = 256
#: The reaper never sleeps longer than this, so a timeout or the end of the
#: grace period is noticed within about this bound. Seconds.
_MAX_REAP_PERIOD_S = 0.5

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS leases (
           id_hash TEXT PRIMARY KEY, id_prefix TEXT NOT NULL, key TEXT NOT NULL,
           pid INTEGER NOT NULL, client_name TEXT NOT NULL, acquired_unix INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS lease_usage (key TEXT PRIMARY KEY, last_unix INTEGER NOT NULL)""",
)


@dataclasses.dataclass(frozen=True)
class LeaseInfo:
    """What operators (and delete/GC) see of one lease. The whole id is a
    secret; only its first 8 characters are shown."""

    lease_id_prefix: str
    key: str
    pid: int
    client_name: str
    acquired_unix: int
    state: str  # ATTACHED or AWAITING


@dataclasses.dataclass(frozen=True)
class Grant:
    """The result of a successful acquire."""

    lease_id: str
    manifest_json: str
    blob_paths: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SessionGrant:
    """The result of opening a session."""

    session_id: str
    keepalive_interval_ms: int
    keepalive_timeout_ms: int
    reattached: tuple[str, ...]
    lost: tuple[str, ...]


@dataclasses.dataclass
class _Lease:
    id_hash: str
    id_prefix: str
    key: str
    pid: int
    client_name: str
    acquired_unix: int
    session: "_Session | None"  # None while awaiting re-attach

    def info(self) -> LeaseInfo:
        state = ATTACHED if self.session is not None else AWAITING
        return LeaseInfo(self.id_prefix, self.key, self.pid, self.client_name, self.acquired_unix, state)


@dataclasses.dataclass
class _Session:
    session_id: str
    pid: int
    client_name: str
    last_seen: float  # time.monotonic()
    leases: set[str] = dataclasses.field(default_factory=set)  # id hashes
    on_expire: Callable[[], None] | None = None


def _hash(lease_id: str) -> str:
    return hashlib.sha256(lease_id.encode("utf-8", "surrogatepass")).hexdigest()


class LeaseManager:
    """Sessions and leases of one daemon. Thread-safe: every public method
    takes one lock; database writes happen under it so memory and disk
    never disagree about which leases exist.

    Args:
        config: the resolved ServerConfig (root, keepalive and grace settings).
        store: what leases need of the store: ``get(key)`` returns (Manifest,
            blob paths) or raises NotFound / FailedPrecondition (quarantined);
            ``contains(key)`` re-checks after a grant.
    """

    def __init__(self, config: ServerConfig, store: LeaseStore):
        self.config = config
        self.store = store
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._leases: dict[str, _Lease] = {}  # id hash -> lease
        self._usage: dict[str, int] = {}  # key -> last leased unix seconds
        self._usage_dirty: set[str] = set()  # stamps not yet on disk
        self._manifest_cache: dict[str, tuple[Manifest, str]] = {}  # key -> (Manifest, its JSON)
        self._closing = False
        self._wake = threading.Event()
        self._reaper: threading.Thread | None = None
        self._db = db.connect(config.root)
        for stmt in _SCHEMA:
            self._db.execute(stmt)
        self._load()
        self._grace_deadline = time.monotonic() + float(config.lease_grace_s)
        #: Called with the session id after every session end (close, crash,
        #: SIGKILL, timeout, shutdown), outside the lock; the daemon sets it
        #: once before serving, so registration admission frees the ended
        #: session's pinned bytes (hwr_server.registration.admission).
        self.on_session_end: Callable[[str], object] | None = None

    # -- persistence -----------------------------------------------------------

    def _load(self) -> None:
        """Persisted leases come back as awaiting-reattach (no session)."""
        for id_hash, prefix, key, pid, name, acquired in self._db.execute(
            "SELECT id_hash, id_prefix, key, pid, client_name, acquired_unix FROM leases"
        ):
            self._leases[id_hash] = _Lease(id_hash, prefix, key, pid, name, acquired, None)
        for key, last in self._db.execute("SELECT key, last_unix FROM lease_usage"):
            self._usage[key] = last
        if self._leases:
            log.info("leases: %d persisted lease(s) await re-attach for %.0f s", len(self._leases),
                     self.config.lease_grace_s)

    def _persist_add(self, lease: _Lease) -> None:
        """Writes the record BEFORE the grant is visible: a lease the client
        holds always survives a daemon crash. One statement, so autocommit
        makes it atomic.

        Raises:
            Unavailable: the index cannot be written (nothing was granted,
                so a retry is safe).
        """
        try:
            self._db.execute(
                "INSERT INTO leases (id_hash, id_prefix, key, pid, client_name, acquired_unix) VALUES (?,?,?,?,?,?)",
                (lease.id_hash, lease.id_prefix, lease.key, lease.pid, lease.client_name, lease.acquired_unix),
            )
        except sqlite3.Error as exc:
            raise Unavailable(f"lease on {lease.key[:12]}: cannot record it in {db.FILENAME} ({exc}); "
                              "nothing was granted, retry") from None
        self._touch_usage(lease.key)

    def _persist_remove(self, leases: Iterable[_Lease]) -> None:
        """Deletes records. A failure is logged, not raised: the lease is
        already gone in memory, and a stale record only pins its key during
        the grace period after the next restart."""
        leases = list(leases)
        if not leases:
            return
        try:
            self._db.executemany("DELETE FROM leases WHERE id_hash = ?", [(x.id_hash,) for x in leases])
        except sqlite3.Error:
            log.exception("leases: could not delete %d lease record(s) from %s", len(leases), db.FILENAME)
        for key in {x.key for x in leases}:
            self._touch_usage(key)

    def _touch_usage(self, key: str) -> None:
        # Last use = last acquire or release: an artifact held for days and
        # released a minute ago was used a minute ago (GC's LRU order).
        # Written to disk by the reaper (flush_usage), not per call: a crash
        # loses at most one reaper period of stamps, which only shifts GC
        # order, and every acquire/release saves two statements.
        self._usage[key] = int(time.time())
        self._usage_dirty.add(key)

    def flush_usage(self) -> int:
        """Writes pending last-use stamps; returns how many. Caller holds
        the lock."""
        if not self._usage_dirty:
            return 0
        rows = [(k, self._usage[k]) for k in self._usage_dirty]
        try:
            self._db.executemany(
                "INSERT INTO lease_usage (key, last_unix) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET last_unix = excluded.last_unix",
                rows,
            )
        except sqlite3.Error:
            log.exception("leases: could not write %d last-use stamp(s)", len(rows))
            return 0
        self._usage_dirty.clear()
        return len(rows)

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Starts the reaper (keepalive timeouts, end of grace period)."""
        self._grace_deadline = time.monotonic() + float(self.config.lease_grace_s)
        self._reaper = threading.Thread(target=self._reap_loop, name="hwr-lease-reaper", daemon=True)
        self._reaper.start()

    def begin_shutdown(self) -> None:
        """Ends every session stream but KEEPS the lease records: after the
        restart, clients re-attach within the grace period."""
        with self._lock:
            self._closing = True
            callbacks = [s.on_expire for s in self._sessions.values() if s.on_expire]
        for cb in callbacks:
            cb()

    def stop(self) -> None:
        """Stops the reaper and closes the database. Records stay on disk."""
        self.begin_shutdown()
        self._wake.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        with self._lock:
            self.flush_usage()
            self._db.close()

    # -- sessions ----------------------------------------------------------------

    @property
    def max_sessions(self) -> int:
        """Open sessions allowed at once. A session stream occupies one gRPC
        worker thread for its whole life; without a cap, more sessions than
        threads would leave none for AcquireLease and every worker would
        hang. A quarter of the threads (at least 4) stays for unary calls:
        the same share the stream admission keeps (hwr_server.access.admission),
        which refuses the stream before it gets here; this check stays for
        callers of the manager itself."""
        return stream_capacity(self.config)

    def open_session(self, pid: int, client_name: str, reattach_ids: Iterable[str] = (),
                     on_expire: Callable[[], None] | None = None) -> SessionGrant:
        """Opens a session and re-binds the awaiting leases it names.

        Args:
            pid: the client's process id (shown to operators).
            client_name: free text for operators.
            reattach_ids: lease ids held on a previous session.
            on_expire: called (without the lock) when the daemon ends the
                session itself (keepalive timeout, shutdown), to end the stream.

        Raises:
            Unavailable: the daemon is shutting down.
            ResourceExhausted: too many open sessions (see max_sessions).
        """
        reattach_ids = list(reattach_ids)
        cap = int(self.config.max_leases_per_session)
        # Ids past max_leases_per_session are lost without a look-up: a
        # session never holds more (unless the cap was lowered across a
        # restart), and a client naming millions costs no per-id work.
        excess = reattach_ids[cap:]
        reattach_ids = reattach_ids[:cap]
        if excess:
            log.warning("session for pid %d: %d lease id(s) to re-attach exceed max_leases_per_session=%d; "
                        "reported lost", pid, len(excess), cap)
        if len(client_name) > _MAX_CLIENT_NAME:
            client_name = client_name[:_MAX_CLIENT_NAME - 1] + "…"
        session = _Session(secrets.token_urlsafe(24), int(pid), client_name, time.monotonic(), on_expire=on_expire)
        reattached, lost = [], []
        with self._lock:
            if self._closing:
                raise Unavailable("lease manager: daemon is shutting down; reconnect after it restarts")
            if len(self._sessions) >= self.max_sessions:
                raise ResourceExhausted(
                    f"session for pid {pid}: {len(self._sessions)} sessions are open, the limit is {self.max_sessions} "
                    f"(each holds one of grpc_threads={self.config.grpc_threads} daemon threads; the rest serve "
                    "calls); raise grpc_threads in the daemon config"
                )
            self._sessions[session.session_id] = session
            for lease_id in reattach_ids:
                lease = self._leases.get(_hash(lease_id))
                if lease is not None and lease.session is None:
                    lease.session, lease.pid, lease.client_name = session, session.pid, client_name
                    session.leases.add(lease.id_hash)
                    reattached.append(lease_id)
                else:
                    lost.append(lease_id)
            lost.extend(excess)
        if reattached or lost:
            log.info("session %s… (pid %d): re-attached %d lease(s), %d lost", session.session_id[:6], pid,
                     len(reattached), len(lost))
        cfg = self.config
        return SessionGrant(session.session_id, cfg.keepalive_interval_ms, cfg.keepalive_timeout_ms,
                            tuple(reattached), tuple(lost))

    def keepalive(self, session_id: str) -> bool:
        """Records a keepalive; False when the session is no longer open."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return False
            session.last_seen = time.monotonic()
            return True

    def end_session(self, session_id: str, *, reason: str = "stream ended") -> int:
        """Ends a session and releases its leases (their records are deleted),
        unless the daemon is shutting down, in which case the records stay
        for re-attach. Idempotent. Returns the number of leases released."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return 0
        if self.on_session_end is not None:
            # Outside the lock: the hook takes its own, and never ours.
            self.on_session_end(session_id)
        with self._lock:
            if self._closing:
                for h in session.leases:
                    if h in self._leases:
                        self._leases[h].session = None  # kept on disk for re-attach
                return 0
            gone = [self._leases.pop(h) for h in session.leases if h in self._leases]
            self._persist_remove(gone)
        if gone:
            log.info("session %s… (pid %d) ended (%s): released %d lease(s)", session_id[:6], session.pid, reason,
                     len(gone))
        return len(gone)

    # -- leases --------------------------------------------------------------------

    def acquire(self, session_id: str, key: str) -> Grant:
        """Pins ``key`` for the session.

        Raises:
            InvalidArgument: malformed key.
            FailedPrecondition: the session is not open, or the artifact is
                quarantined (from the store).
            NotFound: no published artifact with that key (from the store).
            ResourceExhausted: the session holds ``max_leases_per_session``
                leases already.
        """
        check_key(key)
        # Outside the lock: the store does its own locking, and a slow
        # lookup must not stall every other session's keepalive. store.get
        # reads the index under the store's lock, the one delete_guard()
        # holds around a delete's "is it leased?" check and its unlink, so
        # this read is never inside that gap; the
        # re-check after the record below closes the rest.
        manifest_json, paths = self._lookup(key)
        lease_id = secrets.token_urlsafe(24)
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise FailedPrecondition(
                    "session: not open (it ended, timed out or the daemon restarted); open a new session"
                )
            cap = int(self.config.max_leases_per_session)
            if len(session.leases) >= cap:
                # Before the record is written: a refused grant costs nothing.
                raise ResourceExhausted(
                    f"lease on {key[:12]} for session {session_id[:6]}… (pid {session.pid}): the session holds "
                    f"{len(session.leases)} leases, the limit is {cap} per session (max_leases_per_session); "
                    "close leases no longer mapped (Lease.close) or raise max_leases_per_session in the daemon config"
                )
            lease = _Lease(_hash(lease_id), lease_id[:8], key, session.pid, session.client_name, int(time.time()),
                           session)
            self._persist_add(lease)
            self._leases[lease.id_hash] = lease
            session.leases.add(lease.id_hash)
            session.last_seen = time.monotonic()  # any call proves liveness
        # Closes the gap with a concurrent delete/GC: it holds the store's
        # lock around "is it pinned?" + unlink. Either our record existed
        # before its check (it keeps the artifact), or it unlinked after our
        # store.get — then the artifact is gone now and we must not hand out
        # paths to it. Lock order: store, then leases (never the reverse).
        if not self.store.contains(key):
            self.release(session_id, lease_id)
            raise NotFound(f"artifact {key[:12]}: deleted while the lease was being granted")
        return Grant(lease_id, manifest_json, paths)

    def _lookup(self, key: str) -> tuple[str, tuple[str, ...]]:
        manifest, paths = self.store.get(key)
        cached = self._manifest_cache.get(key)
        if cached is None or cached[0] is not manifest:
            # Serializing a large manifest costs milliseconds; do it once per
            # manifest object the store hands out.
            cached = (manifest, manifest.to_json())
            self._manifest_cache[key] = cached
        return cached[1], tuple(paths)

    def release(self, session_id: str, lease_id: str) -> bool:
        """Releases a lease the session holds. Any other id (garbage,
        another session's, already released) changes nothing: False."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return False
            id_hash = _hash(lease_id)
            if id_hash not in session.leases:
                return False
            session.leases.discard(id_hash)
            lease = self._leases.pop(id_hash)
            self._persist_remove([lease])
            session.last_seen = time.monotonic()
        return True

    # -- queries for operators, GC and delete ------------------------------------------

    def holders(self, key: str) -> list[LeaseInfo]:
        """Leases (attached or awaiting re-attach) on ``key``, oldest first."""
        with self._lock:
            out = [x.info() for x in self._leases.values() if x.key == key]
        return sorted(out, key=lambda i: (i.acquired_unix, i.lease_id_prefix))

    def list(self) -> list[LeaseInfo]:
        """Every lease, sorted by acquisition time."""
        with self._lock:
            out = [x.info() for x in self._leases.values()]
        return sorted(out, key=lambda i: (i.acquired_unix, i.key, i.lease_id_prefix))

    def pinned_keys(self) -> set[str]:
        """Keys with an attached lease or a persisted one still awaiting
        re-attach (inside the grace period)."""
        with self._lock:
            return {x.key for x in self._leases.values()}

    def in_grace(self) -> bool:
        """True while persisted leases from before a restart may still be
        re-attached. It ends early once none is left awaiting."""
        with self._lock:
            awaiting = any(x.session is None for x in self._leases.values())
        return awaiting and time.monotonic() < self._grace_deadline

    def grace_left_s(self) -> float:
        """Seconds left in the grace period (0 when not in grace)."""
        return max(0.0, self._grace_deadline - time.monotonic()) if self.in_grace() else 0.0

    def last_leased(self, key: str) -> int:
        """Unix seconds of the last acquire or release of ``key``; 0 if never."""
        with self._lock:
            return self._usage.get(key, 0)

    def stats(self) -> dict[str, float]:
        """Lease and session gauges for GetStats and Prometheus."""
        with self._lock:
            attached = sum(1 for x in self._leases.values() if x.session is not None)
            return {
                "hwr_leases_active": float(attached),
                "hwr_leases_awaiting_reattach": float(len(self._leases) - attached),
                "hwr_sessions_active": float(len(self._sessions)),
            }

    # -- reaper --------------------------------------------------------------------

    def _reap_period(self) -> float:
        return max(0.02, min(_MAX_REAP_PERIOD_S, self.config.keepalive_timeout_ms / 1000.0 / 10))

    def _reap_loop(self) -> None:
        # The wait is only a sleep that stop() can cut short; correctness
        # does not depend on when it wakes.
        while not self._wake.wait(self._reap_period()):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad pass
                log.exception("lease reaper pass failed")

    def reap(self, now: float | None = None) -> tuple[int, int]:
        """One pass: ends sessions past the keepalive timeout and drops
        awaiting leases after the grace period. Returns (sessions ended,
        awaiting leases dropped)."""
        now = time.monotonic() if now is None else now
        timeout = self.config.keepalive_timeout_ms / 1000.0
        with self._lock:
            if self._closing:
                return 0, 0
            self.flush_usage()
            stale = [s for s in self._sessions.values() if now - s.last_seen > timeout]
            dropped: list[_Lease] = []
            if now >= self._grace_deadline:
                dropped = [x for x in self._leases.values() if x.session is None]
                for x in dropped:
                    del self._leases[x.id_hash]
                self._persist_remove(dropped)
        for x in dropped:
            log.warning("lease %s… on %s (pid %d) not re-attached within %.0f s: dropped", x.id_prefix, x.key[:12],
                        x.pid, self.config.lease_grace_s)
        for s in stale:
            n = self.end_session(s.session_id, reason=f"no keepalive for {timeout:.1f} s")
            log.warning("session %s… (pid %d) timed out: %d lease(s) released", s.session_id[:6], s.pid, n)
            if s.on_expire is not None:
                s.on_expire()
        return len(stale), len(dropped)


__all__ = ["ATTACHED", "AWAITING", "Grant", "LeaseInfo", "LeaseManager", "SessionGrant"]
