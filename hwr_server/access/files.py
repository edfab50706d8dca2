"""Opening files under the store root without trusting them.

Nothing under the root is trusted (a damaged disk, an operator's mistake or
someone with write access to the store may have left anything there), so
every stored file the daemon reads (manifests, blobs, the peer key) is opened
here: no link followed, no blocking open, a regular file of the daemon's
user, a bounded size. Startup recovery (:mod:`hwr_server.store.recovery`)
quarantines what this refuses, naming :attr:`Untrusted.slug`.
"""

from __future__ import annotations

import errno
import os
import stat


class Untrusted(Exception):
    """A stored file that is not what the store writes: a link, not a
    regular file, another user's, unreadable or over its size limit.

    Attributes:
        slug: the reason in one word ("link", "not-regular", "owner",
            "unreadable", "too-large"), for quarantine entry names.
    """

    def __init__(self, slug: str, text: str):
        super().__init__(text)
        self.slug = slug


def open_stored(path: str, *, what: str, limit: int | None = None) -> tuple[int, os.stat_result]:
    """Opens a file of the store for reading without trusting it: no link
    followed, no blocking open, a regular file of the daemon's user, at most
    ``limit`` bytes.

    Args:
        path: the file.
        what: names it in errors ("artifact 3f2a… manifest").
        limit: largest size accepted, bytes; None for no limit.

    Returns:
        (open fd, its fstat); the caller closes the fd.

    Raises:
        FileNotFoundError: nothing at ``path``.
        Untrusted: naming the path and what it is instead.
    """
    try:
        # O_NOFOLLOW: a link (e.g. to /dev/zero or out of the root) fails with
        # ELOOP instead of being read. O_NONBLOCK: opening a FIFO returns at
        # once instead of waiting forever for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Untrusted("link", f"{what}: {path} is a symbolic link; expected a regular file") from None
        raise Untrusted("unreadable", f"{what}: cannot open {path} ({exc.strerror})") from None
    st = os.fstat(fd)
    problem = _stored_problem(st, path, what, limit)
    if problem is not None:
        os.close(fd)
        raise problem
    return fd, st


def _stored_problem(st: os.stat_result, path: str, what: str, limit: int | None) -> Untrusted | None:
    if not stat.S_ISREG(st.st_mode):
        return Untrusted("not-regular", f"{what}: {path} is {stat.filemode(st.st_mode)}, expected a regular file")
    if st.st_uid != os.geteuid():
        return Untrusted("owner", f"{what}: {path} is owned by uid {st.st_uid}, expected uid {os.geteuid()} "
                                  "(the daemon's user)")
    if limit is not None and st.st_size > limit:
        return Untrusted("too-large", f"{what}: {path} is {st.st_size} bytes, over the {limit}-byte limit "
                                      "(ServerConfig.max_stored_manifest_bytes)")
    return None


def read_stored(path: str, *, what: str, limit: int) -> bytes:
    """The bytes of a stored file, opened by :func:`open_stored`; reads at
    most ``limit`` + 1 bytes even if the file grows meanwhile.

    Raises:
        FileNotFoundError / Untrusted: as :func:`open_stored`.
    """
    fd, _ = open_stored(path, what=what, limit=limit)
    try:
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > limit:
        raise Untrusted("too-large", f"{what}: {path} grew past the {limit}-byte limit while being read "
                                     "(ServerConfig.max_stored_manifest_bytes)")
    return b"".join(chunks)
