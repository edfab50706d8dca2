"""Content ids of canonical files: the ONE hashing function the daemon and
the client share, and the checks that a source path is a regular file.

A source path is resolved once (:func:`open_path`, an ``O_PATH``
descriptor); its type, real path and the read itself all go through that
descriptor, so a name re-pointed meanwhile never swaps in another file, and
a device or FIFO is never opened. Linux only (``O_PATH``, ``/proc/self/fd``),
like the daemon.

Torch-free (the daemon imports it). A content id is ``sha256:<hex>`` of the
file bytes, whichever side computed it.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import stat
from typing import Any

from hwr_client.core.errors import (
    FailedPrecondition, HwrError, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted,
)

#: Bytes per read while hashing. Large reads keep the kernel's readahead busy
#: and make the per-call GIL hand-off negligible (hashlib releases the GIL
#: while it digests a buffer).
READ_CHUNK = 8 * 1024 * 1024

#: Linux's PATH_MAX, bytes including the terminating NUL: the kernel refuses
#: a longer path (ENAMETOOLONG), so one is refused before any lookup.
PATH_MAX = 4096


@dataclasses.dataclass(frozen=True)
class SourceDigest:
    """The content id of one canonical file.

    ``origin``: "cache" (daemon record), "hub" (trusted Hugging Face blob
    name), "hashed" (hashed by the daemon now) or "local" (hashed by this
    process). ``cached`` is true when no bytes were hashed for this answer.
    """

    path: str
    content_id: str
    size: int
    cached: bool
    origin: str

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (the CLI's ``--json`` output)."""
        return dataclasses.asdict(self)


def os_error(path: str, exc: OSError) -> HwrError:
    """The HWR error for an OS error on a source path, naming the path.

    Every errno a hostile or mistaken path can produce maps to a fitting
    status; only an unexpected one is FAILED_PRECONDITION (never INTERNAL).
    """
    code = exc.errno
    if isinstance(exc, FileNotFoundError):
        return NotFound(f"source {path}: no such file; expected an existing regular file")
    if code == errno.ENOTDIR:
        return NotFound(f"source {path}: a component of the path is not a directory; expected a regular file")
    if isinstance(exc, PermissionError):
        return PermissionDenied(
            f"source {path}: permission denied for uid {os.geteuid()}; expected a readable regular file"
        )
    if isinstance(exc, IsADirectoryError):
        return InvalidArgument(f"source {path}: is a directory; expected a regular file")
    if code == errno.ELOOP:
        return InvalidArgument(f"source {path}: too many levels of symbolic links; expected a regular file")
    if code == errno.ENAMETOOLONG:
        return InvalidArgument(f"source {path}: name too long; expected a path under PATH_MAX ({PATH_MAX}) bytes")
    if code in (errno.EMFILE, errno.ENFILE):
        return ResourceExhausted(f"source {path}: out of file descriptors ({exc.strerror}); retry later")
    return FailedPrecondition(f"source {path}: cannot read ({exc.strerror or exc})")


def check_regular(path: str, st: os.stat_result) -> None:
    """Raises unless ``st`` (of ``path``) is a regular file.

    Raises:
        InvalidArgument: a directory, FIFO, socket or device.
    """
    if stat.S_ISREG(st.st_mode):
        return
    if stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(
            f"source {path}: is a directory; expected a regular file (list its files, or pass the "
            "directory to build_identity)"
        )
    kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device or special file"
    raise InvalidArgument(f"source {path}: is a {kind}; expected a regular file")


def check_path_text(path: str, what: str = "source path") -> None:
    """Raises unless ``path`` can name a file at all: a NUL byte would make
    ``os.open`` raise ValueError (an INTERNAL error), and a path of PATH_MAX
    bytes or more is refused by the kernel.

    Raises:
        InvalidArgument: naming ``what`` (e.g. ``ResolveSources: paths[3]``).
    """
    if "\x00" in path:
        raise InvalidArgument(f"{what} contains a NUL byte; expected an absolute file path")
    size = len(path.encode("utf-8", "surrogateescape"))
    if size >= PATH_MAX:
        raise InvalidArgument(f"{what} is {size} bytes long; expected at most {PATH_MAX - 1} (the kernel's PATH_MAX)")


def check_label_text(text: str, what: str) -> None:
    """Raises if a free-text label (a file label, a client name, a
    registration label) contains a NUL byte. Labels never name files, but
    they reach log lines, manifests and the lease index, where a NUL cuts the
    text short for C readers (journald, sqlite's C API, ``strings``) and so
    hides what follows it.

    Raises:
        InvalidArgument: naming ``what`` (e.g. ``Publish: files[2].name``).
    """
    if "\x00" in text:
        raise InvalidArgument(f"{what} contains a NUL byte at offset {text.index(chr(0))}; "
                              "expected text without NUL")


def _broken_or(path: str, exc: OSError) -> HwrError:
    if isinstance(exc, FileNotFoundError) and os.path.islink(path):
        try:
            return NotFound(f"source {path}: broken symlink to {os.readlink(path)!r}; expected a regular file")
        except OSError:
            pass
    return os_error(path, exc)


def stat_source(path: str) -> os.stat_result:
    """``os.stat`` (following links) of a source path that must be a regular
    file; a broken symlink is reported as such.

    Raises:
        NotFound, PermissionDenied, InvalidArgument, FailedPrecondition.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise _broken_or(path, exc) from None
    check_regular(path, st)
    return st


def open_path(path: str) -> int:
    """An ``O_PATH`` descriptor of ``path`` (symlinks followed).

    ``O_PATH`` resolves the name ONCE and pins the inode it reached, without
    opening the file itself: no driver's open runs (a device named by a
    planted link has no side effect), a FIFO cannot block, and no read
    permission is needed yet. Every later check (:func:`real_path_of`,
    ``fstat``) and the read itself (:func:`reopen_for_reading`) go through this
    descriptor, so they all see the same file whatever happens to the name.

    Returns:
        The descriptor; the caller closes it.

    Raises:
        NotFound (also a broken symlink, named as such), PermissionDenied,
        InvalidArgument, ResourceExhausted, FailedPrecondition.
    """
    try:
        return os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise _broken_or(path, exc) from None


def real_path_of(fd: int, path: str = "<fd>") -> str:
    """The real path of the file ``fd`` is open on (all symlinks resolved),
    as the kernel records it: no second lookup by name.

    Raises:
        FailedPrecondition: /proc is not mounted, or the file was deleted.
    """
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise FailedPrecondition(f"source {path}: cannot read its real path from /proc/self/fd ({exc.strerror}); "
                                 "expected /proc to be mounted") from None
    if not real.startswith("/") or real.endswith(" (deleted)"):
        raise FailedPrecondition(f"source {path}: was deleted or moved while it was checked; retry")
    return real


def reopen_for_reading(fd: int, path: str = "<fd>") -> int:
    """A read-only descriptor of the very file the ``O_PATH`` descriptor
    ``fd`` pins (through ``/proc/self/fd``, so no name is looked up again).
    The kernel checks read permission for this process here.

    The caller checks the type first (a device's open has side effects).
    O_NONBLOCK is kept until after this open for the same reason as in
    :func:`open_regular`; regular files ignore it, and it is cleared.

    Raises:
        PermissionDenied: this process may not read it.
        NotFound, FailedPrecondition, ResourceExhausted.
    """
    try:
        rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise os_error(path, exc) from None
    try:
        os.set_blocking(rfd, True)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except BaseException:
        os.close(rfd)
        raise
    return rfd


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """Opens a regular file for reading: one name lookup, never blocking on
    a FIFO, never opening a device.

    The name is resolved once (:func:`open_path`); the type is checked on
    that inode; only then is the same inode opened for reading
    (:func:`reopen_for_reading`). A file swapped in under the name
    meanwhile is not the one read.

    Returns:
        (fd, fstat of the opened file). The caller closes the fd.

    Raises:
        NotFound, PermissionDenied, InvalidArgument, ResourceExhausted,
        FailedPrecondition.
    """
    pfd = open_path(path)
    try:
        st = os.fstat(pfd)
        check_regular(path, st)
        return reopen_for_reading(pfd, path), st
    finally:
        os.close(pfd)


def hash_fd(fd: int, path: str = "<fd>") -> tuple[str, int]:
    """SHA-256 of everything readable from ``fd`` (from its current offset).

    Returns:
        (64 lowercase hex, bytes read).

    Raises:
        FailedPrecondition: a read error, naming ``path``.
    """
    h = hashlib.sha256()
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    total = 0
    prefetch = hasattr(os, "posix_fadvise")
    with open(fd, "rb", buffering=0, closefd=False) as f:
        offset = f.tell()
        while True:
            try:
                n = f.readinto(view)
            except OSError as exc:
                raise os_error(path, exc) from None
            if not n:
                break
            offset += n
            if prefetch:
                # Start reading the NEXT chunk from disk now, so that the disk
                # works while this chunk is hashed (a plain read loop would
                # alternate: read, then hash, never both at once).
                try:
                    os.posix_fadvise(fd, offset, READ_CHUNK, os.POSIX_FADV_WILLNEED)
                except OSError:
                    prefetch = False
            h.update(view[:n])
            total += n
    return h.hexdigest(), total


def hash_file(path: str) -> tuple[str, int]:
    """SHA-256 hex and size of one regular file: the content id computation
    shared by the daemon and the client.

    Args:
        path: a regular file (symlinks are followed).

    Returns:
        (64 lowercase hex, size in bytes).

    Raises:
        NotFound: no such file. PermissionDenied: not readable.
        InvalidArgument: a directory or FIFO. FailedPrecondition: the file
        changed size while it was read, or a read error.
    """
    fd, st = open_regular(path)
    try:
        digest, nbytes = hash_fd(fd, path)
    finally:
        os.close(fd)
    if nbytes != st.st_size:
        raise FailedPrecondition(
            f"source {path}: read {nbytes} bytes, expected {st.st_size}; it changed while it was hashed, retry"
        )
    return digest, nbytes


def normalize_path(path: str) -> str:
    """``path`` with ``.`` components and repeated slashes dropped, unless
    it has a ``..`` component: then it is returned as given, because
    collapsing ``..`` lexically (as ``os.path.normpath`` does) names another
    file when the component before it is a symlink.

    The one rule for the daemon's cache keys and the client's request
    paths, so both sides name a file the same way.

    Example:
        >>> normalize_path("/models//a/./b.bin"), normalize_path("/models/link/../b.bin")
        ('/models/a/b.bin', '/models/link/../b.bin')
    """
    return path if ".." in path.split("/") else os.path.normpath(path)


def absolute_path(path: str | os.PathLike[str]) -> str:
    """``path`` made absolute against the cwd, then :func:`normalize_path`
    (``..`` kept)."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        text = os.path.join(os.getcwd(), text)
    return normalize_path(text)


def content_id_of(hex_digest: str) -> str:
    """The content id (``sha256:<hex>``) of a SHA-256 hex digest."""
    return "sha256:" + hex_digest
