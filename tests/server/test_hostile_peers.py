"""Who a caller is, and what the runtime socket shows it, on a node shared
by two users, against the REAL daemon (root's workers; the attacker is uid
``nobody``):

- the listings the ``hwr`` CLI reads over the runtime socket answer each
  caller for itself: the landed daemon showed nobody the path and SHA-256 of
  a root-only checkpoint (ListSources) that ResolveSources refused it, and
  root's lease holders' pids and program names (ListLeases, InspectArtifact);
- a peer token is bound to its live process: the landed daemon accepted
  root's token from nobody after root's process had exited (and after a
  daemon restart), and answered it the digest of a root-only file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from tests.conftest import identity, sample_tensors
from tests.support.shared_node import run_nobody, served_to_nobody

SECRET = b"root-only weights " * 64
PUBLIC = b"public weights " * 64


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def tree():
    """A source root under /tmp (tmp_path is 0700: nobody reaches nothing
    there) holding a root-only file and a public one."""
    base = tempfile.mkdtemp(prefix="hwr-peers-src-", dir="/tmp")
    os.chmod(base, 0o755)
    store = tempfile.mkdtemp(prefix="hwr-peers-store-", dir="/tmp")  # nobody maps its lease from here
    os.chmod(store, 0o755)
    paths = {"store": os.path.join(store, "root")}
    for name, data, mode in (("secret.safetensors", SECRET, 0o600), ("public.safetensors", PUBLIC, 0o644)):
        path = paths[name.split(".")[0]] = os.path.join(base, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
    yield {"base": base, **paths}
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(store, ignore_errors=True)


# nobody's view, with hwr_client (its token names uid 65534): every listing,
# and a lease of its own held while it lists.
NOBODY_LISTS = textwrap.dedent("""
    import json, os, sys, hwr_client
    from hwr_client.core._proto import hwr_pb2 as pb
    c = hwr_client.connect(os.environ["T_SOCKET"])
    key = os.environ["T_KEY"]
    with c.acquire(key):
        sources = c.call(c.reader.ListSources, pb.ListSourcesRequest()).records
        leases = c.call(c.reader.ListLeases, pb.ListLeasesRequest()).leases
        arts = c.call(c.reader.ListArtifacts, pb.ListArtifactsRequest()).artifacts
        inspect = c.call(c.reader.InspectArtifact, pb.InspectArtifactRequest(key=key))
    print(json.dumps({
        "sources": [[r.path, r.content_id] for r in sources],
        "leases": [[l.pid, l.client_name, l.key] for l in leases],
        "artifacts": [[a.key, a.lease_count, a.last_leased_unix] for a in arts],
        "inspect_leases": [[l.pid, l.client_name] for l in inspect.leases],
        "me": os.getpid()}))
""")


def test_the_runtime_socket_lists_only_what_concerns_the_caller(make_daemon_fixture, tmp_path, tree):
    d = served_to_nobody(make_daemon_fixture, tmp_path, None, "--source-root", tree["base"], root=tree["store"])
    with d.client() as c:
        key = c.publish(identity(t="listings"), sample_tensors()).key
        # Both recorded (the daemon records a file only once its ctime is
        # past the racy window, a second: resolved again until it has).
        for _ in range(100):
            got = {s.path: s.content_id for s in c.resolve_sources([tree["secret"], tree["public"]])}
            assert got == {tree["secret"]: sha(SECRET), tree["public"]: sha(PUBLIC)}
            if len(c.call(c.admin.ListSources, pb.ListSourcesRequest()).records) == 2:
                break
            time.sleep(0.1)
    root_worker = subprocess.Popen(
        [sys.executable, "-c", "import sys, hwr_client\n"
                               "sys.argv[0] = 'root-secret-program'  # the lease holder's program name\n"
                               "c = hwr_client.connect(sys.argv[1])\n"
                               "l = c.acquire(sys.argv[2]); print('held', flush=True); sys.stdin.read()",
         d.socket, key], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=d.env)
    try:
        assert root_worker.stdout.readline().strip() == "held"
        seen = run_nobody(NOBODY_LISTS, env=dict(os.environ, T_SOCKET=d.socket, T_KEY=key))
        # Sources: the public file only; nothing of the root-only one.
        assert seen["sources"] == [[tree["public"], sha(PUBLIC)]]
        assert sha(SECRET) not in json.dumps(seen) and tree["secret"] not in json.dumps(seen)
        # Leases: its own, none of root's (pid, program, key).
        assert [(pid, k) for pid, _, k in seen["leases"]] == [(seen["me"], key)]
        assert root_worker.pid not in [pid for pid, _, _ in seen["leases"]] + [p for p, _ in seen["inspect_leases"]]
        assert "root-secret-program" not in json.dumps(seen)
        assert seen["inspect_leases"] == [[seen["me"], seen["inspect_leases"][0][1]]]
        # The shared index is listed, with the caller's own lease figures.
        assert seen["artifacts"] == [[key, 1, 0]]
        # Root (the daemon's own uid here) and the admin socket see everything.
        with d.client() as c:
            for stub in (c.reader, c.admin):
                records = c.call(stub.ListSources, pb.ListSourcesRequest()).records
                assert {r.path for r in records} == {tree["secret"], tree["public"]}
                holders = c.call(stub.ListLeases, pb.ListLeasesRequest()).leases
                assert [(h.pid, h.client_name) for h in holders] == [(root_worker.pid, "root-secret-program")]
    finally:
        root_worker.stdin.close()
        root_worker.wait(30)


# A root process: shake hands, print the token, exit (its token is then a
# dead process's).
ROOT_TOKEN = "import sys\nfrom hwr_client.channel import peer_token\nprint(peer_token(sys.argv[1]))\n"

# nobody replays a token (raw gRPC, the token as metadata) and asks for the
# root-only file's digest.
REPLAY = textwrap.dedent("""
    import json, os, grpc
    from hwr_client.core._proto import hwr_pb2 as pb, hwr_pb2_grpc as pb_grpc
    stub = pb_grpc.RuntimeStub(grpc.insecure_channel("unix:" + os.environ["T_SOCKET"]))
    try:
        r = stub.ResolveSources(pb.ResolveSourcesRequest(paths=[os.environ["T_PATH"]]), timeout=30,
                                metadata=[("hwr-peer-token", os.environ["T_TOKEN"])])
        print(json.dumps(["OK", r.sources[0].content_id]))
    except grpc.RpcError as e:
        print(json.dumps([e.code().name, e.details()]))
""")

# A root process that shakes hands, then becomes nobody and sends its root token.
SETUID_REPLAY = textwrap.dedent("""
    import json, os, grpc
    from hwr_client.channel import peer_token
    from hwr_client.core._proto import hwr_pb2 as pb, hwr_pb2_grpc as pb_grpc
    token = peer_token(os.environ["T_SOCKET"])
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    stub = pb_grpc.RuntimeStub(grpc.insecure_channel("unix:" + os.environ["T_SOCKET"]))
    try:
        r = stub.ResolveSources(pb.ResolveSourcesRequest(paths=[os.environ["T_PATH"]]), timeout=30,
                                metadata=[("hwr-peer-token", token)])
        print(json.dumps(["OK", r.sources[0].content_id]))
    except grpc.RpcError as e:
        print(json.dumps([e.code().name, e.details()]))
""")


def test_a_token_dies_with_its_process(make_daemon_fixture, tmp_path, tree):
    d = served_to_nobody(make_daemon_fixture, tmp_path, None, "--source-root", tree["base"])
    token = subprocess.run([sys.executable, "-c", ROOT_TOKEN, d.socket], capture_output=True, text=True,
                           env=d.env, check=True, timeout=60).stdout.strip()
    assert token.split(".")[2] == "0"  # root's (uid 0), of a process that has exited
    env = dict(os.environ, T_SOCKET=d.socket, T_PATH=tree["secret"], T_TOKEN=token)
    for when in ("after the process exited", "after a daemon restart"):
        code, details = run_nobody(REPLAY, env=env)
        assert code == "PERMISSION_DENIED", (when, code, details)
        assert "a caller of unknown uid" in details  # the anonymous peer: the token was refused
        d.restart()
    # A process that changed users since its handshake is not root any more.
    r = subprocess.run([sys.executable, "-c", SETUID_REPLAY], capture_output=True, text=True, timeout=60,
                       env=dict(d.env, T_SOCKET=d.socket, T_PATH=tree["secret"]))
    assert r.returncode == 0, r.stderr[-2000:]
    code, details = json.loads(r.stdout.strip().splitlines()[-1])
    assert code == "PERMISSION_DENIED" and "a caller of unknown uid" in details, details
    # The premise: root's own live process is answered.
    with d.client() as c:
        assert [s.content_id for s in c.resolve_sources([tree["secret"]])] == [sha(SECRET)]
