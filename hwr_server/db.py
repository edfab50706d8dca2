"""The index database (``<root>/index.sqlite``): what disk cannot say by
itself — lease records, source-digest records, statistics.

Each component owns its own tables and opens its own connection with
:func:`connect`. WAL mode lets readers run while one writer commits; the
busy timeout turns brief lock contention into a wait instead of an error.
The store works without this file: deleting it loses lease records (clients
re-acquire), cached source digests (they are re-hashed) and counters, never
artifacts.
"""

from __future__ import annotations

import os
import sqlite3

FILENAME = "index.sqlite"


def path_of(root: str) -> str:
    return os.path.join(root, FILENAME)


def connect(root: str, *, timeout_s: float = 5.0) -> sqlite3.Connection:
    """Opens the index database of ``root`` in WAL mode.

    ``check_same_thread=False``: the daemon calls from gRPC worker threads;
    callers serialize access with their own lock.

    Raises:
        sqlite3.Error: the file cannot be opened or is not a database.
    """
    conn = sqlite3.connect(path_of(root), timeout=timeout_s, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode is durable across process crashes (only an OS crash
    # can lose the last commits), which is what lease and cache records need.
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn
