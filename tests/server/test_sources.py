"""The source-digest cache in-process (hwr_server.sources.cache.SourceCache) on
real files, a real sqlite database and real symlinks/FIFOs."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sqlite3
import threading

import pytest

from hwr_client.core.errors import (
    FailedPrecondition,
    Unavailable,
)
from hwr_client.core.digests import hash_file
from hwr_server import db
from hwr_server.sources import cache as srcmod
from hwr_server.sources.cache import TABLE, FileState, SourceRecordRow
from tests.support.sources import sha, sql, write
from tests.support.sources import make_cache, src  # noqa: F401 - fixtures, used by name


# -- cold / warm / corrupt / unavailable: the key never changes ----------------


def test_cold_then_warm_then_restart(make_cache, src):
    data = os.urandom(3 * 1024 * 1024 + 17)
    path = write(src / "model.safetensors", data)
    cache = make_cache()
    (cold,) = cache.resolve([path])
    assert (cold.content_id, cold.size, cold.cached, cold.origin) == (sha(data), len(data), False, "hashed")
    (warm,) = cache.resolve([path])
    assert (warm.content_id, warm.cached, warm.origin) == (sha(data), True, "cache")
    assert cache.hash_calls == 1
    cache.stop()
    again = make_cache()  # a restarted daemon reads the persisted record
    assert again.resolve([path])[0].origin == "cache" and again.hash_calls == 0
    stats = cache.stats()
    assert stats["hwr_source_cache_hits_total"] == 1 and stats["hwr_source_cache_misses_total"] == 1


GARBLE = {
    "content_id_changed": (f"UPDATE {TABLE} SET content_id = ?", ("sha256:" + "0" * 64,)),
    "content_id_not_an_id": (f"UPDATE {TABLE} SET content_id = ?", ("garbage",)),
    "bad_checksum": (f"UPDATE {TABLE} SET checksum = ?", ("f" * 64,)),
    "dev_not_an_int": (f"UPDATE {TABLE} SET dev = ?", ("x",)),
    "size_changed": (f"UPDATE {TABLE} SET size = size + 1", ()),
    "path_changed_to_another": (f"UPDATE {TABLE} SET target = ?", ("/elsewhere",)),
}


@pytest.mark.parametrize("case", sorted(GARBLE))
def test_garbled_record_is_a_miss_and_rewritten(make_cache, src, case):
    data = b"weights" * 1000
    path = write(src / "a.bin", data)
    cache = make_cache()
    cache.resolve([path])
    sql(cache, *GARBLE[case])
    (d,) = cache.resolve([path])
    assert (d.content_id, d.origin) == (sha(data), "hashed")
    assert cache.resolve([path])[0].origin == "cache"  # rewritten
    assert cache.hash_calls == 2


@pytest.mark.parametrize("kind", ["garbage_file", "directory_in_its_place"])
def test_unusable_database_falls_back_to_hashing(make_cache, src, tmp_path, kind):
    data = b"abc" * 5000
    path = write(src / "a.bin", data)
    (tmp_path / "root").mkdir()
    dbpath = tmp_path / "root" / db.FILENAME
    if kind == "garbage_file":
        dbpath.write_bytes(b"this is not a sqlite database\n" * 200)
    else:
        dbpath.mkdir()
    cache = make_cache()
    cache.start()
    results = [cache.resolve([path])[0] for _ in range(2)]
    assert [(r.content_id, r.origin) for r in results] == [(sha(data), "hashed")] * 2
    assert cache.hash_calls == 2 and cache.stats()["hwr_source_cache_errors_total"] > 0
    with pytest.raises(Unavailable, match="index.sqlite"):
        cache.list_records()


def test_locked_database_falls_back_to_hashing(make_cache, src):
    data = b"locked" * 999
    path = write(src / "a.bin", data)
    cache = make_cache()
    cache.start()
    other = sqlite3.connect(db.path_of(cache.root), isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # holds the write lock: our record write times out
    try:
        (d,) = cache.resolve([path])
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert (d.content_id, d.origin) == (sha(data), "hashed")
    assert cache.list_records() == []
    assert cache.resolve([path])[0].origin == "hashed"  # recorded now ...
    assert cache.resolve([path])[0].origin == "cache"  # ... and used


# -- invalidation on each stat field ------------------------------------------------


def _touch(path, other):
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 1_000_000_000))  # a future mtime is never recorded
    return open(path, "rb").read()


def _same_size_rewrite_same_mtime(path, other):
    st = os.stat(path)
    data = b"Y" * st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # only ctime (and bytes) differ now
    return data


def _rename_other_into_place(path, other):
    st = os.stat(path)
    data = b"Z" * st.st_size
    write(other, data)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.rename(other, path)  # new inode, same size and mtime
    return data


MUTATIONS = {"touch": _touch, "same_size_rewrite": _same_size_rewrite_same_mtime,
             "rename_into_place": _rename_other_into_place}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_stat_change_invalidates(make_cache, src, mutation):
    path = write(src / "a.bin", b"X" * 4096)
    cache = make_cache()
    cache.resolve([path])
    data = MUTATIONS[mutation](path, str(src / "other.tmp"))
    (d,) = cache.resolve([path])
    assert (d.content_id, d.origin) == (sha(data), "hashed")
    assert cache.resolve([path])[0].origin == "cache"


def test_symlink_retargeted_invalidates(make_cache, src):
    a = write(src / "a.bin", b"A" * 100)
    b = write(src / "b.bin", b"B" * 100)
    st = os.stat(a)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    link = str(src / "model.bin")
    os.symlink("a.bin", link)
    cache = make_cache()
    assert cache.resolve([link])[0].content_id == sha(b"A" * 100)
    os.unlink(link)
    os.symlink("b.bin", link)
    (d,) = cache.resolve([link])
    assert (d.content_id, d.origin) == (sha(b"B" * 100), "hashed")


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(FileState)])
def test_record_differing_in_any_field_is_a_miss(make_cache, src, field):
    """A well-formed record (valid checksum) for another device, inode, size,
    mtime, ctime or target is not used."""
    data = b"field" * 100
    path = write(src / "a.bin", data)
    cache = make_cache()
    cache.resolve([path])
    state = FileState.of(os.stat(path), os.path.realpath(path))
    value = getattr(state, field)
    other = dataclasses.replace(state, **{field: value + "x" if isinstance(value, str) else value + 1})
    record = SourceRecordRow.new(path, other, "sha256:" + "1" * 64)
    sql(cache, f"INSERT OR REPLACE INTO {TABLE} VALUES (?,?,?,?,?,?,?,?,?,?)", record.to_row())
    (d,) = cache.resolve([path])
    assert (d.content_id, d.origin) == (sha(data), "hashed")


def test_recently_modified_file_is_not_recorded(make_cache, src):
    """Racily clean: a same-size rewrite in the same timestamp tick would be
    invisible, so a file modified within the window is hashed, not recorded."""
    path = write(src / "fresh.bin", b"new" * 10)
    cache = make_cache(racy_window_ns=srcmod.RACY_WINDOW_NS)
    assert [cache.resolve([path])[0].origin for _ in range(2)] == ["hashed", "hashed"]
    assert cache.list_records() == []


# -- single flight and parallelism -----------------------------------------------


def test_eight_concurrent_callers_hash_once(make_cache, src):
    size = 256 * 1024 * 1024
    path = str(src / "big.safetensors")
    with open(path, "wb") as f:
        block = bytes(range(256)) * 4096
        for _ in range(size // len(block)):
            f.write(block)
    expected = "sha256:" + hash_file(path)[0]
    cache = make_cache()
    barrier = threading.Barrier(8)
    results: list = [None] * 8

    def call(i: int) -> None:
        barrier.wait()
        results[i] = cache.resolve([path])[0].content_id

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [expected] * 8
    assert cache.hash_calls == 1
    assert cache.stats()["hwr_source_hashed_bytes_total"] == size


def test_many_files_in_one_call(make_cache, src):
    datas = [os.urandom(100_000 + i) for i in range(6)]
    paths = [write(src / f"f{i}.bin", d) for i, d in enumerate(datas)]
    cache = make_cache()
    assert [d.content_id for d in cache.resolve(paths)] == [sha(d) for d in datas]
    assert cache.hash_calls == 6
    assert [d.origin for d in cache.resolve(paths + paths[:1])] == ["cache"] * 7


def test_changed_while_hashing_is_reported_and_not_cached(make_cache, src, monkeypatch):
    path = write(src / "a.bin", b"1" * 10000)
    real_hash_fd = srcmod.hash_fd

    def hash_fd_then_writer_appends(fd, p):  # seam: the hashing primitive
        out = real_hash_fd(fd, p)
        with open(path, "ab") as f:
            f.write(b"2")
        return out

    monkeypatch.setattr(srcmod, "hash_fd", hash_fd_then_writer_appends)
    cache = make_cache()
    with pytest.raises(FailedPrecondition, match=f"source {path}: changed while it was hashed"):
        cache.resolve([path])
    assert cache.list_records() == []
    monkeypatch.setattr(srcmod, "hash_fd", real_hash_fd)
    assert cache.resolve([path])[0].content_id == sha(b"1" * 10000 + b"2")


# -- trusted hub identity ------------------------------------------------------------

REV = "0123456789abcdef0123456789abcdef01234567"
FAKE = "ab" * 32  # deliberately NOT the content's SHA-256: proves the name is used unhashed


def hub_repo(base, repo="models--org--name"):
    r = base / "hub" / repo
    (r / "blobs").mkdir(parents=True)
    (r / "snapshots" / REV / "transformer").mkdir(parents=True)
    (r / "blobs" / FAKE).write_bytes(b"blob bytes")
    return r


def test_exact_hub_layout_is_trusted(make_cache, src):
    r = hub_repo(src)
    top = r / "snapshots" / REV / "model.safetensors"
    nested = r / "snapshots" / REV / "transformer" / "diffusion_pytorch_model.safetensors"
    os.symlink(f"../../blobs/{FAKE}", top)
    os.symlink(f"../../../blobs/{FAKE}", nested)
    cache = make_cache()
    out = cache.resolve([str(top), str(nested)])
    assert [(d.content_id, d.size, d.cached, d.origin) for d in out] == [("sha256:" + FAKE, 10, True, "hub")] * 2
    assert cache.hash_calls == 0


def _near_misses():
    def link(r, target, name="model.safetensors", sub=""):
        p = r / "snapshots" / REV / sub / name
        os.symlink(target, p)
        return p

    def wrong_repo_name(src):
        return link(hub_repo(src, "models--name"), f"../../blobs/{FAKE}")

    def dataset_repo(src):
        return link(hub_repo(src, "datasets--org--name"), f"../../blobs/{FAKE}")

    def rev_not_a_commit(src):
        r = hub_repo(src)
        os.rename(r / "snapshots" / REV, r / "snapshots" / "main")
        p = r / "snapshots" / "main" / "model.safetensors"
        os.symlink(f"../../blobs/{FAKE}", p)
        return p

    def regular_file_in_snapshot(src):
        r = hub_repo(src)
        p = r / "snapshots" / REV / "model.safetensors"
        shutil.copy(r / "blobs" / FAKE, p)
        return p

    def blob_name_not_64_hex(src):
        r = hub_repo(src)
        os.rename(r / "blobs" / FAKE, r / "blobs" / (FAKE[:-1]))
        return link(r, f"../../blobs/{FAKE[:-1]}")

    def blob_name_uppercase(src):
        r = hub_repo(src)
        os.rename(r / "blobs" / FAKE, r / "blobs" / FAKE.upper())
        return link(r, f"../../blobs/{FAKE.upper()}")

    def blob_of_another_repo(src):
        hub_repo(src, "models--org--other")
        return link(hub_repo(src), f"../../../models--org--other/blobs/{FAKE}")

    def via_intermediate_link(src):
        r = hub_repo(src)
        os.symlink(f"blobs/{FAKE}", r / "alias")
        return link(r, "../../alias")

    def blob_is_a_link(src):
        r = hub_repo(src)
        (src / "elsewhere").write_bytes(b"blob bytes")
        os.unlink(r / "blobs" / FAKE)
        os.symlink(src / "elsewhere", r / "blobs" / FAKE)
        return link(r, f"../../blobs/{FAKE}")

    def blobs_dir_is_a_link(src):
        r = hub_repo(src)
        os.rename(r / "blobs", src / "real-blobs")
        os.symlink(src / "real-blobs", r / "blobs")
        return link(r, f"../../blobs/{FAKE}")

    def subdir_is_a_link(src):
        r = hub_repo(src)
        (src / "realsub").mkdir()
        os.symlink(r / "blobs" / FAKE, src / "realsub" / "m.safetensors")
        os.rmdir(r / "snapshots" / REV / "transformer")
        os.symlink(src / "realsub", r / "snapshots" / REV / "transformer")
        return r / "snapshots" / REV / "transformer" / "m.safetensors"

    def the_blob_itself(src):
        return hub_repo(src) / "blobs" / FAKE

    return {f.__name__: f for f in (wrong_repo_name, dataset_repo, rev_not_a_commit, regular_file_in_snapshot,
                                     blob_name_not_64_hex, blob_name_uppercase, blob_of_another_repo,
                                     via_intermediate_link, blob_is_a_link, blobs_dir_is_a_link,
                                     subdir_is_a_link, the_blob_itself)}


NEAR_MISSES = _near_misses()


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_hub_near_misses_are_hashed(make_cache, src, case):
    path = str(NEAR_MISSES[case](src))
    cache = make_cache()
    (d,) = cache.resolve([path])
    assert (d.content_id, d.origin, cache.hash_calls) == (sha(b"blob bytes"), "hashed", 1)
