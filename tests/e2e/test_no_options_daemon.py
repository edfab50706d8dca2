"""The fast path with no configuration, as a user meets it: `hwr serve`
started with no options (a root and sockets for the test's isolation; no
--source-root, no config), a real diffusers model saved with
save_pretrained, and fresh worker processes.

- the warm start hashes nothing in the worker (every client hash goes
  through hwr_client.core.digests.hash_fd, counted in the worker), is a
  LOCAL_HIT, and its output is bitwise the library's own from_pretrained;
- uid nobody, proven by the credentials handshake, still gets no digest of
  a root-only file, nor of one behind a directory it may not search;
- a worker that cannot prove its uid hashes, and its report says why and
  what would make it fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("accelerate")

from hwr_client.core.defaults import PEER_SOCKET_SUFFIX  # noqa: E402
from tests.support.paths import REPO_DIR  # noqa: E402
from tests.support.privdrop import run_python_as  # noqa: E402
from tests.support.real_models import output_of, save_model  # noqa: E402

#: One start in a fresh worker process; prints what the test checks.
_WORKER = r"""
import hashlib, json, sys
from hwr_client.core import digests
hashed = []
real = digests.hash_fd
def counting(fd, path="<fd>"):
    hashed.append(path)
    return real(fd, path)
digests.hash_fd = counting  # the seam every client hash goes through
import torch
import dlo_runtime
from tests.support.real_models import output_of
with dlo_runtime.from_pretrained(sys.argv[1], socket=sys.argv[2], progress=False, device="cpu") as m:
    out = output_of(m.model, "flux").contiguous().view(torch.uint8).numpy().tobytes()
    m.wait_published()  # a miss publishes in the background; the next start must find it
    print(json.dumps({"outcome": str(m.outcome), "hashed": hashed, "notes": m.report.notes, "key": m.key,
                      "materialized": m.report.bytes_materialized, "publish": m.report.publish,
                      "output": hashlib.sha256(out).hexdigest()}))
"""


def start(model: str, socket: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _WORKER, model, socket], capture_output=True, text=True,
                          env=env, timeout=600, cwd=REPO_DIR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def daemon_hashes(d) -> float:
    with d.client() as c:
        from hwr_client.core._proto import hwr_pb2 as pb

        return json.loads(c.call(c.reader.GetStats, pb.GetStatsRequest()).stats_json)["hwr_source_hash_calls_total"]


@pytest.fixture
def model(tmp_path):
    return save_model("flux", str(tmp_path / "flux"))


def test_warm_start_hashes_nothing_in_the_worker(make_daemon_fixture, model):
    from diffusers import FluxTransformer2DModel

    d = make_daemon_fixture()  # no --source-root, no config
    assert "--source-root" not in d.command() and "--config" not in d.command()
    library = digest(output_of(FluxTransformer2DModel.from_pretrained(model, torch_dtype=torch.bfloat16).eval(),
                               "flux"))
    cold = start(model, d.socket)
    assert cold["outcome"] == "CANONICAL_FALLBACK" and cold["publish"]["ok"], cold
    assert cold["hashed"] == [] and cold["notes"] == []  # the daemon vouched and hashed, not the worker
    files = len([n for n in os.listdir(model) if n.endswith((".safetensors", ".json"))]) - 1  # less the index
    assert daemon_hashes(d) >= files
    before = daemon_hashes(d)
    warm = start(model, d.socket)
    assert warm["outcome"] == "LOCAL_HIT" and warm["key"] == cold["key"], warm
    assert warm["hashed"] == [] and warm["notes"] == [] and warm["materialized"] == 0
    assert daemon_hashes(d) == before  # answered from its records
    assert warm["output"] == cold["output"] == library


def test_a_worker_that_cannot_prove_its_uid_hashes_and_says_why(make_daemon_fixture, model):
    d = make_daemon_fixture()
    cold = start(model, d.socket)
    assert cold["outcome"] == "CANONICAL_FALLBACK" and cold["publish"]["ok"], cold
    os.unlink(d.socket + PEER_SOCKET_SUFFIX)  # no credentials handshake from now on
    warm = start(model, d.socket)
    assert warm["outcome"] == "LOCAL_HIT" and warm["key"] == cold["key"]
    shards = sorted(os.path.join(model, n) for n in os.listdir(model)
                    if n.endswith(".safetensors") or n == "config.json")
    assert sorted(warm["hashed"]) == shards
    (note,) = warm["notes"]
    assert "hashed in this worker" in note and "did not prove its uid" in note and PEER_SOCKET_SUFFIX in note


_NOBODY = r"""
import json, os, sys
import hwr_client
from hwr_client.channel import peer_token
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import HwrError
from hwr_client.sources import seen_of
sock, files = os.environ["T_SOCKET"], json.loads(os.environ["T_FILES"])
c = hwr_client.connect(sock)
out = {"uid": os.getuid(), "proven": peer_token(sock) is not None, "sources": {}}
for name, path in files.items():
    try:
        req = pb.ResolveSourcesRequest(paths=[path], seen=[seen_of(path) or pb.FileIdentity()])
        out["sources"][name] = c.call(c.runtime.ResolveSources, req).sources[0].content_id
    except HwrError as exc:
        out["sources"][name] = [type(exc).__name__, str(exc)]
tmpl = {"contract": {"name": "n", "version": 1}, "representation": {"dtype": "bfloat16"},
        "layout": {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
        "producer": {"id": "p", "version": "1"}, "extra": {}}
r = c.call(c.runtime.ResolveLease, pb.ResolveLeaseRequest(identity_json=json.dumps(tmpl), wait=True,
           sources=[pb.NamedSource(name=n, path=p, seen=seen_of(p)) for n, p in files.items()]))
out["lease"] = {"state": r.state, "origins": [s.origin for s in r.sources], "content_ids": [s.content_id for s in r.sources],
                "refused": list(r.refused)}
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching uid needs root")
def test_nobody_gets_no_digest_of_a_root_only_file(make_daemon_fixture):
    user = pwd.getpwnam("nobody")
    base = tempfile.mkdtemp(prefix="hwr-noopt-", dir="/tmp")  # tmp_path's parents are 0700
    try:
        os.chmod(base, 0o755)
        os.mkdir(os.path.join(base, "private"), 0o700)
        files = {"public": os.path.join(base, "public.bin"), "root_only": os.path.join(base, "root-only.bin"),
                 "private": os.path.join(base, "private", "in.bin")}
        for name, path in files.items():
            with open(path, "wb") as f:
                f.write(name.encode() * 100)
            os.chmod(path, 0o600 if name == "root_only" else 0o644)
        # No --source-root, no config: the group only lets nobody reach the
        # sockets (the runtime one and its credentials side socket), as a
        # worker in group "hwr" would.
        d = make_daemon_fixture("--socket-group", "nogroup", start=False)
        os.chmod(os.path.dirname(d.socket), 0o755)
        d.start()
        proc = run_python_as(user.pw_uid, user.pw_gid, _NOBODY, timeout=120, cwd="/",
                             env=dict(os.environ, PYTHONPATH=REPO_DIR, T_SOCKET=d.socket,
                                      T_FILES=json.dumps(files)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert out["uid"] == user.pw_uid and out["proven"]  # the daemon knows this caller is nobody
    assert out["sources"]["public"] == "sha256:" + hashlib.sha256(b"public" * 100).hexdigest()
    assert out["sources"]["root_only"][0] == "PermissionDenied"
    assert f"uid {user.pw_uid} may not read" in out["sources"]["root_only"][1]
    assert out["sources"]["private"][0] == "PermissionDenied" and "may not search" in out["sources"]["private"][1]
    lease = out["lease"]
    assert lease["state"] == "incomplete" and lease["origins"][1:] == ["refused", "refused"]
    assert lease["content_ids"][1:] == ["", ""] and lease["origins"][0] in ("hashed", "cache")
    assert f"uid {user.pw_uid} may not read" in lease["refused"][1] and lease["refused"][0] == ""


_OTHER_VIEW = r"""
import json, os, sys
import hwr_client
from hwr_client.start import resolve_start
sock, path = sys.argv[1], sys.argv[2]
c = hwr_client.connect(sock)
(d,) = c.resolve_sources([path])
tmpl = {"contract": {"name": "n", "version": 1}, "representation": {"dtype": "bfloat16"},
        "layout": {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
        "producer": {"id": "p", "version": "1"}, "extra": {}}
res = resolve_start(c, tmpl, [("model.safetensors", path)], mode="preferred")
ident = res.identity_now(timeout=60)
print(json.dumps({"content_id": d.content_id, "origin": d.origin, "identity_source": ident.document["sources"][0],
                  "notes": list(res.notes)}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_a_worker_whose_path_names_another_file_is_not_answered_for_the_daemons(make_daemon_fixture, tmp_path):
    """A worker in its own mount namespace (a container) where the
    checkpoint's path names ANOTHER file than the daemon's: the daemon must
    not answer with its own file's content id (a wrong identity, a wrong
    model); the worker hashes what it sees and says why."""
    daemons_file = tmp_path / "model.safetensors"
    daemons_file.write_bytes(b"the daemon's file " * 100)
    workers_file = tmp_path / "mounted-over.bin"
    workers_file.write_bytes(b"the worker's file " * 100)
    d = make_daemon_fixture()
    env = dict(os.environ, PYTHONPATH=REPO_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = (f"mount --bind {workers_file} {daemons_file} && exec {sys.executable} -c '{_OTHER_VIEW}' "
              f"{d.socket} {daemons_file}")
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO_DIR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    workers = "sha256:" + hashlib.sha256(workers_file.read_bytes()).hexdigest()
    assert out["content_id"] == workers and out["origin"] == "local"
    assert out["identity_source"]["content_id"] == workers
    (note,) = out["notes"]
    assert "sees another file there" in note and "hashed in this worker" in note
