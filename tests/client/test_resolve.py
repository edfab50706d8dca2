"""resolve() modes and outcomes (DESIGN §8) and publish_after_load, against
the real daemon (and against no daemon at all)."""

from __future__ import annotations

import os

import pytest
import torch

import hwr_client
from hwr_client.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from hwr_client.resolve import Mode, Outcome, parse_mode, publish_after_load, resolve
from tests.conftest import identity, sample_tensors


class RecordingClient(hwr_client.Client):
    """A real Client that records every attribute used to reach the daemon
    (the seam that proves 'disabled never touches HWR')."""

    touched: list[str]

    def __getattribute__(self, name):
        if name in ("call", "runtime", "reader", "admin", "channel", "_session"):
            object.__getattribute__(self, "touched").append(name)
        return object.__getattribute__(self, name)


def test_disabled_never_touches_hwr(tmp_path):
    sock_dir = tmp_path / "run" / "hwr"
    client = RecordingClient.__new__(RecordingClient)
    client.touched = []
    client.__init__(str(sock_dir / "hwr.sock"))
    client.touched.clear()
    for mode in ("disabled", Mode.DISABLED):
        res = resolve(client, {"not": "even an identity"}, mode=mode)
        assert res.outcome == "CANONICAL_FALLBACK" and res.outcome is Outcome.CANONICAL_FALLBACK
        assert res.lease is None and res.key == "" and res.mode is Mode.DISABLED
    assert resolve(None, None, mode="disabled").outcome == "CANONICAL_FALLBACK"
    assert client.touched == []
    assert not (tmp_path / "run").exists()


def test_mode_parsing():
    assert parse_mode("preferred") is Mode.PREFERRED and parse_mode(Mode.REQUIRED) is Mode.REQUIRED
    with pytest.raises(InvalidArgument, match="expected one of"):
        parse_mode("PREFERRED!")
    with pytest.raises(InvalidArgument):
        resolve(None, identity(), mode="sometimes")


def test_hit_in_both_modes(daemon):
    tensors = sample_tensors()
    ident = identity(test="resolve-hit")
    with daemon.client() as c:
        key = c.publish(ident, tensors).key
        for mode in ("preferred", "required"):
            res = c.resolve(ident, mode=mode, verify="fast")
            assert res.outcome == "LOCAL_HIT" and res.hit and res.key == key
            with res.lease as lease:
                assert torch.equal(lease.tensors()["final_norm.weight"], tensors["final_norm.weight"])


def test_miss_preferred_falls_back_then_publish_makes_a_hit(daemon):
    tensors = sample_tensors(seed=3)
    ident = identity(test="resolve-miss")
    with daemon.client() as c:
        res = c.resolve(ident, mode="preferred")
        assert res.outcome == "CANONICAL_FALLBACK" and isinstance(res.error, NotFound) and res.lease is None
        seen = []
        report = c.publish_after_load(ident, tensors, progress=lambda s, t: seen.append((s, t)))
        assert report.ok and report.key == res.key and report.bytes_written > 0 and not report.already_published
        # Progress flows monotonically and ends exactly at the announced total.
        assert seen and all(a[0] <= b[0] for a, b in zip(seen, seen[1:])) and seen[-1][0] == seen[-1][1]
        again = publish_after_load(c, ident, tensors)
        assert again.ok and again.already_published
        hit = c.resolve(ident, mode="required")
        assert hit.outcome == "LOCAL_HIT"
        hit.lease.close()


def test_required_miss_fails_saying_how_to_populate(daemon):
    with daemon.client() as c:
        res = c.resolve(identity(test="required-miss"), mode="required")
    assert res.outcome == "FAILED" and res.lease is None
    assert isinstance(res.error, NotFound)
    assert "hwr prewarm" in str(res.error) and "mode=preferred" in str(res.error)


def test_invalid_identity_fails_in_both_modes(daemon):
    bad = identity(test="x")
    bad["layout"]["dp_rank"] = 0  # unknown field: a configuration error, never a miss
    with daemon.client() as c:
        for mode in ("preferred", "required"):
            res = c.resolve(bad, mode=mode)
            assert res.outcome == "FAILED" and isinstance(res.error, InvalidArgument)
        res = c.resolve(identity(test="y"), mode="preferred", verify="sha1")
        assert res.outcome == "FAILED" and isinstance(res.error, InvalidArgument)


def test_unusable_artifact(daemon):
    tensors = sample_tensors(seed=5)
    ident = identity(test="resolve-corrupt")
    with daemon.client() as c:
        key = c.publish(ident, tensors).key
        manifest = c.lookup(key)
        path = os.path.join(daemon.root, "blobs", "sha256", manifest.files[0].blob)
        with open(path, "r+b") as f:
            f.seek(manifest.tensors[0].offset)
            f.write(b"\xff\xff\xff\xff")
        res = c.resolve(ident, mode="required", verify="fast")
        assert res.outcome == "FAILED" and isinstance(res.error, FailedPrecondition)
        assert "hwr verify" in str(res.error)
        res = c.resolve(ident, mode="preferred")  # now quarantined
        assert res.outcome == "CANONICAL_FALLBACK" and "quarantined" in res.reason


def test_daemon_unreachable(tmp_path):
    with hwr_client.connect(str(tmp_path / "absent.sock")) as c:
        res = c.resolve(identity(test="nodaemon"), mode="preferred")
        assert res.outcome == "CANONICAL_FALLBACK" and isinstance(res.error, Unavailable)
        assert "unreachable" in res.reason
        res = c.resolve(identity(test="nodaemon"), mode=Mode.REQUIRED)
        assert res.outcome == "FAILED" and isinstance(res.error, Unavailable)
        assert "hwr serve" in str(res.error)


def test_publish_after_load_never_raises(tmp_path):
    with hwr_client.connect(str(tmp_path / "absent.sock")) as c:
        report = publish_after_load(c, identity(test="p"), sample_tensors())
        assert not report.ok and report.error.startswith("Unavailable") and report.key
        report = publish_after_load(c, {"bad": 1}, sample_tensors())
        assert not report.ok and report.error.startswith("InvalidArgument") and report.key == ""
        report = publish_after_load(c, identity(test="p"), {"x": "not a tensor"})
        assert not report.ok


def test_progress_callback_failure_does_not_fail_publication(daemon):
    def boom(sent, total):
        raise RuntimeError("callback bug")

    with daemon.client() as c:
        report = publish_after_load(c, identity(test="boom"), sample_tensors(seed=9), progress=boom)
    assert report.ok, report.error
