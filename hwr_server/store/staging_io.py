"""Writing a publication's staged payload files: positional writes, the
coverage of an unordered upload, the error an OSError becomes, and the
fsync-then-close of a finished file.
"""

from __future__ import annotations

import bisect
import errno
import os
from typing import Any

from hwr_client.core.errors import HwrError, Internal, InvalidArgument, ResourceExhausted
from hwr_server.access.files import Untrusted, open_stored


def os_error(exc: OSError, what: str) -> HwrError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{what}: the disk is full ({exc.strerror}); free space or run `hwr gc`")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        # The daemon's (or the system's) file descriptors: a capacity, not a bug.
        return ResourceExhausted(f"{what}: out of file descriptors ({exc.strerror}); retry when fewer "
                                 "publications run, or raise the daemon's LimitNOFILE")
    return Internal(f"{what}: {exc.strerror or exc}")


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    mv = memoryview(data)
    while mv:
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


class Coverage:
    """Which byte ranges of a data region have been written (unordered mode)."""

    def __init__(self, size: int):
        self.size = size
        self._begins: list[int] = []
        self._ends: list[int] = []
        self.covered = 0

    def add(self, begin: int, end: int, what: str) -> None:
        """Records [begin, end).

        Raises:
            InvalidArgument: the range overlaps bytes already written.
        """
        i = bisect.bisect_right(self._begins, begin)
        if (i > 0 and self._ends[i - 1] > begin) or (i < len(self._begins) and self._begins[i] < end):
            raise InvalidArgument(f"{what}: chunk [{begin}, {end}) overlaps bytes already sent")
        if i > 0 and self._ends[i - 1] == begin:  # merge with the left neighbour
            i -= 1
            self._ends[i] = end
        else:
            self._begins.insert(i, begin)
            self._ends.insert(i, end)
        if i + 1 < len(self._begins) and self._begins[i + 1] == self._ends[i]:  # and the right one
            self._ends[i] = self._ends.pop(i + 1)
            self._begins.pop(i + 1)
        self.covered += end - begin

    def first_gap(self) -> tuple[int, int] | None:
        pos = 0
        for b, e in zip(self._begins, self._ends):
            if b > pos:
                return pos, b
            pos = e
        return (pos, self.size) if pos < self.size else None


def fsync_close(fd: int) -> None:
    """fsyncs then closes ``fd`` (closed even when the fsync fails).

    Ordered mode runs this in the background for each finished payload file:
    the fsync is the commit's step 1 started early, so the bytes are on disk
    before the publish rename can make them visible, and the next file's
    bytes keep flowing meanwhile."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Bytes compared at a time when a publication's blob is already stored.
COMPARE_BYTES = 1 << 20


def file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path`` itself (not a link's target), or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def same_bytes(stored: str, staged: str, size: int) -> tuple[int, int] | None:
    """(device, inode) of ``stored`` when it is a regular file of ours whose
    ``size`` bytes equal ``staged``'s; None otherwise (missing, a link, another
    size or other bytes)."""
    try:
        fd, st = open_stored(stored, what=f"blob {os.path.basename(stored)[:12]}")
    except (FileNotFoundError, Untrusted):
        return None
    with os.fdopen(fd, "rb", buffering=0) as a, open(staged, "rb", buffering=0) as b:
        if st.st_size != size:
            return None
        while True:
            x, y = a.read(COMPARE_BYTES), b.read(COMPARE_BYTES)
            if x != y:
                return None
            if not x:
                return st.st_dev, st.st_ino
