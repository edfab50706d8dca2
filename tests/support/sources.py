"""Helpers of the source-digest tests: files older than the racy window, in-process caches on real files (moved from tests/server/test_sources_daemon.py and tests/server/test_sources.py)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time

import pytest

from hwr_server import db
from hwr_server.config import ServerConfig
from hwr_server.sources.cache import RACY_WINDOW_NS, SourceCache


def settle(*paths: str) -> None:
    """Waits until each file is older than the racy window (a file modified
    within it is hashed but not yet recorded; see hwr_server.sources.cache)."""
    newest = max(max(os.stat(p).st_mtime_ns, os.stat(p).st_ctime_ns) for p in paths)
    wait = (newest + RACY_WINDOW_NS - time.time_ns()) / 1e9 + 0.05
    if wait > 0:
        time.sleep(wait)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    return d


@pytest.fixture
def make_cache(tmp_path, src):
    made: list[SourceCache] = []

    def make(*, roots=None, racy_window_ns=0, threads=4) -> SourceCache:
        root = tmp_path / "root"
        root.mkdir(exist_ok=True)
        cfg = ServerConfig(root=str(root), source_roots=[str(src)] if roots is None else roots, hash_threads=threads)
        cache = SourceCache(cfg, racy_window_ns=racy_window_ns)
        made.append(cache)
        return cache

    yield make
    for c in made:
        c.stop()


def sql(cache: SourceCache, statement: str, args=()) -> list:
    conn = sqlite3.connect(db.path_of(cache.root))
    try:
        with conn:
            return conn.execute(statement, args).fetchall()
    finally:
        conn.close()
