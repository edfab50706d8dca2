"""The worker's own inductor cache folder: chosen once per process, read
whole after a compile (capture) and written from a compile artifact
(restore), never a folder another user can write.

Which folder (:func:`worker_folder`):

1. ``TORCHINDUCTOR_CACHE_DIR`` set to anything but torch's default: the
   user's own folder. Used when it is a real directory (not a link) owned
   by this process's uid and writable by no one else; otherwise refused
   (:class:`~hwr_client.core.errors.FailedPrecondition`), since a compile
   artifact holds code torch runs, and a folder others can write lets them
   swap it.
2. Otherwise (unset, or torch's default ``<tmp>/torchinductor_<user>``,
   which ``import torch._dynamo`` sets and whose predictable name in a
   shared temp folder anyone could create first): a private folder made for
   this process (``mkdtemp``: 0700, a unique name), set as
   ``TORCHINDUCTOR_CACHE_DIR`` for the rest of the process, removed at
   exit. The node's compile cache is then the HWR store: every worker
   restores from it.

Capture (:func:`capture`) reads every regular file of the folder except
``locks/``, a conda ``gcc/`` toolchain, dot files (torch's in-flight
temporaries) and names outside :data:`COMPONENT` (counted as skipped). The
whole folder, not the files that appeared during the call: a compile may be
served partly by entries an earlier compile of the process (or of a warm
user folder) left, and an artifact missing them would send a fresh process
back to compiling them. In the private folder that is this process's
compiles; a user folder may hold more (bounded by :data:`MAX_BYTES`).

Restore (:func:`restore`) writes below the folder only through directory
descriptors opened with ``O_NOFOLLOW`` one component at a time (a link
planted in the folder cannot redirect a write), each file to a unique
temporary name then renamed into place (torch reading the folder never sees
half a file), never over an existing entry (torch's entries are named by
the hash of what they hold; the one in place stays).
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
from typing import Iterable, Iterator

from hwr_client.core.errors import FailedPrecondition, ResourceExhausted

log = logging.getLogger(__name__)

ENV = "TORCHINDUCTOR_CACHE_DIR"
PRIVATE_PREFIX = "hwr-inductor-"
#: Top-level folders never captured: lock files, a conda-installed compiler,
#: precompiled headers (big, rebuilt from the toolchain).
SKIPPED_TOP = frozenset({"locks", "gcc", "precompiled_headers"})
#: What a path component of a captured or restored file may be: torch's
#: hashed names (``c3z3wp…main.so``, ``fxgraph``, ``aotautograd``). No
#: leading dot, no separator, at most 128 characters.
COMPONENT = re.compile(r"[A-Za-z0-9_+=-][A-Za-z0-9_.+=-]{0,127}\Z")
MAX_DEPTH = 8
#: Most files and bytes one compile artifact may hold.
MAX_FILES = 20000
MAX_BYTES = 2 * 1024**3

_lock = threading.Lock()
_chosen: "CacheFolder | None" = None


@dataclasses.dataclass(frozen=True)
class CacheFolder:
    """The process's inductor cache folder; ``private`` when HWR made it."""

    path: str
    private: bool


@dataclasses.dataclass(frozen=True)
class Capture:
    """A captured folder: ``files`` as (components, bytes), what was skipped."""

    files: tuple[tuple[tuple[str, ...], bytes], ...]
    skipped: int

    @property
    def nbytes(self) -> int:
        return sum(len(data) for _, data in self.files)


def check_component(name: str) -> bool:
    """True when ``name`` may be a component of a cache path."""
    return bool(COMPONENT.match(name)) and ".." not in name


def check_own(path: str) -> None:
    """Raises FailedPrecondition unless ``path`` is a directory, not a link,
    owned by this process's uid and writable by no one else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    why = ""
    if stat.S_ISLNK(st.st_mode):
        why = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    elif st.st_uid != os.geteuid():
        why = f"is owned by uid {st.st_uid}, not this process's uid {os.geteuid()}"
    elif st.st_mode & 0o022:
        why = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if why:
        raise FailedPrecondition(f"inductor cache folder {path} ({ENV}) {why}: a compile artifact is restored only "
                                 "into this process's own folder; chmod go-w it, or unset the variable to let HWR "
                                 "make a private one")


def worker_folder() -> CacheFolder:
    """The process's inductor cache folder (module doc), chosen on the first
    call and kept while ``TORCHINDUCTOR_CACHE_DIR`` still names it.

    Raises:
        FailedPrecondition: the user's folder is not this process's own.
    """
    global _chosen
    with _lock:
        current = os.environ.get(ENV)
        if _chosen is not None and current == _chosen.path:
            return _chosen
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if current and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
            check_own(current)
            _chosen = CacheFolder(os.path.abspath(current), private=False)
            return _chosen
        _chosen = _make_private(current)
        return _chosen


def _make_private(previous: str | None) -> CacheFolder:
    path = tempfile.mkdtemp(prefix=PRIVATE_PREFIX)  # 0700, a name no one could have made first
    os.environ[ENV] = path
    triton = os.environ.get("TRITON_CACHE_DIR")
    if previous and triton and os.path.abspath(triton).startswith(os.path.abspath(previous) + os.sep):
        # torch put triton's cache inside the default folder: let it follow ours.
        del os.environ["TRITON_CACHE_DIR"]
    from torch._inductor.utils import clear_caches

    # What torch's own temporary_cache_dir() does: drop paths derived from the old folder.
    clear_caches()
    atexit.register(shutil.rmtree, path, True)
    log.info("compile: private inductor cache folder %s for this process (removed at exit)", path)
    return CacheFolder(path, private=True)


# -- capture ----------------------------------------------------------------------


def capture(folder: str) -> Capture:
    """Every cache file of ``folder`` (module doc).

    Raises:
        ResourceExhausted: more than :data:`MAX_FILES` files or
            :data:`MAX_BYTES` bytes (nothing is published then).
    """
    files: list[tuple[tuple[str, ...], bytes]] = []
    skipped = [0]
    total = 0
    for parts, path in _walk(folder, (), skipped):
        if len(files) >= MAX_FILES:
            raise ResourceExhausted(f"inductor cache folder {folder}: more than {MAX_FILES} files (MAX_FILES)")
        data = _read(path)
        if data is None:
            skipped[0] += 1
            continue
        total += len(data)
        if total > MAX_BYTES:
            raise ResourceExhausted(f"inductor cache folder {folder}: more than {MAX_BYTES} bytes (MAX_BYTES); "
                                    "point TORCHINDUCTOR_CACHE_DIR at a folder of this model's compiles only")
        files.append((parts, data))
    return Capture(tuple(files), skipped[0])


def _walk(path: str, parts: tuple[str, ...], skipped: list[int]) -> Iterator[tuple[tuple[str, ...], str]]:
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        skipped[0] += 1
        return
    for entry in entries:
        name = entry.name
        if name.startswith(".") or (not parts and name in SKIPPED_TOP):
            continue
        if not check_component(name) or len(parts) >= MAX_DEPTH:
            skipped[0] += 1
            continue
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(entry.path, parts + (name,), skipped)
        elif entry.is_file(follow_symlinks=False):
            yield parts + (name,), entry.path
        else:
            skipped[0] += 1  # links, sockets: never part of an artifact


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # removed meanwhile, or became a link
    with os.fdopen(fd, "rb") as f:
        return f.read()


# -- restore ----------------------------------------------------------------------


def executable(parts: tuple[str, ...]) -> bool:
    """Shared objects are written 0755 (as the compiler leaves them), the rest 0644."""
    return parts[-1].endswith(".so")


def restore(folder: str, files: Iterable[tuple[tuple[str, ...], memoryview | bytes]]) -> tuple[int, int, int]:
    """Writes ``files`` below ``folder`` (module doc); the caller checked the
    components (:func:`check_component`).

    Returns:
        (files written, bytes written, files already present).

    Raises:
        FailedPrecondition: a path that crosses a link or a file where a
            folder is needed (a hostile or conflicting folder).
        OSError: the disk (full, read-only).
    """
    root = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    written = nbytes = present = 0
    dirs: dict[tuple[str, ...], int] = {(): root}
    try:
        for parts, data in files:
            parent = _open_dirs(dirs, parts[:-1], folder)
            if _write_one(parent, parts, data):
                written += 1
                nbytes += len(data)
            else:
                present += 1
    finally:
        for fd in dirs.values():
            os.close(fd)
    return written, nbytes, present


def _open_dirs(dirs: dict[tuple[str, ...], int], parts: tuple[str, ...], folder: str) -> int:
    """The descriptor of ``folder/parts``, made (0700) as needed, each
    component opened with O_NOFOLLOW below its parent's descriptor."""
    for i in range(1, len(parts) + 1):
        if parts[:i] in dirs:
            continue
        parent, name = dirs[parts[:i - 1]], parts[i - 1]
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass
        try:
            dirs[parts[:i]] = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                      dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise FailedPrecondition(f"inductor cache folder {folder}: {'/'.join(parts[:i])} is a link or a "
                                         "file, expected a folder; nothing is written through it") from None
            raise
    return dirs[parts]


def _write_one(parent: int, parts: tuple[str, ...], data: memoryview | bytes) -> bool:
    """Steps: 1. an entry in place stays (False); 2. the bytes go to a unique
    temporary name (O_EXCL, O_NOFOLLOW); 3. its mode is set; 4. it is
    renamed over the final name, atomic for readers. No fsync: torch's own
    cache writes have none either, and the private folder does not outlive
    the process."""
    name = parts[-1]
    try:
        os.stat(name, dir_fd=parent, follow_symlinks=False)
        return False
    except FileNotFoundError:
        pass
    tmp = f".hwr.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, 0o755 if executable(parts) else 0o644)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=parent)
        raise
    os.close(fd)
    os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
    return True


def _reset_for_tests() -> None:
    """Forgets the chosen folder (tests that switch folders in one process)."""
    global _chosen
    with _lock:
        _chosen = None


__all__ = ["COMPONENT", "CacheFolder", "Capture", "ENV", "MAX_BYTES", "MAX_FILES", "capture", "check_component",
           "check_own", "restore", "worker_folder"]
