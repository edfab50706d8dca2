"""The source-digest cache in-process: who may have a file vouched for (source roots, the caller's uid, file kinds, a file swapped in after the check)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import tempfile
import threading

import pytest

from hwr_client.core import digests
from hwr_client.core.digests import absolute_path, hash_file, normalize_path
from hwr_client.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from hwr_server.access.peers import ANONYMOUS, Peer
from hwr_server.sources.access import Seen
from hwr_server.config import ServerConfig
from hwr_server.sources import cache as srcmod
from hwr_server.sources.cache import TABLE, SourceCache
from tests.support.sources import sha, sql, write
from tests.support.sources import make_cache, src  # noqa: F401 - fixtures, used by name

# -- access and file kinds --------------------------------------------------------------


def test_outside_source_roots_is_refused(make_cache, src, tmp_path):
    outside = write(tmp_path / "elsewhere" / "a.bin", b"x")
    cache = make_cache()
    with pytest.raises(PermissionDenied, match=f"source {outside}: outside the daemon's source roots"):
        cache.resolve([outside])
    os.symlink(outside, src / "escape.bin")
    with pytest.raises(PermissionDenied, match="a link under a source root that resolves to .*outside"):
        cache.resolve([str(src / "escape.bin")])
    os.symlink(str(src), tmp_path / "src-alias")  # outside lexically, inside once resolved: allowed
    inside = write(src / "in.bin", b"in")
    assert cache.resolve([str(tmp_path / "src-alias" / "in.bin")])[0].content_id == sha(b"in")
    assert cache.resolve([str(tmp_path / "src-alias" / "." / "in.bin")])[0].origin == "cache"
    # ".." after a link is resolved by the kernel's rules, not lexically:
    # src/up/../in.bin names tmp_path/in.bin (outside), not src/in.bin.
    os.symlink(str(tmp_path / "elsewhere"), src / "up")
    write(tmp_path / "in.bin", b"outside")
    with pytest.raises(PermissionDenied, match="outside every source root"):
        cache.resolve([str(src / "up" / ".." / "in.bin")])
    assert cache.hash_calls == 1 and inside


def test_one_path_rule_for_daemon_and_client(make_cache, src):
    # "." and "//" are dropped; a path with ".." is kept as given (collapsing
    # it lexically would name another file after a symlink).
    assert normalize_path("/m//a/./b.bin") == "/m/a/b.bin"
    assert normalize_path("/m/link/../b.bin") == "/m/link/../b.bin"
    assert absolute_path("/m/./x") == "/m/x" and absolute_path("/m/l/../x") == "/m/l/../x"
    # The daemon keys its records with the same function the client uses.
    assert srcmod.normalize_path is digests.normalize_path
    assert not hasattr(srcmod, "_key_path")
    path = write(src / "k.bin", b"k")
    cache = make_cache()
    cache.resolve([path])
    assert cache.resolve([str(src) + "//./k.bin"])[0].origin == "cache"


def test_no_source_roots_vouches_for_any_file_a_proven_caller_may_read(make_cache, request):
    """The default: no source roots. A proven caller that says which file
    it sees (Seen) gets any regular file it may read, wherever it lies; an
    unproven one gets nothing (its uid cannot be checked against the file's
    mode), nor one that does not say which file it sees, nor one that sees
    another file at that path (another mount namespace)."""
    # Under /tmp: pytest's tmp_path sits in a 0700 directory no other uid may search.
    base = tempfile.mkdtemp(prefix="hwr-src-", dir="/tmp")
    os.chmod(base, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(base))
    elsewhere = write(os.path.join(base, "deep", "a.bin"), b"x" * 10)
    os.chmod(os.path.dirname(elsewhere), 0o755)
    os.chmod(elsewhere, 0o644)
    private = write(os.path.join(base, "private.bin"), b"p")
    os.chmod(private, 0o600)
    cache = make_cache(roots=[])
    me, other = Peer(pid=os.getpid(), uid=0), Peer(pid=os.getpid(), uid=4321)
    seen = Seen.of(os.stat(elsewhere))
    assert cache.resolve([elsewhere], peer=me, seen=[seen])[0].content_id == sha(b"x" * 10)
    assert cache.resolve([elsewhere], peer=me, seen=[seen])[0].origin == "cache"
    with pytest.raises(PermissionDenied, match="proved none"):
        cache.resolve([elsewhere], seen=[seen])  # anonymous
    with pytest.raises(PermissionDenied, match="did not say which file it sees"):
        cache.resolve([elsewhere], peer=me)
    with pytest.raises(PermissionDenied, match="sees another file there"):
        cache.resolve([elsewhere], peer=me, seen=[Seen.of(os.stat(private))])
    # Another uid: the daemon walks from / with that uid's rights.
    assert cache.resolve([elsewhere], peer=other, seen=[seen])[0].origin == "cache"
    with pytest.raises(PermissionDenied, match=f"uid 4321 may not read {private}"):
        cache.resolve([private], peer=other, seen=[Seen.of(os.stat(private))])
    each = cache.resolve_each([elsewhere, private], peer=other, seen=[seen, Seen.of(os.stat(private))])
    assert each[0].origin == "cache" and isinstance(each[1], PermissionDenied)
    assert cache.hash_calls == 1


def test_source_roots_restrict_a_proven_caller_too(make_cache, src, tmp_path):
    outside = write(tmp_path / "elsewhere" / "b.bin", b"b")
    inside = write(src / "a.bin", b"a")
    cache = make_cache()
    with pytest.raises(PermissionDenied, match=r"outside the daemon.s source roots .* \(an operator.s restriction"):
        cache.resolve([outside], peer=Peer(pid=os.getpid(), uid=0))
    # Under roots a caller need not say which file it sees; if it does, it must be the daemon's.
    assert cache.resolve([inside], peer=Peer(pid=os.getpid(), uid=0))[0].content_id == sha(b"a")
    with pytest.raises(PermissionDenied, match="sees another file there"):
        cache.resolve([inside], seen=[Seen.of(os.stat(outside))])


def test_relative_path_is_invalid(make_cache):
    with pytest.raises(InvalidArgument, match="expected an absolute path"):
        make_cache().resolve(["model.safetensors"])


def test_directory_fifo_missing_broken_link(make_cache, src):
    (src / "dir").mkdir()
    os.mkfifo(src / "pipe")
    os.symlink("gone.bin", src / "dangling")
    good = write(src / "good.bin", b"good")
    cache = make_cache()
    cases = [
        (str(src / "dir"), InvalidArgument, "is a directory; expected a regular file"),
        (str(src / "pipe"), InvalidArgument, "is a FIFO; expected a regular file"),
        (str(src / "missing.bin"), NotFound, "no such file"),
        (str(src / "dangling"), NotFound, "broken symlink to 'gone.bin'"),
    ]
    for path, cls, message in cases:
        outcome: list = []
        # A FIFO opened for reading would block forever: run in a thread so a
        # regression fails the test instead of hanging it.
        t = threading.Thread(target=lambda: outcome.append(_raises(cache.resolve, [good, path])), daemon=True)
        t.start()
        t.join(30)
        assert outcome, f"resolve({path}) blocked"
        assert isinstance(outcome[0], cls) and f"source {path}: {message}" in str(outcome[0]), outcome[0]
    assert cache.hash_calls == 0  # every path is checked before anything is hashed


def _raises(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return exc
    return None


def test_unreadable_file_as_unprivileged_user(make_cache):
    """Root reads everything, so the check runs in a forked child that drops
    to ``nobody``."""
    nobody = pwd.getpwnam("nobody")
    base = tempfile.mkdtemp(prefix="hwr-src-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        secret = write(os.path.join(base, "secret.bin"), b"s" * 100)
        public = write(os.path.join(base, "public.bin"), b"p" * 100)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
        os.mkdir(os.path.join(base, "root"), 0o777)
        os.chmod(os.path.join(base, "root"), 0o777)
        report = _run_as(nobody, lambda: _resolve_report(base, secret, public))
    finally:
        shutil.rmtree(base)
    assert report["public"] == sha(b"p" * 100)
    assert report["secret"][0] == "PermissionDenied"
    assert f"source {secret}: permission denied for uid {nobody.pw_uid}" in report["secret"][1]
    assert report["local"][0] == "PermissionDenied" and secret in report["local"][1]


def _resolve_report(base: str, secret: str, public: str) -> dict:
    cache = SourceCache(ServerConfig(root=os.path.join(base, "root"), source_roots=[base]), racy_window_ns=0)
    out = {"public": cache.resolve([public])[0].content_id}
    for key, fn in (("secret", lambda: cache.resolve([secret])), ("local", lambda: hash_file(secret))):
        exc = _raises(fn)
        out[key] = [type(exc).__name__, str(exc)]
    cache.stop()
    return out


def _run_as(user: pwd.struct_passwd, fn) -> dict:
    """Runs ``fn`` in a forked child with the user's uid/gid; returns its
    JSON-able result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            os.write(w, json.dumps(fn()).encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported through the pipe
            os.write(w, json.dumps({"child_error": repr(exc)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    result = json.loads(data)
    assert os.waitstatus_to_exitcode(status) == 0, result
    return result


def test_the_callers_uid_decides_what_is_vouched_for(make_cache, src):
    """The access rule of hwr_server.sources.cache for each kind of caller: uid 0
    everything; the owner its owner bits; another known uid (groups not
    known) the group AND other bits; an unknown uid every class (it may be
    anyone, the owner included)."""
    private = src / "private"
    private.mkdir()
    secret = write(private / "s.bin", b"s" * 10)
    os.chown(private, 1234, 1234)
    os.chown(secret, 1234, 1234)
    os.chmod(private, 0o700)
    os.chmod(secret, 0o640)
    cache = make_cache()
    assert cache.resolve([secret], peer=Peer(pid=1, uid=0))[0].content_id == sha(b"s" * 10)
    assert cache.resolve([secret], peer=Peer(pid=1, uid=1234))[0].origin == "cache"  # the owner
    for peer in (Peer(pid=1, uid=4321), ANONYMOUS):
        with pytest.raises(PermissionDenied, match=f"may not search directory {private} .mode 0700"):
            cache.resolve([secret], peer=peer)
    os.chmod(private, 0o755)
    for mode, other_uid_ok, anonymous_ok in ((0o640, False, False), (0o604, False, False), (0o444, True, True),
                                             (0o044, True, False), (0o644, True, True)):
        os.chmod(secret, mode)
        for peer, ok in ((Peer(pid=1, uid=4321), other_uid_ok), (ANONYMOUS, anonymous_ok)):
            outcome = _raises(cache.resolve, [secret], peer=peer)
            assert (outcome is None) == ok, (oct(mode), peer, outcome)
            assert outcome is None or (isinstance(outcome, PermissionDenied) and "may not read" in str(outcome))


def test_a_file_swapped_in_after_the_check_is_not_read(make_cache, src, monkeypatch):
    """The hashing job re-resolves the name (it holds no descriptor across the
    queue) and reads only the very file version the check cleared."""
    path = write(src / "a.bin", b"checked")
    other = write(src / "b.bin", b"swapped in")
    cache = make_cache()
    answer = cache._answer_without_hashing

    def swap_then_answer(*args):  # seam: between the check and the hash
        os.replace(other, path)
        return answer(*args)

    monkeypatch.setattr(cache, "_answer_without_hashing", swap_then_answer)
    with pytest.raises(FailedPrecondition, match="now names another file or version than the one checked"):
        cache.resolve([path])
    assert cache.stats()["hwr_source_hashed_bytes_total"] == 0 and cache.list_records() == []


# -- records ----------------------------------------------------------------------------


def test_list_and_forget(make_cache, src):
    a = write(src / "b" / "a.bin", b"a")
    b = write(src / "a.bin", b"bb")
    cache = make_cache()
    cache.resolve([a, b])
    records = cache.list_records()
    assert [(r.path, r.content_id, r.state.size) for r in records] == [(b, sha(b"bb"), 2), (a, sha(b"a"), 1)]
    sql(cache, f"UPDATE {TABLE} SET checksum = 'bad' WHERE path = ?", (a,))
    assert [r.path for r in cache.list_records()] == [b]  # corrupt rows are not listed
    assert cache.forget(b) is True and cache.forget(b) is False
    assert cache.resolve([b])[0].origin == "hashed"
    with pytest.raises(InvalidArgument):
        cache.forget("relative.bin")


def test_stopped_cache_answers_unavailable(make_cache, src):
    path = write(src / "a.bin", b"x")
    cache = make_cache()
    cache.stop()
    with pytest.raises(Unavailable, match="shutting down"):
        cache.resolve([path])
