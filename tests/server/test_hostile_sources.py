"""ResolveSources never vouches for a file its caller could not read: a
REAL root daemon, called by a child that runs as
uid ``nobody`` (tests/privdrop.py), with a source root that holds a
public file, a root-only file, a file in a 0700 directory and a directory
``nobody`` owns and plants links in.

The daemon learns no caller uid yet (hwr_server.access.peers: the credentials
handshake is not there), so its rule is the anonymous one: a file is vouched
for only when "others" may read it (o+r) and traverse every directory from
the source root down to it (o+x). Everything else is PERMISSION_DENIED and
the client hashes the file itself, with its own rights.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import struct
import tempfile

import grpc
import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import InvalidArgument
from tests.support.privdrop import run_python_as
from tests.support.sources import settle

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching uid needs root")

PUBLIC = b"public bytes " * 100
SECRET_IN_ROOT = b"secret inside the source root " * 100
SECRET_OUTSIDE = b"secret outside every source root " * 100
ROOT_ONLY = b"root-only file " * 100

#: Seconds the race loop runs. The finding leaked hundreds of answers in 20 s;
#: a few seconds of four callers cover many thousands of flips.
RACE_SECONDS = 4.0


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _write(path: str, data: bytes, mode: int) -> str:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


@pytest.fixture
def tree():
    """The source root and a secret outside it, under /tmp (tmp_path is
    0700 under /tmp/pytest-of-root: nobody could reach nothing there)."""
    user = pwd.getpwnam("nobody")
    base = tempfile.mkdtemp(prefix="hwr-hostile-src-", dir="/tmp")
    outside = tempfile.mkdtemp(prefix="hwr-hostile-secret-", dir="/tmp")  # 0700, root
    try:
        os.chmod(base, 0o755)
        os.mkdir(os.path.join(base, "pub"), 0o755)
        os.mkdir(os.path.join(base, "private"), 0o700)
        os.mkdir(os.path.join(base, "shared"), 0o755)
        os.mkdir(os.path.join(base, "nobody"), 0o755)
        os.chown(os.path.join(base, "nobody"), user.pw_uid, user.pw_gid)
        t = {
            "base": base,
            "public": _write(os.path.join(base, "pub", "ok.bin"), PUBLIC, 0o644),
            "in_root": _write(os.path.join(base, "private", "secret.bin"), SECRET_IN_ROOT, 0o644),
            "root_only": _write(os.path.join(base, "root-only.bin"), ROOT_ONLY, 0o600),
            "outside": _write(os.path.join(outside, "secret.bin"), SECRET_OUTSIDE, 0o600),
            "shared": _write(os.path.join(base, "shared", "f.bin"), PUBLIC + b"shared", 0o644),
            "plant": os.path.join(base, "nobody"),
        }
        yield t
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)


@pytest.fixture
def served(make_daemon_fixture, tree):
    # The daemon runs as root (as in production); nobody reaches its runtime
    # socket through the socket's group, like a worker in group "hwr".
    d = make_daemon_fixture("--source-root", tree["base"], "--socket-group", "nogroup", start=False)
    os.chmod(os.path.dirname(d.socket), 0o755)  # mkdtemp made it 0700; the socket's own mode decides
    return d.start()


_CHILD_RESOLVE = r"""
import json, os, grpc
from hwr_client.core._proto import hwr_pb2 as pb, hwr_pb2_grpc as pb_grpc
stub = pb_grpc.RuntimeStub(grpc.insecure_channel("unix:" + os.environ["T_SOCKET"]))
plants = json.loads(os.environ["T_PLANTS"])
for link, target in plants.items():
    os.symlink(target, link)
out = {"uid": os.getuid(), "answers": {}}
for p in json.loads(os.environ["T_PATHS"]):
    try:
        with open(p, "rb") as f:
            f.read(1)
        readable = True
    except OSError:
        readable = False
    try:
        r = stub.ResolveSources(pb.ResolveSourcesRequest(paths=[p]), timeout=30)
        out["answers"][p] = ["OK", r.sources[0].content_id, readable]
    except grpc.RpcError as e:
        out["answers"][p] = [e.code().name, e.details(), readable]
print(json.dumps(out))
"""


def _resolve_as_nobody(d, paths: list[str], plants: dict[str, str] | None = None) -> dict:
    """Runs the child as nobody: plants ``{link: target}``, then one
    ResolveSources per path; returns {path: [code, content id or details,
    readable by nobody]}."""
    user = pwd.getpwnam("nobody")
    env = dict(os.environ, T_SOCKET=d.socket, T_PATHS=json.dumps(paths), T_PLANTS=json.dumps(plants or {}))
    r = run_python_as(user.pw_uid, user.pw_gid, _CHILD_RESOLVE, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["uid"] == user.pw_uid
    return out["answers"]


def test_nobody_gets_no_digest_of_what_nobody_cannot_read(served, tree):
    """Deterministic: the secret in a 0700 directory (by name and through a
    planted link), a root-only 0600 file, a planted link to a secret outside
    the roots. Each is PERMISSION_DENIED; the public file still resolves."""
    link_in = os.path.join(tree["plant"], "to-private.bin")
    link_out = os.path.join(tree["plant"], "to-outside.bin")
    link_ok = os.path.join(tree["plant"], "to-public.bin")
    paths = [tree["public"], link_ok, tree["in_root"], link_in, tree["root_only"], link_out]
    got = _resolve_as_nobody(served, paths, {link_in: tree["in_root"], link_out: tree["outside"],
                                             link_ok: "../pub/ok.bin"})
    assert got[tree["public"]] == ["OK", sha(PUBLIC), True]
    assert got[link_ok] == ["OK", sha(PUBLIC), True]
    for p in (tree["in_root"], link_in, tree["root_only"], link_out):
        code, details, readable = got[p]
        assert readable is False, p  # the premise: nobody cannot read it
        assert code == "PERMISSION_DENIED", (p, got[p])
        assert sha(SECRET_IN_ROOT) not in details and sha(ROOT_ONLY) not in details
    assert "readable by others" in got[tree["in_root"]][1] and "private" in got[tree["in_root"]][1]
    assert "outside" in got[link_out][1]


def _deny_nobody_by_acl(path: str) -> bool:
    """Gives ``path`` (mode 0644) a POSIX ACL with ``user:nobody:---``: the
    mode bits say others may read, the ACL says nobody may not. False when
    the file system takes no ACLs."""
    nobody = pwd.getpwnam("nobody").pw_uid
    undefined = 0xFFFFFFFF
    # struct posix_acl_xattr: version 2, then (tag, perm, id) entries in tag
    # order: USER_OBJ rw-, USER nobody ---, GROUP_OBJ r--, MASK r--, OTHER r--.
    entries = [(0x01, 6, undefined), (0x02, 0, nobody), (0x04, 4, undefined), (0x10, 4, undefined),
               (0x20, 4, undefined)]
    try:
        os.setxattr(path, "system.posix_acl_access",
                    struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))
    except OSError:
        return False
    return True


def test_no_oracle_behind_a_directory_nobody_cannot_search(served, tree):
    """What lies in a 0700 directory (a missing name, a subdirectory, a
    FIFO) is answered with the same PERMISSION_DENIED as a secret file: the
    root daemon tells nobody whether a name exists there."""
    private = os.path.dirname(tree["in_root"])
    os.mkdir(os.path.join(private, "sub"))
    os.mkfifo(os.path.join(private, "pipe"))
    paths = [os.path.join(private, n) for n in ("missing.bin", "sub", "pipe", "sub/deeper/missing.bin")]
    got = _resolve_as_nobody(served, paths)
    for p in paths:
        code, details, readable = got[p]
        assert (code, readable) == ("PERMISSION_DENIED", False), (p, got[p])
        assert "may not search directory" in details and "no such file" not in details, details
    # Where nobody may look, the real reason is given.
    missing = os.path.join(tree["base"], "pub", "missing.bin")
    assert _resolve_as_nobody(served, [missing])[missing][0] == "NOT_FOUND"


def test_an_acl_that_denies_the_caller_is_respected(served, tree):
    """Mode 0644 with ``user:nobody:---``: the mode bits alone would vouch;
    a file carrying an ACL is vouched for only to root or its owner."""
    path = _write(os.path.join(tree["base"], "pub", "acl.bin"), b"acl-protected", 0o644)
    if not _deny_nobody_by_acl(path):
        pytest.skip("the file system under /tmp takes no POSIX ACLs")
    code, details, readable = _resolve_as_nobody(served, [path])[path]
    assert (code, readable) == ("PERMISSION_DENIED", False), details
    assert sha(b"acl-protected") not in details


def test_a_cached_record_is_not_answered_to_a_caller_who_cannot_read_it(served, tree):
    """The record was made while the file was public; its directory became
    0700 (the file's own stat fields, hence the record, are unchanged). A
    cache hit for it would be the same leak as hashing it."""
    path = tree["shared"]
    settle(path)  # old enough to be recorded (hwr_server.sources.cache.RACY_WINDOW_NS)
    first = _resolve_as_nobody(served, [path])[path]
    assert first == ["OK", sha(PUBLIC + b"shared"), True]
    with served.client() as client:
        listed = client.call(client.admin.ListSources, pb.ListSourcesRequest())
        assert [r.path for r in listed.records] == [path]
    os.chmod(os.path.dirname(path), 0o700)
    code, details, readable = _resolve_as_nobody(served, [path])[path]
    assert (code, readable) == ("PERMISSION_DENIED", False), details
    assert sha(PUBLIC + b"shared") not in details


def test_hard_links_do_not_lend_access(served, tree):
    """nobody cannot hard-link a root-only file (fs.protected_hardlinks);
    one linked by root into a public directory is still refused: the rule
    reads the inode's own mode."""
    user = pwd.getpwnam("nobody")
    attempt = run_python_as(user.pw_uid, user.pw_gid,
                            f"import os\ntry:\n os.link({tree['root_only']!r}, {tree['plant'] + '/hl.bin'!r})\n"
                            "except OSError as e:\n print(e.errno)\nelse:\n print('linked')")
    assert attempt.returncode == 0, attempt.stderr
    hl = os.path.join(tree["base"], "pub", "root-made-link.bin")
    os.link(tree["root_only"], hl)
    paths = [hl] + ([tree["plant"] + "/hl.bin"] if attempt.stdout.strip() == "linked" else [])
    got = _resolve_as_nobody(served, paths)
    for p in paths:
        assert got[p][0] == "PERMISSION_DENIED" and got[p][2] is False, got[p]


_CHILD_RACE = r"""
import collections, json, os, threading, time, grpc
from hwr_client.core._proto import hwr_pb2 as pb, hwr_pb2_grpc as pb_grpc
link, targets, seconds = os.environ["T_LINK"], json.loads(os.environ["T_TARGETS"]), float(os.environ["T_SECONDS"])
stop = threading.Event()
flips = [0]

def flipper():
    # Atomic retarget: a new link under a temp name renamed over the old one,
    # so the path always exists and names one of the targets.
    tmp = link + ".tmp"
    while not stop.is_set():
        for t in targets:
            os.symlink(t, tmp)
            os.rename(tmp, link)
            flips[0] += 1

answers = collections.Counter()
lock = threading.Lock()

def caller():
    stub = pb_grpc.RuntimeStub(grpc.insecure_channel("unix:" + os.environ["T_SOCKET"]))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            r = stub.ResolveSources(pb.ResolveSourcesRequest(paths=[link]), timeout=30)
            key = "OK " + r.sources[0].content_id
        except grpc.RpcError as e:
            key = e.code().name
        with lock:
            answers[key] += 1

os.symlink(targets[0], link)
threads = [threading.Thread(target=flipper)] + [threading.Thread(target=caller) for _ in range(4)]
for t in threads:
    t.start()
for t in threads[1:]:
    t.join()
stop.set()
threads[0].join()
print(json.dumps({"answers": dict(answers), "flips": flips[0]}))
"""


def test_flipping_link_race_never_leaks(served, tree):
    """Nobody flips a link under the source root between a public
    file, a secret outside every root and a secret in a 0700 directory while
    four threads call ResolveSources for RACE_SECONDS. Not one answer may
    carry a secret's digest (the old check-then-reopen leaked hundreds)."""
    user = pwd.getpwnam("nobody")
    env = dict(os.environ, T_SOCKET=served.socket, T_LINK=os.path.join(tree["plant"], "flip.bin"),
               T_TARGETS=json.dumps(["../pub/ok.bin", tree["outside"], tree["in_root"]]),
               T_SECONDS=str(RACE_SECONDS))
    r = run_python_as(user.pw_uid, user.pw_gid, _CHILD_RACE, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    answers = result["answers"]
    leaked = {k: n for k, n in answers.items() if k in ("OK " + sha(SECRET_OUTSIDE), "OK " + sha(SECRET_IN_ROOT))}
    assert leaked == {}, result
    assert set(answers) <= {"OK " + sha(PUBLIC), "PERMISSION_DENIED", "NOT_FOUND", "FAILED_PRECONDITION"}, result
    # Not vacuous: the link really flipped, and both sides of it were seen.
    assert answers.get("OK " + sha(PUBLIC), 0) > 0 and answers.get("PERMISSION_DENIED", 0) > 0, result
    assert result["flips"] > 100, result


def test_nul_byte_in_a_path_is_invalid_argument(served, tree):
    """A NUL byte in a path is refused at the
    boundary, naming the path's index; never INTERNAL with a traceback."""
    with served.client() as client:
        with pytest.raises(InvalidArgument, match=r"ResolveSources: paths\[1\] contains a NUL byte"):
            client.call(client.runtime.ResolveSources,
                        pb.ResolveSourcesRequest(paths=[tree["public"], tree["base"] + "/pub/ok\x00.bin"]))
        with pytest.raises(InvalidArgument, match=r"ForgetSource: path contains a NUL byte"):
            client.call(client.admin.ForgetSource, pb.ForgetSourceRequest(path="/a\x00b"))
        # The daemon is fine afterwards, and nothing was read for the bad call.
        (d,) = client.resolve_sources([tree["public"]])
        assert d.content_id == sha(PUBLIC)
    assert "Traceback" not in served.log()


def test_oversized_requests_are_refused_before_any_file_is_opened(served, tree):
    """A request over max_resolve_paths is RESOURCE_EXHAUSTED naming the
    limit and the config field; a path over PATH_MAX bytes is
    INVALID_ARGUMENT; neither reaches the file system."""
    with served.client() as client:
        with pytest.raises(grpc.RpcError) as err:
            client.runtime.ResolveSources(pb.ResolveSourcesRequest(paths=[tree["public"]] * 4097), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "4097 paths" in err.value.details() and "max_resolve_paths" in err.value.details()
        long_path = tree["base"] + "/" + "x" * 5000
        with pytest.raises(InvalidArgument, match=r"paths\[0\] is 50\d\d bytes long"):
            client.call(client.runtime.ResolveSources, pb.ResolveSourcesRequest(paths=[long_path]))
        assert len(client.resolve_sources([tree["public"]] * 4096)) == 4096  # the boundary itself is accepted
