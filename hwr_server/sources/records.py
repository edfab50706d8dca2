"""The source-digest cache's records and the hub-cache rule
(:mod:`hwr_server.sources.cache` uses them): what a record is valid for
(:class:`FileState`), the persisted row with its own checksum
(:class:`SourceRecordRow`), and when a Hugging Face hub blob name is the
file's SHA-256 (:func:`hub_blob_digest`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
import time
from typing import Any, Sequence

#: Table of this module in index.sqlite; the suffix is the record format, so
#: a future format gets a fresh table instead of misreading this one.
TABLE = "source_digests_v1"
_SCHEMA = f"""CREATE TABLE IF NOT EXISTS {TABLE} (
    path TEXT PRIMARY KEY, dev INTEGER NOT NULL, ino INTEGER NOT NULL, size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL, target TEXT NOT NULL,
    content_id TEXT NOT NULL, recorded_unix INTEGER NOT NULL, checksum TEXT NOT NULL)"""

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CONTENT_ID = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True)
class FileState:
    """What a cache record is valid for: the file's identity and version."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    #: The real path the requested path resolves to (symlinks followed).
    target: str

    @classmethod
    def of(cls, st: os.stat_result, target: str) -> "FileState":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, target)

    def same_file_version(self, st: os.stat_result) -> bool:
        """True when ``st`` has the same stat fields (target not compared)."""
        return FileState.of(st, self.target) == self


@dataclasses.dataclass(frozen=True)
class SourceRecordRow:
    """One persisted cache record."""

    path: str
    state: FileState
    content_id: str
    recorded_unix: int
    checksum: str

    @staticmethod
    def compute_checksum(path: str, state: FileState, content_id: str, recorded_unix: int) -> str:
        fields = [TABLE, path, *dataclasses.astuple(state), content_id, recorded_unix]
        return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).hexdigest()

    @classmethod
    def new(cls, path: str, state: FileState, content_id: str) -> "SourceRecordRow":
        now = int(time.time())
        return cls(path, state, content_id, now, cls.compute_checksum(path, state, content_id, now))

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> "SourceRecordRow | None":
        """Parses a row; None when any column has the wrong type or value, or
        the checksum does not verify."""
        path, dev, ino, size, mtime, ctime, target, cid, recorded, checksum = row
        ints = (dev, ino, size, mtime, ctime, recorded)
        if not all(type(v) is int for v in ints) or not all(isinstance(v, str) for v in (path, target, cid, checksum)):
            return None
        if not _CONTENT_ID.match(cid):
            return None
        state = FileState(dev, ino, size, mtime, ctime, target)
        if checksum != cls.compute_checksum(path, state, cid, recorded):
            return None
        return cls(path, state, cid, recorded, checksum)

    def to_row(self) -> tuple:
        return (self.path, *dataclasses.astuple(self.state), self.content_id, self.recorded_unix, self.checksum)


def _is_hub_repo_dir(name: str) -> bool:
    # "models--<org>--<name>": repo ids cannot contain "--", so exactly 3 parts.
    parts = name.split("--")
    return len(parts) == 3 and parts[0] == "models" and all(parts[1:]) and not name.startswith(".")


def hub_blob_digest(path: str) -> tuple[str, os.stat_result] | None:
    """The trusted SHA-256 of a Hugging Face hub cache file, or None.

    Trusted only when ALL hold (anything else is hashed):
    ``path`` is ``<repo>/snapshots/<40 hex rev>/<rel...>`` with ``<repo>``
    named ``models--<org>--<name>``; ``snapshots``, the rev and any
    subdirectory are real directories; ``path`` itself is a symlink whose
    single hop lands on ``<repo>/blobs/<64 hex>``; that is a regular file
    and the fully resolved path is exactly it (``blobs`` not a link).

    Args:
        path: absolute, normalized path as requested.

    Returns:
        (64 hex, lstat of the blob) or None. The caller answers with it only
        for the inode it opened and checked itself (these checks are by name).
    """
    parts = path.split("/")
    idx = [i for i in range(len(parts) - 3) if parts[i + 1] == "snapshots" and _is_hub_repo_dir(parts[i])]
    if not idx:
        return None
    i = idx[-1]
    repo = "/".join(parts[: i + 1])
    if not _HEX40.match(parts[i + 2]) or any(p in ("", ".", "..") for p in parts[i + 3:]):
        return None
    try:
        for j in range(i + 1, len(parts) - 1):
            if not stat.S_ISDIR(os.lstat("/".join(parts[: j + 1])).st_mode):
                return None
        if not stat.S_ISLNK(os.lstat(path).st_mode):
            return None
        hop = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
        blob_hex = os.path.basename(hop)
        blobs = os.path.join(os.path.realpath(repo), "blobs")
        if not _HEX64.match(blob_hex) or os.path.realpath(os.path.dirname(hop)) != blobs:
            return None
        blob = os.path.join(blobs, blob_hex)
        st = os.lstat(blob)
        if not stat.S_ISREG(st.st_mode) or os.path.realpath(path) != blob:
            return None
    except OSError:
        return None
    return blob_hex, st
