"""ResolveLease against the real daemon started with no options (root and
sockets only: no --source-root, no config): every field validated, a
missing source, a miss, a hit leased with AcquireLease's semantics, a
quarantined artifact, a resolve without a session, refused and pending
sources, and whether any artifact could match."""

from __future__ import annotations

import hashlib
import json
import os

import grpc
import pytest

import hwr_client
from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core._proto import hwr_pb2_grpc as pb_grpc
from hwr_client.core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from hwr_client.core.identity import Identity
from hwr_client.sources import seen_of
from tests.conftest import SAMPLE_IDENTITY, sample_tensors
from tests.support.sources import settle, write

TEMPLATE = {k: v for k, v in SAMPLE_IDENTITY.items() if k != "sources"}


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def files(tmp_path):
    """Two source files, older than the racy window (so they are recorded)."""
    a = write(tmp_path / "ckpt" / "model.safetensors", b"weights " * 1000)
    b = write(tmp_path / "ckpt" / "config.json", b'{"layers": 3}')
    settle(a, b)
    return {"model.safetensors": a, "config.json": b}


def template(**extra) -> dict:
    return dict(TEMPLATE, extra=dict(extra))


def request(tmpl: dict, files: dict, *, session_id: str = "", wait: bool = True, given: dict | None = None):
    given = given or {}
    return pb.ResolveLeaseRequest(
        session_id=session_id, identity_json=json.dumps(tmpl), wait=wait,
        sources=[pb.NamedSource(name=n, content_id=given[n]) if n in given
                 else pb.NamedSource(name=n, path=p, seen=seen_of(p)) for n, p in files.items()])


def identity_of(tmpl: dict, files: dict) -> Identity:
    srcs = []
    for n, p in files.items():
        with open(p, "rb") as f:
            srcs.append({"name": n, "content_id": sha(f.read())})
    return Identity.from_dict(dict(tmpl, sources=srcs))


def call(client, req):
    return client.call(client.runtime.ResolveLease, req)


def stats(client) -> dict:
    return json.loads(client.call(client.reader.GetStats, pb.GetStatsRequest()).stats_json)


def test_every_field_is_validated_before_a_file_is_read(daemon, files):
    path = files["model.safetensors"]
    good = json.dumps(template(t="v"))
    bad = [
        (pb.ResolveLeaseRequest(identity_json=good), InvalidArgument, "expected at least one source"),
        (pb.ResolveLeaseRequest(identity_json=good, sources=[pb.NamedSource(name="m")]), InvalidArgument,
         r"sources\[0\] \('m'\): expected exactly one of path and content_id"),
        (pb.ResolveLeaseRequest(identity_json=good, sources=[pb.NamedSource(name="m", path=path,
                                                                            content_id=sha(b"x"))]),
         InvalidArgument, "exactly one of path and content_id"),
        (pb.ResolveLeaseRequest(identity_json=good, sources=[pb.NamedSource(name="m", path=path + "\x00x")]),
         InvalidArgument, r"sources\[0\].path contains a NUL byte"),
        (pb.ResolveLeaseRequest(identity_json=good, sources=[pb.NamedSource(name="m", path="rel/x.bin")]),
         InvalidArgument, "expected an absolute path"),
        (pb.ResolveLeaseRequest(identity_json=good, sources=[pb.NamedSource(name="m", content_id="md5:1")]),
         InvalidArgument, "content_id: expected 'sha256:<64 lowercase hex>'"),
        (pb.ResolveLeaseRequest(identity_json=good, sources=[pb.NamedSource(name="m", path=path),
                                                             pb.NamedSource(name="m", path=path)]),
         InvalidArgument, "duplicate source name 'm'"),
        (pb.ResolveLeaseRequest(identity_json="{not json", sources=[pb.NamedSource(name="m", path=path)]),
         InvalidArgument, "identity_json is not valid JSON"),
        (pb.ResolveLeaseRequest(identity_json="[1]", sources=[pb.NamedSource(name="m", path=path)]),
         InvalidArgument, "must be a JSON object without \"sources\""),
        (pb.ResolveLeaseRequest(identity_json=json.dumps(dict(SAMPLE_IDENTITY)),
                                sources=[pb.NamedSource(name="m", path=path)]),
         InvalidArgument, "without \"sources\""),
        (pb.ResolveLeaseRequest(identity_json=json.dumps(dict(TEMPLATE, representation={"dtype": "int3"})),
                                sources=[pb.NamedSource(name="m", path=path)]),
         InvalidArgument, "representation.dtype"),
        (pb.ResolveLeaseRequest(identity_json='{"contract": NaN}', sources=[pb.NamedSource(name="m", path=path)]),
         InvalidArgument, "not valid JSON"),
        (pb.ResolveLeaseRequest(identity_json=good, sources=[pb.NamedSource(name=f"f{i}", path=path)
                                                             for i in range(4097)]),
         ResourceExhausted, "4097 sources in one call; the limit is 4096"),
    ]
    with daemon.client() as c:
        for req, cls, message in bad:
            with pytest.raises(cls, match=message):
                call(c, req)
        assert stats(c)["hwr_source_hash_calls_total"] == 0  # nothing was read


def test_a_missing_source_is_not_found(daemon, files, tmp_path):
    gone = dict(files, extra=str(tmp_path / "ckpt" / "absent.bin"))
    with daemon.client() as c:
        with pytest.raises(NotFound, match="absent.bin: no such file"):
            call(c, request(template(t="nf"), gone))


def test_miss_then_hit_leased_with_acquire_lease_semantics(daemon, files):
    tmpl = template(t="hit")
    ident = identity_of(tmpl, files)
    with daemon.client() as c:
        sid = c.session().session_id()
        miss = call(c, request(tmpl, files, session_id=sid))
        assert (miss.state, miss.key, miss.lease_id) == ("miss", ident.key, "")
        assert [d.origin for d in miss.sources] == ["hashed", "hashed"] and list(miss.refused) == ["", ""]
        assert "not in the store" in miss.reason
        c.publish(ident, sample_tensors(seed=3))
        hit = call(c, request(tmpl, files, session_id=sid))
        assert (hit.state, hit.key) == ("hit", ident.key) and hit.lease_id
        assert [d.origin for d in hit.sources] == ["cache", "cache"]
        assert json.loads(hit.manifest_json)["key"] == ident.key and len(hit.blob_paths) >= 1
        leases = c.reader.ListLeases(pb.ListLeasesRequest()).leases
        assert [(l.key, l.pid, l.lease_id_prefix) for l in leases] == [(ident.key, os.getpid(), hit.lease_id[:8])]
        # Released like an AcquireLease grant: by id on the session, once.
        release = pb.ReleaseLeaseRequest(session_id=sid, lease_id=hit.lease_id)
        assert c.call(c.runtime.ReleaseLease, release).released
        assert not c.call(c.runtime.ReleaseLease, release).released
        # A grant the session still holds goes when the session ends.
        again = call(c, request(tmpl, files, session_id=sid))
        assert again.state == "hit" and len(c.reader.ListLeases(pb.ListLeasesRequest()).leases) == 1
    with daemon.client() as c:
        assert _eventually_no_leases(c)
        # Without a session: resolved, nothing leased.
        only = call(c, request(tmpl, files))
        assert (only.state, only.key, only.lease_id, list(only.blob_paths)) == ("hit", ident.key, "", [])
        assert not c.reader.ListLeases(pb.ListLeasesRequest()).leases
        with pytest.raises(FailedPrecondition, match="^session: not open"):
            call(c, request(tmpl, files, session_id="no-such-session"))


def _eventually_no_leases(c, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while c.reader.ListLeases(pb.ListLeasesRequest()).leases:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_quarantined_artifact_is_unusable_not_an_error(daemon, files):
    tmpl = template(t="quarantine")
    ident = identity_of(tmpl, files)
    with daemon.client() as c:
        key = c.publish(ident, sample_tensors(seed=4)).key
        manifest = c.lookup(key)
        with open(os.path.join(daemon.root, "blobs", "sha256", manifest.files[0].blob), "r+b") as f:
            f.seek(manifest.tensors[0].offset)
            f.write(b"\xff\xff\xff\xff")
        assert c.resolve(ident, mode="preferred", verify="fast").outcome == "CANONICAL_FALLBACK"  # quarantines
        reply = call(c, request(tmpl, files, session_id=c.session().session_id()))
        assert (reply.state, reply.key, reply.lease_id) == ("unusable", key, "")
        assert "quarantined" in reply.reason


def test_given_content_ids_pending_hashes_and_candidates(daemon, files):
    tmpl = template(t="pending")
    ident = identity_of(tmpl, files)
    with daemon.client() as c:
        first = call(c, request(tmpl, files, wait=False))
        assert first.state == "incomplete" and first.key == ""
        assert [d.origin for d in first.sources] == ["pending", "pending"] and not first.candidates
        given = {s["name"]: s["content_id"] for s in ident.document["sources"]}
        mixed = call(c, request(tmpl, files, given={"config.json": given["config.json"]}))
        assert mixed.state == "miss" and mixed.key == ident.key
        # The model file: the pending flight joined, or its record once it ended.
        assert mixed.sources[0].origin in ("hashed", "cache") and mixed.sources[1].origin == "given"
        assert stats(c)["hwr_source_hash_calls_total"] == 2  # the pending flights, each file once
        c.publish(ident, sample_tensors(seed=5))
        # Same template and names, another content: an artifact could match.
        other = dict(files, **{"config.json": write(os.path.dirname(files["config.json"]) + "/c2.json", b"{}")})
        pending = call(c, request(tmpl, other, wait=False))
        assert pending.state == "incomplete" and pending.candidates
        assert not call(c, request(template(t="another"), other, wait=False)).candidates


def test_an_unproven_caller_gets_refusals_not_an_error(daemon, files):
    """Raw gRPC sends no peer token: a daemon without source roots vouches
    for nothing to it, and says so per source."""
    tmpl = template(t="anon")
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        reply = pb_grpc.RuntimeStub(ch).ResolveLease(request(tmpl, files), timeout=30)
    assert reply.state == "incomplete" and reply.key == ""
    assert [d.origin for d in reply.sources] == ["refused", "refused"]
    assert all("proved none" in r for r in reply.refused)
    with hwr_client.connect(daemon.socket) as c:
        assert stats(c)["hwr_source_hash_calls_total"] == 0


def test_a_source_the_caller_sees_otherwise_is_refused(daemon, files):
    """A caller whose path names another file (its own mount namespace)
    gets a refusal for it, never the daemon's file's content id; one that
    says nothing about the file is refused by a daemon without roots."""
    tmpl = template(t="seen")
    model = files["model.safetensors"]
    req = request(tmpl, files)
    req.sources[1].seen.CopyFrom(seen_of(model))  # config.json's path, the model file's identity
    req.sources[0].ClearField("seen")
    with daemon.client() as c:
        reply = call(c, req)
    assert reply.state == "incomplete" and [d.origin for d in reply.sources] == ["refused", "refused"]
    assert "did not say which file it sees" in reply.refused[0]
    assert "sees another file there" in reply.refused[1]


def test_resolve_sources_takes_the_callers_view_too(daemon, files):
    """ResolveSources, the older call: a daemon without roots answers a
    proven caller that says which file it sees; the count must match."""
    paths = list(files.values())
    with daemon.client() as c:
        with pytest.raises(InvalidArgument, match="1 seen entries for 2 paths"):
            c.call(c.runtime.ResolveSources, pb.ResolveSourcesRequest(paths=paths, seen=[seen_of(paths[0])]))
        with pytest.raises(PermissionDenied, match="did not say which file it sees"):
            c.call(c.runtime.ResolveSources, pb.ResolveSourcesRequest(paths=paths))
        got = c.resolve_sources(paths)  # the client sends what it sees
    assert [d.origin for d in got] == ["hashed", "hashed"]
    assert [d.content_id for d in got] == [s["content_id"] for s in sorted(
        identity_of(template(), files).document["sources"], key=lambda s: list(files).index(s["name"]))]


def test_undecodable_request_is_invalid_argument(daemon):
    """identity_json (field 2) holding bytes that are not UTF-8."""
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        call_raw = ch.unary_unary("/hwr.v1.Runtime/ResolveLease")
        with pytest.raises(grpc.RpcError) as err:
            call_raw(b"\x12\x02\xff\xfe", timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("ResolveLease:") and "UTF-8" in err.value.details()


def _thread_nice(pid: int, prefix: str) -> dict[str, int]:
    """comm -> nice of the daemon's threads whose name starts with ``prefix``
    (/proc/<pid>/task/<tid>/stat field 19)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        if comm.startswith(prefix):
            out[f"{comm}/{tid}"] = int(fields[16])  # field 19 of stat: the 17th after the name
    return out


def test_hashes_nobody_waits_for_run_niced(daemon, files, tmp_path):
    """A certain miss's source hashes (wait=False: the worker loads
    canonically meanwhile) run on threads niced by publication_nice; a
    caller that waits gets the daemon's own priority."""
    with daemon.client() as c:
        first = call(c, request(template(t="niced"), files, wait=False))
        assert first.state == "incomplete"
        call(c, request(template(t="niced"), files))  # joins the flights: they have run
        background = _thread_nice(daemon.proc.pid, "hwr-src-hash-bg")
        assert background and set(background.values()) == {10}, background
        fresh = {"model.safetensors": write(tmp_path / "w" / "m.safetensors", b"other " * 500),
                 "config.json": write(tmp_path / "w" / "c.json", b"{}")}
        settle(*fresh.values())
        assert call(c, request(template(t="waited"), fresh)).state == "miss"
        waited = {k: v for k, v in _thread_nice(daemon.proc.pid, "hwr-src-hash").items() if k not in background}
        assert waited and set(waited.values()) == {0}, waited
