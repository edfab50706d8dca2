"""Single-instance locks: one daemon per store root and per socket path.

grpcio silently takes over a Unix socket path that a live daemon is serving
(it unlinks and re-binds), so the daemon must refuse to start BEFORE binding.
We hold ``flock`` on ``<root>/hwr.lock`` and on ``<socket>.lock`` for the
daemon's whole life; the kernel drops them when the process dies, even on
SIGKILL, so a crashed daemon never blocks its successor. The holder writes
its pid and start time into the lock file so the loser can name it.

These are advisory locks among HWR daemons only; nothing else's correctness
rests on them (publication uses unique staging names and atomic renames).
"""

from __future__ import annotations

import errno
import fcntl
import os
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
            FailedPrecondition: another process holds it; names the holder.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
