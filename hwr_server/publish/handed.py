"""The handoff transport of a publication: the client writes each staging
file through a descriptor the daemon hands it (:mod:`hwr_server.publish.handoff`),
and the daemon hashes what the file holds.

Per file:

1. **Hand over.** The client asks the handoff socket for file i and gets a
   new write-only descriptor of it. The first time file i is asked for,
   its data size is admitted to capacity first (the publication's arrival
   admission: the collector makes room for it, as for each chunk on the
   message transport); nothing is preallocated, so a full disk is the
   client's ENOSPC at pwrite (RESOURCE_EXHAUSTED). It writes the data
   region at the planned offsets, padding included, and closes the
   descriptor.
2. **Seal** (``written{i, complete}``). The daemon marks the file sealed (no
   descriptor is handed out for it again), then takes a read lease on it
   (``F_SETLEASE``, ``F_RDLCK``): the kernel grants one only while NO
   descriptor anywhere holds the file open for writing (a duplicate, a
   copy passed to another process, a writable shared mapping all count).
   Granted, the lease proves the client can no longer change the bytes (no
   new writable descriptor can appear: the staging directory is the
   daemon's, and the socket hands none for a sealed file), so it is
   released at once. Refused past :data:`SEAL_WAIT_S`: FAILED_PRECONDITION.
   The size must be the planned one.
3. **Hash and fsync, in parallel.** Two mapped passes per file on the
   publication's hashing threads, files in parallel: the SHA-256 of the
   whole file (its blob name), and one xxh3 pass that checks the header the
   daemon wrote is intact and gives the file's xxh3, every tensor's and
   block's xxh3, and the zero check of the padding (one SHA-256 pass per
   byte: :mod:`hwr_server.store.hashing`). The fsync of the file starts at
   the same time on its own threads (the commit's step 1, started early).

Ordered plans complete files in order (the daemon hashes file i while the
client writes file i+1); unordered plans in any order; each file once.
Bytes the client never wrote read as zero (holes), and the size check
makes it write through the file's end: the daemon's digests describe what
the files hold, never what a client claims. The progress a ``written``
reports (``data_bytes``) is the client's word, used for the publication's
rate floor only (:meth:`HandedPayload.reported_bytes`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hwr_client.core.errors import Aborted, FailedPrecondition, InvalidArgument, PermissionDenied
from hwr_server.access.files import Untrusted, open_stored
from hwr_server.publish.handoff import HandoffListener
from hwr_server.publish.payload import Digests, StagedFiles, collect
from hwr_server.store.hashing import background_thread, sha256_pass, xxh3_pass

#: Seconds a seal waits for the last writable descriptor to close (the
#: handoff thread closes the daemon's own copy just after sending it).
SEAL_WAIT_S = 2.0
_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)


def leases_work(directory: str) -> str:
    """"" when read leases can seal files in ``directory``; else why not
    (the handoff transport is then not offered)."""
    path = os.path.join(directory, f".lease-probe-{os.getpid()}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return f"cannot create a probe file in {directory} ({exc.strerror})"
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
        return ""
    except OSError as exc:
        return f"file leases are not available on {directory} ({exc.strerror}; fs.leases-enable?)"
    finally:
        os.close(fd)
        os.unlink(path)


def seal(fd: int, what: str, *, wait_s: float = SEAL_WAIT_S) -> None:
    """Proves no descriptor holds the file of ``fd`` (opened read-only) open
    for writing (see the module docstring, step 2).

    Raises:
        FailedPrecondition: one still does after ``wait_s`` seconds, or the
            filesystem cannot tell.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
        except OSError as exc:
            if exc.errno == errno.EAGAIN and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            if exc.errno == errno.EAGAIN:
                raise FailedPrecondition(f"{what}: a writable descriptor of it is still open {wait_s:g} s after "
                                         "the client reported it written; the client must close every "
                                         "descriptor (and writable mapping) before sending `written`") from None
            raise FailedPrecondition(f"{what}: cannot seal it ({exc.strerror})") from None
        # Granted: no writer exists now, and none can appear. Held no longer.
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
        return


class HandedPayload:
    """The handoff transport of one publication (see the module docstring).

    Args:
        files: the publication's staging files.
        tag: a short id for thread names.
        listener: the handoff socket it registers with.
        peer_uid: the publication's peer's uid, where the daemon knows it:
            only that uid receives descriptors.
    """

    def __init__(self, files: StagedFiles, tag: str, *, listener: HandoffListener, peer_uid: int | None):
        self.files = files
        self.n_files = len(files.checked.layouts)
        self.peer_uid = peer_uid
        self.listener = listener
        self._lock = threading.Lock()
        self._closed = False
        self._sealed = [False] * self.n_files
        self._admitted = [False] * self.n_files  # data size admitted to capacity (first hand-over)
        self._reported = [0] * self.n_files  # data bytes each file's `written` messages reported, at most
        self._next = 0  # ordered: the file that must complete next
        self._sha: dict[int, Future] = {}
        self._xxh: dict[int, Future] = {}
        self._fsyncs: dict[int, Future] = {}
        self._parts = [files.parts(i) for i in range(self.n_files)]
        # Files in parallel across cores; niced (ServerConfig.publication_nice):
        # the next start's artifact waits for a busy node's serving workers.
        self._hash_pool = ThreadPoolExecutor(max_workers=max(1, files.threads), thread_name_prefix=f"hwr-hash-{tag}",
                                             initializer=background_thread, initargs=(f"hwr-hash-{tag}", files.nice))
        self._fsync_pool = ThreadPoolExecutor(max_workers=max(1, min(files.max_pending_fsyncs, self.n_files)),
                                              thread_name_prefix=f"hwr-fsync-{tag}",
                                              initializer=background_thread, initargs=(f"hwr-fsync-{tag}", files.nice))
        self.token = listener.register(self)

    def _what(self, index: int) -> str:
        return f"{self.files.what} file {index}"

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.n_files:
            raise InvalidArgument(f"{self._what(index)}: file index out of range; the plan has {self.n_files} files")

    # -- the handoff socket's side -------------------------------------------------

    def open_for_client(self, index: int, *, uid: int) -> int:
        """A new write-only descriptor of staging file ``index`` (step 1).

        Raises:
            PermissionDenied: ``uid`` is not the publication's peer's.
            InvalidArgument: no such file. FailedPrecondition: it is sealed.
            Aborted: the publication ended. ResourceExhausted: capacity
                or disk space (the admission of the file's data size).
        """
        with self._lock:
            if self._closed:
                raise Aborted(f"{self.files.what}: ended; publish again")
            if self.peer_uid is not None and uid != self.peer_uid:
                raise PermissionDenied(f"{self.files.what}: descriptors go to uid {self.peer_uid}, the publisher; "
                                       f"asked by uid {uid}")
            self._check_index(index)
            if self._sealed[index]:
                raise FailedPrecondition(f"{self._what(index)}: already reported written (sealed); no descriptor "
                                         "is handed out for it again")
            if not self._admitted[index]:
                # Under the lock: two requests for the same file admit it once.
                self.files.admit(self.files.checked.layouts[index].data_size)
                self._admitted[index] = True
            return os.open(self.files.paths[index], os.O_WRONLY | os.O_CLOEXEC)

    # -- the Publish stream's side ---------------------------------------------------

    def write(self, index: int, offset: int, data: bytes) -> int:
        raise InvalidArgument(f"{self.files.what}: this publication takes its payload through handed-over files "
                              "(handoff transport); chunks are refused")

    def written(self, index: int, data_bytes: int, complete: bool) -> None:
        """Progress on file ``index``, or its completion (seal, hash, fsync).

        Raises:
            InvalidArgument: no such file, out of order (ordered plan), or
                already complete. FailedPrecondition: a writer remains,
                or the file's size is not the planned one.
        """
        self._check_index(index)
        lay = self.files.checked.layouts[index]
        if data_bytes > lay.data_size:
            raise InvalidArgument(f"{self._what(index)}: {data_bytes} bytes written, more than the planned "
                                  f"data size {lay.data_size}")
        with self._lock:
            if self._sealed[index]:
                raise InvalidArgument(f"{self._what(index)}: already reported complete")
            self._reported[index] = max(self._reported[index], lay.data_size if complete else data_bytes)
            if not complete:
                return  # progress only: counted by the rate floor, and it kept the publication from going idle
            if self.files.ordered and index != self._next:
                raise InvalidArgument(f"{self._what(index)}: completed out of order; ordered mode expects file "
                                      f"{self._next} next (use ordered=false to complete files in any order)")
            self._sealed[index] = True
            self._next += 1
        self._seal_file(index, lay.file_size)
        self._sha[index] = self._hash_pool.submit(self._sha_task, index)
        self._xxh[index] = self._hash_pool.submit(self._xxh_task, index)
        self._fsyncs[index] = self._fsync_pool.submit(self.files.fsync_path, index)

    def _open(self, index: int) -> tuple[int, Any]:
        try:
            return open_stored(self.files.paths[index], what=self._what(index))
        except (FileNotFoundError, Untrusted) as exc:
            raise FailedPrecondition(f"{self._what(index)}: staging file cannot be read ({exc}); publish again") from None

    def _seal_file(self, index: int, size: int) -> None:
        fd, _ = self._open(index)
        try:
            seal(fd, self._what(index))
            # fstat after the seal: nobody can change the size any more.
            actual = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if actual != size:
            raise FailedPrecondition(f"{self._what(index)}: {actual} bytes after the client wrote it, planned "
                                     f"{size} (a client writes only inside the data region)")

    def _sha_task(self, index: int) -> str:
        fd, _ = self._open(index)
        try:
            return sha256_pass(fd, self.files.checked.layouts[index].file_size)
        finally:
            os.close(fd)

    def _xxh_task(self, index: int) -> str:
        lay = self.files.checked.layouts[index]
        fd, _ = self._open(index)
        try:
            return xxh3_pass(fd, lay.file_size, self._parts[index], lay.header, self._what(index))
        finally:
            os.close(fd)

    def reported_bytes(self, index: int, data_bytes: int, complete: bool) -> int:
        """The data bytes a ``written{index, data_bytes, complete}`` newly
        reports: beyond what file ``index``'s earlier messages reported, up
        to its data size (a completion reports all of it). 0 for a bad index
        or a sealed file (:meth:`written` refuses those)."""
        if not 0 <= index < self.n_files or self._sealed[index]:
            return 0
        size = self.files.checked.layouts[index].data_size
        return max(0, min(size, size if complete else data_bytes) - self._reported[index])

    @property
    def bytes_written(self) -> int:
        """Data bytes of the files sealed so far."""
        return sum(lay.data_size for lay, s in zip(self.files.checked.layouts, self._sealed) if s)

    # -- commit -------------------------------------------------------------------------

    def digests(self) -> Digests:
        missing = [i for i, s in enumerate(self._sealed) if not s]
        if missing:
            raise InvalidArgument(f"{self.files.what}: commit before file {missing[0]} was reported complete "
                                  f"({len(missing)} of {self.n_files} files missing)")
        files = [(self._sha[i].result(), self._xxh[i].result()) for i in range(self.n_files)]
        return collect(self.files.checked, files, self._parts)

    def sync(self) -> None:
        """Commit step 1: the fsyncs the seals started (raises their OSError)."""
        for i in range(self.n_files):
            self._fsyncs[i].result()

    # -- teardown ---------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.listener.unregister(self.token)
        # Queued passes are dropped; running ones finish (they hold no lock
        # and each closes its own descriptor) before the staging goes.
        self._hash_pool.shutdown(wait=True, cancel_futures=True)
        self._fsync_pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["HandedPayload", "SEAL_WAIT_S", "leases_work", "seal"]
