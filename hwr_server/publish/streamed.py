"""The message transport of a publication: payload bytes arrive in
``PayloadChunk`` messages (clients without the handoff socket: another
user's container, raw gRPC, an old client).

Ordered mode: chunks arrive strictly sequentially; each is written once and
hashed from the same in-memory bytes by two pipeline threads (file SHA-256 +
xxh3 in one, tensor and block xxh3 + padding check in the other), so the
payload is never read back. Each finished file goes to a background fsync
while the next file's bytes flow.

Unordered mode: chunks carry offsets, are written with ``pwrite`` and their
coverage is tracked (an overlap is refused at once, a gap at commit); the
files are hashed at commit by a parallel read-back.

Payload files are opened lazily, a few at a time (:data:`MAX_OPEN_FILES`),
so a plan of many files holds few descriptors.
"""

from __future__ import annotations

import collections
import os
from concurrent.futures import Future, ThreadPoolExecutor

from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_server.access.files import Untrusted, open_stored
from hwr_server.publish.payload import Digests, StagedFiles, collect
from hwr_server.store.hashing import WholeHasher, _Stage, readback, set_native_thread_name
from hwr_server.store.staging_io import Coverage, fsync_close, os_error, pwrite_all

#: Payload files a publication keeps open at once (unordered mode: the most
#: recently written; ordered mode needs one). More are reopened by path.
MAX_OPEN_FILES = 8


class StreamedPayload:
    """The message transport of one publication (see the module docstring).

    Args:
        files: the publication's staging files.
        tag: a short id for thread names.
    """

    def __init__(self, files: StagedFiles, tag: str):
        self.files = files
        self.tag = tag
        layouts = files.checked.layouts
        self.n_files = len(layouts)
        self._open_fds: collections.OrderedDict[int, int] = collections.OrderedDict()  # file -> fd, LRU order
        self._synced: set[int] = set()
        self._cur = 0  # ordered: current file and data-region position
        self._pos = 0
        self._fsyncs: list[Future] = []
        self._fsync_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hwr-fsync-{tag}")
        self._fsync_pool.submit(set_native_thread_name, "hwr-fsync")
        self._whole = [WholeHasher(lay.header) for lay in layouts]
        self._parts = [files.parts(i) for i in range(self.n_files)]
        self._coverage = [Coverage(lay.data_size) for lay in layouts]
        self._stages: list[_Stage] = []
        self._started = False

    def _start(self) -> None:
        """At the first chunk (or the commit): ordered mode starts its hashers."""
        if self._started:
            return
        self._started = True
        if self.files.ordered:
            self._stages = [
                _Stage(lambda it: self._whole[it[0]].update(it[1]), f"hwr-sha-file-{self.tag}"),
                _Stage(lambda it: self._parts[it[0]].update(it[1]), f"hwr-xxh-parts-{self.tag}"),
            ]
            for s in self._stages:
                s.start()

    def _fd(self, i: int) -> int:
        """An open descriptor of file ``i``: from the few kept open (least
        recently used closed first), else opened again by path.

        Raises:
            OSError: from open (EMFILE: see os_error).
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
        fd = os.open(self.files.paths[i], os.O_RDWR | os.O_CLOEXEC)
        self._open_fds[i] = fd
        return fd

    # -- chunks -----------------------------------------------------------------

    def write(self, index: int, offset: int, data: bytes) -> int:
        """Writes one chunk, after the capacity its bytes need (``files.admit``).

        Raises:
            InvalidArgument: bad index/offset/size, out of order, overlap.
            ResourceExhausted: disk full, capacity, file descriptors.
        """
        what = f"{self.files.what} file {index}"
        limit = self.files.max_chunk_bytes
        if not data or len(data) > limit:
            raise InvalidArgument(f"{what}: chunk of {len(data)} bytes; expected 1..{limit}")
        if not 0 <= index < self.n_files:
            raise InvalidArgument(f"{what}: file index out of range; the plan has {self.n_files} files")
        lay = self.files.checked.layouts[index]
        if offset + len(data) > lay.data_size:
            raise InvalidArgument(
                f"{what}: chunk [{offset}, {offset + len(data)}) runs past the planned data size {lay.data_size} "
                "(more payload than planned)"
            )
        if self.files.ordered:
            self._check_order(index, offset, what)
            self._start()
            self.files.admit(len(data))
            self._write_ordered(index, offset, data, what)
        else:
            self._coverage[index].add(offset, offset + len(data), what)
            self._start()
            self.files.admit(len(data))
            self._pwrite(index, offset, data, what)
        return len(data)

    def written(self, index: int, data_bytes: int, complete: bool) -> None:
        raise InvalidArgument(f"{self.files.what}: `written` belongs to the handoff transport; this publication "
                              "takes its payload in chunks")

    def reported_bytes(self, index: int, data_bytes: int, complete: bool) -> int:
        return 0  # `written` is refused here; chunks are counted by their length

    def _check_order(self, fi: int, offset: int, what: str) -> None:
        layouts = self.files.checked.layouts
        while self._cur < self.n_files - 1 and self._pos == layouts[self._cur].data_size:
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
        if self._pos == self.files.checked.layouts[fi].data_size:
            # Durability of this file proceeds in the background while the next
            # file's bytes flow; the fsync task owns the descriptor and closes it.
            self._synced.add(fi)
            fd = self._open_fds.pop(fi)
            pending = [f for f in self._fsyncs if not f.done()]
            if len(pending) >= self.files.max_pending_fsyncs:
                try:
                    pending[0].result()  # each pending fsync holds a descriptor: bound them
                except OSError as exc:
                    raise os_error(exc, f"{what}: fsync") from None
            self._fsyncs.append(self._fsync_pool.submit(fsync_close, fd))

    def _pwrite(self, fi: int, offset: int, data: bytes, what: str) -> None:
        try:
            pwrite_all(self._fd(fi), data, self.files.checked.layouts[fi].data_start + offset)
        except OSError as exc:
            raise os_error(exc, what) from None

    # -- commit -----------------------------------------------------------------

    def digests(self) -> Digests:
        self._check_complete()
        self._start()  # a plan whose files hold no data bytes gets no chunk
        if self.files.ordered:
            stages, self._stages = self._stages, []
            for s in stages:
                s.finish()  # waits until every queued chunk is hashed
        else:
            self._readback()
        return collect(self.files.checked, [w.digests() for w in self._whole], self._parts)

    def _check_complete(self) -> None:
        for i, (lay, cov) in enumerate(zip(self.files.checked.layouts, self._coverage)):
            if self.files.ordered:
                got = lay.data_size if i < self._cur else (self._pos if i == self._cur else 0)
                if got != lay.data_size:
                    raise InvalidArgument(
                        f"{self.files.what} file {i}: commit after {got} of {lay.data_size} payload bytes "
                        "(too few bytes)"
                    )
            elif (gap := cov.first_gap()) is not None:
                b, e = gap
                raise InvalidArgument(
                    f"{self.files.what} file {i}: commit with bytes [{b}, {e}) never sent (too few bytes)"
                )

    def _readback(self) -> None:
        def one(i: int) -> None:
            lay = self.files.checked.layouts[i]
            self._whole[i] = WholeHasher()  # the read-back sees the header too
            # The staging file is opened once, refused unless it is still a
            # regular file of ours (no link planted in its place), and read
            # through that fd only.
            try:
                fd, _ = open_stored(self.files.paths[i], what=f"{self.files.what} file {i}")
            except (FileNotFoundError, Untrusted) as exc:
                raise FailedPrecondition(f"{self.files.what} file {i}: staging file cannot be read back ({exc}); "
                                         "publish again") from None
            try:
                readback(fd, self._whole[i], self._parts[i], lay.data_start, lay.file_size)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(max_workers=self.files.threads, thread_name_prefix="hwr-readback") as pool:
            for fut in [pool.submit(one, i) for i in range(self.n_files)]:
                fut.result()

    def sync(self) -> None:
        """Commit step 1. Ordered mode fsynced each finished file in the
        background while the next one's bytes flowed; this waits for those
        and fsyncs the rest (files without data bytes; every file when
        unordered, in parallel like the read-back)."""
        rest = [i for i in range(self.n_files) if i not in self._synced]
        if self.files.ordered:
            self._fsyncs += [self._fsync_pool.submit(self._fsync_file, i) for i in rest]
            rest = []
        with ThreadPoolExecutor(max_workers=self.files.threads, thread_name_prefix="hwr-fsync") as pool:
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
        self.files.fsync_path(i)

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
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


__all__ = ["MAX_OPEN_FILES", "StreamedPayload"]
