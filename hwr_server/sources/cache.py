"""The node-local source-digest cache (DESIGN §6).

``SourceCache.resolve(paths)`` returns a content id (``sha256:<hex>``) per
canonical checkpoint file, from the first of:

1. **hub**: a Hugging Face hub cache file whose snapshot link points straight
   at ``blobs/<64 hex>`` of the same repo: the blob name IS the file's SHA-256
   (huggingface_hub names LFS blobs by it and verifies it on download), so
   nothing is hashed. Only that exact topology is trusted (:func:`hub_blob_digest`).
2. **cache**: a record in ``<root>/index.sqlite`` for the same path whose
   device, inode, size, mtime_ns, ctime_ns and resolved symlink target all
   equal the file's now, and whose own checksum verifies.
3. **hashed**: otherwise the file is hashed with
   :func:`hwr_client.core.digests.hash_file`'s primitives (one implementation for
   daemon and client), in parallel across files on a thread pool, ONCE per
   file however many callers ask at the same time (single flight), and the
   record is rewritten.

The cache is an optimisation only: any database failure (locked, unreadable,
corrupt, a garbled row or a bad checksum) is logged and the file is hashed,
so the content id is identical with or without it.

Access: every path is checked by :class:`hwr_server.sources.access.SourceAccess`
for the calling peer BEFORE a hub name, a cache record or a hash answers for
it (the daemon runs as root and never vouches for a file
its caller could not read itself); the hashing job then reads only the exact
file version that was cleared. Without source roots (the default) the daemon
answers any regular file a PROVEN caller may read; source roots restrict it
to those directories. Refused is PERMISSION_DENIED, and the client hashes
the file itself with its own rights.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import sqlite3
import threading
import time
from typing import Any, Sequence

from hwr_client.core.digests import (
    SourceDigest, check_path_text, content_id_of, hash_fd, normalize_path, open_path, real_path_of,
    reopen_for_reading,
)
from hwr_client.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from hwr_server import db
from hwr_server.access.peers import ANONYMOUS, Peer
from hwr_server.logtext import untrusted
from hwr_server.store.hashing import background_thread
from hwr_server.sources.access import Seen, SourceAccess
from hwr_server.sources.records import (  # noqa: F401 - TABLE, records: re-exported
    _SCHEMA, TABLE, FileState, SourceRecordRow, hub_blob_digest,
)

log = logging.getLogger(__name__)

#: A file whose ctime/mtime is this close to the moment we stat it is not
#: recorded ("racily clean", as git calls it): a same-size rewrite within one
#: filesystem timestamp tick would leave every stat field unchanged. Local
#: Linux filesystems tick every few ms; 1 s also covers coarse network
#: filesystems. Such a file is hashed again next time, then recorded.
RACY_WINDOW_NS = 1_000_000_000

#: Busy timeout of the cache's connection. Short: a locked database must not
#: stall a start; the file is hashed instead.
DB_TIMEOUT_S = 1.0

class SourceCache:
    """Content ids of canonical files for the daemon; see the module doc.

    Thread-safe: gRPC worker threads call :meth:`resolve` concurrently.
    ``hash_calls`` counts files actually hashed (tests assert on it).
    """

    def __init__(self, config: Any, *, racy_window_ns: int = RACY_WINDOW_NS):
        self.config = config
        self.root: str = config.root
        self.roots = [os.path.realpath(r) for r in config.source_roots]
        self.access = SourceAccess(self.roots)
        self.racy_window_ns = racy_window_ns
        threads = config.hash_threads or 2 * (os.cpu_count() or 1)
        # Hashing threads: each hashes one file (SHA-256 is sequential within
        # a file); hashlib releases the GIL, so N threads use N cores. Twice
        # the cores: a cold file's thread waits on the disk part of the time,
        # and with one thread per core that core idles (measured: 0.76 of the
        # cold-read cap with 2 threads on 2 cores, 0.88-1.05 with 4).
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="hwr-source-hash",
                                                           initializer=background_thread, initargs=("hwr-src-hash", 0))
        # Hashes nobody waits for (a certain miss's sources: the worker
        # loads canonically meanwhile, the identity is for its publication)
        # run niced like publication (ServerConfig.publication_nice): on a
        # busy node the worker's load and first output come first. A caller
        # that waits later joins the same flight.
        nice = int(config.publication_nice)
        self._background_pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="hwr-source-hash-bg", initializer=background_thread,
            initargs=("hwr-src-hash-bg", nice))  # OS thread names: 15 bytes at most
        # Guards the in-flight map and the counters. Re-entrant: a done
        # callback added to an already finished future runs at once, in the
        # thread that adds it (which holds this lock).
        self._lock = threading.RLock()
        self._inflight: dict[FileState, concurrent.futures.Future] = {}
        self._db_lock = threading.Lock()  # the one sqlite connection
        self._conn: sqlite3.Connection | None = None
        self._db_failing = False
        self.hash_calls = 0
        self.hits = 0
        self.misses = 0
        self.hub_hits = 0
        self.hashed_bytes = 0
        self.db_errors = 0

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Opens the database early so a problem shows in the startup log."""
        where = (f"under the source roots {self.roots}" if self.roots
                 else "for any file a caller of proven uid may read (no source roots)")
        log.info("source cache: vouching %s, %d hash thread(s)", where, self._pool._max_workers)
        with self._db_lock:
            self._connection()

    def stop(self) -> None:
        """Stops hashing (queued jobs are cancelled) and closes the database."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._background_pool.shutdown(wait=False, cancel_futures=True)
        with self._db_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "hwr_source_cache_hits_total": float(self.hits),
                "hwr_source_cache_misses_total": float(self.misses),
                "hwr_source_hub_trusted_total": float(self.hub_hits),
                "hwr_source_hash_calls_total": float(self.hash_calls),
                "hwr_source_hashed_bytes_total": float(self.hashed_bytes),
                "hwr_source_cache_errors_total": float(self.db_errors),
            }

    # -- resolving -------------------------------------------------------------

    def resolve(self, paths: Sequence[str], *, peer: Peer = ANONYMOUS,
                seen: Sequence[Seen | None] | None = None) -> list[SourceDigest]:
        """Content ids of ``paths``, in order, for the caller ``peer``.

        Every path is checked (access for ``peer``, type; see the module doc)
        before any file is hashed; then hub names and cache records answer
        what they can; misses are hashed in parallel, each file once across
        all concurrent callers.

        Args:
            paths: absolute paths.
            peer: who asks (:func:`hwr_server.access.peers.peer_of`); the default,
                unknown, gets only what anyone may read.
            seen: per path, the file as the caller sees it
                (:class:`~hwr_server.sources.access.Seen`), or None.

        Raises:
            InvalidArgument: a relative path, a NUL byte, a directory, FIFO
                or device.
            PermissionDenied: outside the source roots, or not readable by
                ``peer`` (or by the daemon); no source roots and ``peer``
                unproven or without ``seen``; ``seen`` not the daemon's file.
            NotFound: a missing file or a broken link.
            FailedPrecondition: a file changed or moved while it was checked
                or hashed.
        """
        self.access.check_caller(peer)
        views = list(seen) if seen is not None else [None] * len(paths)
        checked = [(p, *self._check(p, peer, v)) for p, v in zip(paths, views)]
        return self._answer(checked, wait=True)  # type: ignore[return-value]

    def resolve_each(self, paths: Sequence[str], *, peer: Peer = ANONYMOUS, wait: bool = True,
                     seen: Sequence[Seen | None] | None = None) -> list[SourceDigest | PermissionDenied | None]:
        """As :meth:`resolve`, but each path the daemon will not vouch for
        to ``peer`` is answered by its PermissionDenied instead of failing
        the request (ResolveLease: the client hashes those itself), and,
        with ``wait=False``, a file that must be hashed is answered None at
        once while its hash runs on (the next request joins it or finds its
        record).

        Raises:
            InvalidArgument, NotFound, FailedPrecondition: as :meth:`resolve`.
        """
        try:
            self.access.check_caller(peer)
        except PermissionDenied as exc:
            return [exc for _ in paths]
        out: list[SourceDigest | PermissionDenied | None] = []
        checked: list[tuple[str, str, FileState]] = []
        where: list[int] = []
        views = list(seen) if seen is not None else [None] * len(paths)
        for p, v in zip(paths, views):
            try:
                checked.append((p, *self._check(p, peer, v)))
            except PermissionDenied as exc:
                out.append(exc)
                continue
            where.append(len(out))
            out.append(None)
        for i, answer in zip(where, self._answer(checked, wait=wait)):
            out[i] = answer
        return out

    def _answer(self, checked: list[tuple[str, str, FileState]], *, wait: bool) -> list[SourceDigest | None]:
        """Answers checked paths from hub names and records, hashing the rest
        (single flight); without ``wait``, those are None."""
        out: list[SourceDigest | None] = []
        pending: list[tuple[int, str, str, FileState, concurrent.futures.Future]] = []
        for i, (path, norm, state) in enumerate(checked):
            answer = self._answer_without_hashing(path, norm, state)
            out.append(answer)
            if answer is None:
                pending.append((i, path, norm, state, self._flight(norm, state, background=not wait)))
        with self._lock:
            self.hits += sum(1 for d in out if d is not None and d.origin == "cache")
            self.hub_hits += sum(1 for d in out if d is not None and d.origin == "hub")
            self.misses += len(pending)
        for i, path, norm, state, future in pending:
            if not wait:
                # Our path's record is written when the flight ends, even if
                # that flight was started for another path to the same file.
                future.add_done_callback(functools.partial(self._record_joined, norm, state))
                continue
            try:
                hex_digest, recorded, t0 = future.result()
            except concurrent.futures.CancelledError:  # stop() cancelled the queued job
                raise Unavailable(f"source {path}: the daemon is shutting down; retry") from None
            if recorded != norm:  # joined the flight of another path to this file: record ours too
                self._record(norm, state, hex_digest, t0)
            out[i] = SourceDigest(path, content_id_of(hex_digest), state.size, False, "hashed")
        return out

    def _record_joined(self, norm: str, state: FileState, future: concurrent.futures.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # the next request hashes again and reports the error
        hex_digest, recorded, t0 = future.result()
        if recorded != norm:
            self._record(norm, state, hex_digest, t0)

    def _check(self, path: str, peer: Peer, seen: Seen | None = None) -> tuple[str, FileState]:
        """Access and type checks of one path for ``peer``
        (:meth:`SourceAccess.check`); returns the normalized path and the
        state of the file it named."""
        norm, st, real = self.access.check(path, peer, seen)
        return norm, FileState.of(st, real)

    def _answer_without_hashing(self, path: str, norm: str, state: FileState) -> SourceDigest | None:
        # Both answers are for the file _check opened and cleared: the hub
        # blob only when it is that very inode, a record only when its
        # state (device, inode, size, times, real path) is that file's now.
        hub = hub_blob_digest(norm)
        if hub is not None and (hub[1].st_dev, hub[1].st_ino, hub[1].st_size) == (state.dev, state.ino, state.size):
            return SourceDigest(path, content_id_of(hub[0]), state.size, True, "hub")
        record = self._load(norm)
        if record is not None and record.state == state:
            return SourceDigest(path, record.content_id, state.size, True, "cache")
        return None

    def _flight(self, path: str, state: FileState, *, background: bool = False) -> concurrent.futures.Future:
        """The in-flight hash of this file version, started if there is none.

        Joining another caller's flight is safe: the flight is keyed by the
        file version (device, inode, times, real path) that this caller's own
        check cleared.
        """
        with self._lock:
            future = self._inflight.get(state)
            if future is None:
                try:
                    pool = self._background_pool if background else self._pool
                    future = pool.submit(self._hash_and_record, path, state)
                except RuntimeError:  # the pool is shut down: the daemon is stopping
                    raise Unavailable(f"source {path}: the daemon is shutting down; retry") from None
                self._inflight[state] = future
                future.add_done_callback(functools.partial(self._forget_flight, state))
            return future

    def _forget_flight(self, state: FileState, _future: concurrent.futures.Future) -> None:
        # Runs after the record is written (inside the job), so a caller that
        # misses the flight finds the record instead of hashing again.
        with self._lock:
            self._inflight.pop(state, None)

    def _hash_and_record(self, path: str, expected: FileState) -> tuple[str, str, int]:
        """Hashes the file ``path`` names (one pool job) and records the result.

        The name is resolved once more (no descriptor is held across the
        queue: a request of many files must not hold as many descriptors)
        and the file it reaches must be EXACTLY the version ``_check``
        cleared (device, inode, size, times, real path), else nothing is
        read. The read, the size and the after-check all use that descriptor.

        Returns:
            (64 hex, path recorded, time_ns when hashing began).

        Raises:
            FailedPrecondition: the file changed before or while it was read.
        """
        with self._lock:
            self.hash_calls += 1
        t0 = time.time_ns()
        pfd = open_path(path)
        try:
            before = FileState.of(os.fstat(pfd), real_path_of(pfd, path))
            if before != expected:
                raise FailedPrecondition(
                    f"source {path}: now names another file or version than the one checked (inode "
                    f"{expected.ino} -> {before.ino}, size {expected.size} -> {before.size}, real path "
                    f"{expected.target} -> {before.target}); not read. Retry once it is no longer being changed."
                )
            fd = reopen_for_reading(pfd, path)
        finally:
            os.close(pfd)
        try:
            hex_digest, nbytes = hash_fd(fd, path)
            st_after = os.fstat(fd)
        finally:
            os.close(fd)
        with self._lock:
            self.hashed_bytes += nbytes
        if not (expected.same_file_version(st_after) and nbytes == expected.size):
            raise FailedPrecondition(
                f"source {path}: changed while it was hashed (size {expected.size} -> {st_after.st_size}, mtime_ns "
                f"{expected.mtime_ns} -> {st_after.st_mtime_ns}, {nbytes} bytes read); not cached. Retry once the "
                "file is no longer being written."
            )
        self._record(path, expected, hex_digest, t0)
        return hex_digest, path, t0

    def _record(self, path: str, state: FileState, hex_digest: str, t0: int) -> None:
        """Persists a record unless the file was modified within
        :data:`RACY_WINDOW_NS` before ``t0`` (the moment hashing began)."""
        age = t0 - max(state.mtime_ns, state.ctime_ns)
        if age < self.racy_window_ns:
            log.debug("source %s: modified %d ns before hashing; not recorded yet (racy)", untrusted(path), age)
            return
        self._store(SourceRecordRow.new(path, state, content_id_of(hex_digest)))

    # -- records -----------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection | None:
        """The open connection, opening it if needed; None when the database
        cannot be used now. Caller holds ``_db_lock``."""
        if self._conn is None:
            try:
                conn = db.connect(self.root, timeout_s=DB_TIMEOUT_S)
                conn.execute(_SCHEMA)
                self._conn = conn
            except (sqlite3.Error, OSError) as exc:
                self._failed("open", exc)
                return None
        return self._conn

    def _failed(self, what: str, exc: BaseException) -> None:
        """Counts a database failure and drops the connection (reopened next
        time). Logged once per failure streak, not per file. Caller holds
        ``_db_lock``."""
        with self._lock:
            self.db_errors += 1
        if not self._db_failing:
            log.warning("source cache %s: %s failed (%s); hashing instead", db.path_of(self.root), what, exc)
        self._db_failing = True
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None

    def _query(self, what: str, sql: str, args: tuple = ()) -> list | None:
        """Runs one statement; None on any database failure."""
        with self._db_lock:
            conn = self._connection()
            if conn is None:
                return None
            try:
                rows = conn.execute(sql, args).fetchall()
            except (sqlite3.Error, OSError) as exc:
                self._failed(what, exc)
                return None
            self._db_failing = False
            return rows

    def _load(self, path: str) -> SourceRecordRow | None:
        rows = self._query("read", f"SELECT * FROM {TABLE} WHERE path = ?", (path,))
        if not rows:
            return None
        try:
            record = SourceRecordRow.from_row(rows[0])
        except (TypeError, ValueError):
            record = None
        if record is None or record.path != path:
            log.warning("source cache: record of %s is corrupt (bad field or checksum); re-hashing", untrusted(path))
            with self._lock:
                self.db_errors += 1
            return None
        return record

    def _store(self, record: SourceRecordRow) -> None:
        self._query("write", f"INSERT OR REPLACE INTO {TABLE} VALUES (?,?,?,?,?,?,?,?,?,?)", record.to_row())

    def list_records(self) -> list[SourceRecordRow]:
        """Valid records, sorted by path (corrupt rows are skipped).

        Raises:
            Unavailable: the database cannot be read now.
        """
        rows = self._query("list", f"SELECT * FROM {TABLE} ORDER BY path")
        if rows is None:
            raise Unavailable(f"source cache {db.path_of(self.root)}: cannot be read now; see the daemon log")
        out = []
        for row in rows:
            try:
                record = SourceRecordRow.from_row(row)
            except (TypeError, ValueError):
                record = None
            if record is not None:
                out.append(record)
        return out

    def forget(self, path: str) -> bool:
        """Drops the record of ``path``; False when there was none.

        Raises:
            InvalidArgument: a relative path.
            Unavailable: the database cannot be written now.
        """
        if not isinstance(path, str) or not os.path.isabs(path):
            raise InvalidArgument(f"source {path!r}: expected an absolute path")
        check_path_text(path, f"source {path!r}")
        rows = self._query("forget", f"DELETE FROM {TABLE} WHERE path = ? RETURNING path", (normalize_path(path),))
        if rows is None:
            raise Unavailable(f"source cache {db.path_of(self.root)}: cannot be written now; see the daemon log")
        return bool(rows)
