"""Single-instance locks: one daemon per store root and per socket path.

grpcio silently takes over a Unix socket path that a live daemon is serving
(it unlinks and re-binds), so the daemon must refuse to start BEFORE binding.
We hold ``flock`` on ``<root>/hwr.lock`` and on ``<socket>.lock`` for the
daemon's whole life; the kernel drops them when the process dies, even on
SIGKILL, so a crashed daemon never blocks its successor. The holder writes
its pid and start time into the lock file so the loser can name it.

These are advisory locks among HWR daemons only; nothing else's correctness
rests on them (publication uses unique staging names and atomic renames).

The holder truncates and writes the file, so it must be ours: it is opened
with ``O_NOFOLLOW`` (a link planted in its place, e.g. to a file of the
daemon's user, is refused rather than written through) and must be a
regular file owned by the daemon's user.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

from hwr_client.core.errors import FailedPrecondition


class InstanceLock:
    """An exclusive, non-blocking flock on ``path``, held until release.

    Args:
        path: the lock file (created 0644 if missing).
        what: what it guards, for the error message ("store root /x").
    """

    def __init__(self, path: str, what: str):
        self.path = path
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> "InstanceLock":
        """Takes the lock or fails at once.

        Raises:
            FailedPrecondition: another process holds it (names the holder),
                or the path is a link, not a regular file, or not owned by
                the daemon's user (names what it is).
        """
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FailedPrecondition(
                    f"{self.what} is in use by another hwr daemon ({holder}); lock file {self.path}"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode(), 0)
        self._fd = fd
        return self

    def _open(self) -> int:
        """Opens (or creates) the lock file without following a link, and
        checks it is a regular file of ours before anything writes to it."""
        try:
            # O_NOFOLLOW: a link in the final component fails with ELOOP
            # instead of being written through. O_NONBLOCK: a FIFO planted
            # here cannot block the open (the fstat below refuses it).
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FailedPrecondition(
                    f"lock file {self.path} of {self.what} is a symbolic link; expected a regular file the "
                    "daemon's user owns. Someone else may have planted it: remove it and check who can write "
                    "its directory"
                ) from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise FailedPrecondition(
                f"lock file {self.path} of {self.what} is {stat.filemode(st.st_mode)} owned by uid {st.st_uid}; "
                f"expected a regular file owned by uid {os.geteuid()} (the daemon's user). Remove it"
            )
        return fd

    def release(self) -> None:
        """Drops the lock (idempotent). The file stays: unlinking it would let
        a waiter lock a file a newcomer no longer sees."""
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"
