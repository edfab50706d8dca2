"""The trust model for publication (docs/trust.md): every artifact records
who published it, and a worker takes only artifacts of its own uid, root,
the daemon's uid or a trusted publisher. Real daemons; the attacker is a
child process running as ``nobody``."""

from __future__ import annotations

import json
import os
import pwd

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import UntrustedPublisher
from hwr_server.access.peers import Peer
from hwr_server.access.publisher import UNRECORDED, Publisher, parse, published_by, pulled
from hwr_server.access.trust import TrustPolicy, resolve_publishers
from tests.conftest import identity, sample_tensors
from tests.support.trust import NOBODY, open_to_nobody, publish_as_nobody
PLANTED = identity(t="planted")
OTHER = identity(t="planted-2")

def _served(make_daemon_fixture, tmp_path, name: str, toml: str = ""):
    """A daemon as root whose runtime socket nobody reaches through its
    group (as a worker in group "hwr" would)."""
    extra = ["--socket-group", "nogroup"]
    if toml:
        conf = tmp_path / f"{name}.toml"
        conf.write_text(toml)
        extra += ["--config", str(conf)]
    d = make_daemon_fixture(*extra, root=str(tmp_path / f"root-{name}"), start=False)
    open_to_nobody(d)
    return d.start()


def test_nobody_publishes_a_key_and_roots_required_worker_refuses_it(make_daemon_fixture, tmp_path):
    d = _served(make_daemon_fixture, tmp_path, "plain")
    out = publish_as_nobody(d, PLANTED)
    key = out["keys"][0]
    # nobody may use its own artifact, and is told who published it.
    assert out["own"].startswith(f"uid {NOBODY.pw_uid} (pid ")
    # The record is the daemon's, next to the manifest, from the peer credentials.
    with open(os.path.join(d.root, "artifacts", key, "publisher.json"), "rb") as f:
        record = parse(f.read(), what="test")
    assert (record.via, record.uid) == ("publish", NOBODY.pw_uid) and record.pid and record.id
    with d.client() as c:
        required = c.resolve(PLANTED, mode="required")
        assert required.outcome == "FAILED" and required.lease is None
        assert isinstance(required.error, UntrustedPublisher)
        assert f"published by uid {NOBODY.pw_uid}" in str(required.error) and "uid 0" in str(required.error)
        preferred = c.resolve(PLANTED, mode="preferred")
        assert preferred.outcome == "CANONICAL_FALLBACK" and f"uid {NOBODY.pw_uid}" in preferred.reason
        with pytest.raises(UntrustedPublisher):
            c.call(c.runtime.Lookup, pb.LookupRequest(key=key))
        # The operator still sees it, with its publisher.
        row = c.call(c.reader.InspectArtifact, pb.InspectArtifactRequest(key=key)).summary
        assert row.publisher.uid == NOBODY.pw_uid and row.publisher.uid_known and row.publisher.via == "publish"
    listed = json.loads(d.cli("ls", "--json", check=True).stdout)
    assert [r["publisher"] for r in listed if r["key"] == key][0].startswith(f"uid {NOBODY.pw_uid}")
    # The record outlives a restart (recovery reads it back).
    d.restart()
    with d.client() as c:
        assert c.resolve(PLANTED, mode="required").outcome == "FAILED"
        # Root's own artifacts are root's: a hit, and the report says so.
        own = identity(t="root-own")
        c.publish(own, sample_tensors(blocks=2))
        hit = c.resolve(own, mode="required")
        assert hit.outcome == "LOCAL_HIT" and hit.publisher.startswith("uid 0 (pid ")
        hit.lease.close()
    # Removing the planted artifact and publishing it as root makes it usable.
    d.cli("rm", key, check=True)
    with d.client() as c:
        c.publish(PLANTED, sample_tensors(blocks=2))
        hit = c.resolve(PLANTED, mode="required")
        assert hit.outcome == "LOCAL_HIT" and float(hit.lease.tensors()["blocks.0.norm.weight"][0]) != 666.0
        hit.lease.close()


def test_trusted_publishers_and_unrecorded_artifacts(make_daemon_fixture, tmp_path):
    d = _served(make_daemon_fixture, tmp_path, "trusting", 'trusted_publishers = ["nobody"]\n')
    key = publish_as_nobody(d, PLANTED)["keys"][0]
    with d.client() as c:
        hit = c.resolve(PLANTED, mode="required")
        assert hit.outcome == "LOCAL_HIT" and hit.publisher.startswith(f"uid {NOBODY.pw_uid}")
        hit.lease.close()
    # An artifact without a record (published before records existed):
    # nobody takes it by default, ...
    d.stop()
    os.unlink(os.path.join(d.root, "artifacts", key, "publisher.json"))
    d.start()
    with d.client() as c:
        failed = c.resolve(PLANTED, mode="required")
        assert failed.outcome == "FAILED" and "unrecorded" in str(failed.error)
    # ... unless the operator says so.
    d.stop()
    conf = tmp_path / "unrecorded.toml"
    conf.write_text("trust_unrecorded_publishers = true\n")
    d.extra_args += ["--config", str(conf)]
    d.start()
    with d.client() as c:
        hit = c.resolve(PLANTED, mode="required")
        assert hit.outcome == "LOCAL_HIT" and "unrecorded" in hit.publisher
        hit.lease.close()


def test_an_unknown_trusted_publisher_refuses_to_start(make_daemon_fixture, tmp_path):
    conf = tmp_path / "typo.toml"
    conf.write_text('trusted_publishers = ["no-such-user-hwr"]\n')
    d = make_daemon_fixture("--config", str(conf), start=False)
    d.start(wait=False)
    assert d.proc.wait(60) != 0
    assert "no user 'no-such-user-hwr'" in d.log()


# -- the policy itself ---------------------------------------------------------


def _pub(uid, via="publish", signer=""):
    return Publisher(via, uid, 7, "python3", 1, "id", "reg/repo@sha256:x" if via == "pull" else "", signer)


def test_policy_trusts_own_root_daemon_and_configured_uids_only():
    policy = TrustPolicy(trusted_uids=frozenset({1001}), daemon_uid=999)
    for publisher in (0, 999, 1001):
        assert policy.trusts(4242, _pub(publisher)) and policy.trusts(None, _pub(publisher))
        assert policy.node_trusts(_pub(publisher))
    assert policy.trusts(4242, _pub(4242)) and not policy.node_trusts(_pub(4242))
    assert not policy.trusts(4243, _pub(4242)) and not policy.trusts(None, _pub(4242))
    # An anonymous publisher (no peer credentials) is nobody's own.
    assert not policy.trusts(None, _pub(None)) and not policy.trusts(4242, _pub(None))
    assert not policy.trusts(0, UNRECORDED)
    assert TrustPolicy(trust_unrecorded=True).trusts(4242, UNRECORDED)
    with pytest.raises(UntrustedPublisher, match=r"published by uid 4242 \(pid 7, python3\), which uid 5"):
        policy.check(Peer(1, 5), "ab" * 32, _pub(4242))
    with pytest.raises(UntrustedPublisher, match="only trusted publishers' artifacts are pushed"):
        policy.check_push("ab" * 32, _pub(4242))


def test_policy_applies_the_signature_rule_to_pulls_at_every_use():
    unsigned, signed = _pub(0, "pull"), _pub(0, "pull", signer="SHA256:k1")
    assert TrustPolicy().trusts(4242, unsigned)  # no trusted_keys: the registry is trusted
    keyed = TrustPolicy(trusted_keys=frozenset({"SHA256:k1"}))
    assert keyed.trusts(4242, signed) and not keyed.trusts(0, unsigned)
    # A key removed from trusted_keys stops vouching for what it signed.
    assert not TrustPolicy(trusted_keys=frozenset({"SHA256:k2"})).trusts(0, signed)


def test_records_round_trip_and_bad_records_are_refused():
    for record in (published_by(Peer(12, 34), "pub1"), published_by(Peer(), "pub2"),
                   pulled("pull-1", source="h/r@sha256:ab", signer="SHA256:x")):
        assert parse(record.to_json(), what="t") == record
    assert pulled("p", source="s", signer="").uid == os.geteuid()
    good = json.loads(published_by(Peer(12, 34), "pub1").to_json())
    for field, bad in (("uid", -1), ("uid", "0"), ("via", "forged"), ("program", "a\x00b"), ("format", "x"),
                       ("unix", None)):
        with pytest.raises(ValueError):
            parse(json.dumps({**good, field: bad}).encode(), what="t")


def test_trusted_publishers_resolve_users_and_groups():
    root_group = pwd.getpwuid(0).pw_gid
    uids = resolve_publishers(["nobody", "0", f"group:{root_group}"])
    assert {NOBODY.pw_uid, 0} <= uids
    with pytest.raises(Exception, match="no group"):
        resolve_publishers(["group:no-such-group-hwr"])
