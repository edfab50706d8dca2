"""hwr_client.start.resolve_start against the real daemon started with no
options: a warm start is ONE rpc and hashes nothing in the worker; a
client that cannot prove its uid hashes and says why; a certain miss is
answered at once and its identity completed while the caller loads; no
daemon; the mode rules."""

from __future__ import annotations

import hashlib
import os

import pytest

import hwr_client
from hwr_client.channel import forget_peer_token
from hwr_client.core import digests
from hwr_client.core.defaults import PEER_SOCKET_SUFFIX
from hwr_client.core.errors import InvalidArgument, NotFound, Unavailable
from hwr_client.core.identity import Identity
from hwr_client.start import resolve_start
from tests.conftest import SAMPLE_IDENTITY, sample_tensors
from tests.support.sources import settle, write

TEMPLATE = {k: v for k, v in SAMPLE_IDENTITY.items() if k != "sources"}


@pytest.fixture
def sources(tmp_path):
    a = write(tmp_path / "ckpt" / "model.safetensors", os.urandom(1 << 16))
    b = write(tmp_path / "ckpt" / "config.json", b'{"layers": 3}')
    settle(a, b)
    return [("config.json", b), ("model.safetensors", a)]


@pytest.fixture
def hashed(monkeypatch):
    """Counts the files this process hashes: every client hash goes through
    hwr_client.core.digests.hash_fd (hash_file, hash_locally)."""
    calls: list[str] = []
    real = digests.hash_fd

    def counting(fd, path="<fd>"):
        calls.append(path)
        return real(fd, path)

    monkeypatch.setattr(digests, "hash_fd", counting)
    return calls


def identity_of(tmpl, sources) -> Identity:
    srcs = []
    for name, path in sources:
        with open(path, "rb") as f:
            srcs.append({"name": name, "content_id": "sha256:" + hashlib.sha256(f.read()).hexdigest()})
    return Identity.from_dict(dict(tmpl, sources=srcs))


class Calls:
    """Records the unary rpcs a client makes through its one call seam (its
    own channel or its session's), by request type."""

    def __init__(self, client):
        self.names: list[str] = []
        real = client.call

        def call(method, request, **kw):
            self.names.append(type(request).__name__.removesuffix("Request"))
            return real(method, request, **kw)

        client.call = call


def test_warm_start_is_one_rpc_and_hashes_nothing(daemon, sources, hashed):
    tmpl = dict(TEMPLATE, extra={"t": "warm"})
    with daemon.client() as c:  # the first start: the daemon hashes the files new to it
        cold = resolve_start(c, tmpl, sources, mode="preferred")
        assert cold.outcome == "CANONICAL_FALLBACK"
        c.publish(cold.identity_now(timeout=60), sample_tensors(seed=1))
    with daemon.client() as c:  # a fresh client: its own session
        calls = Calls(c)
        res = resolve_start(c, tmpl, sources, mode="required")
        assert res.outcome == "LOCAL_HIT" and res.key == identity_of(tmpl, sources).key
        assert res.identity.key == res.key and res.notes == ()
        assert calls.names == ["ResolveLease"]
        assert res.lease.tensors().keys() == sample_tensors(seed=1).keys()
        res.lease.close()
    assert hashed == []


def test_a_certain_miss_loads_at_once_and_the_identity_follows(daemon, sources, hashed):
    tmpl = dict(TEMPLATE, extra={"t": "cold"})
    with daemon.client() as c:
        calls = Calls(c)
        res = resolve_start(c, tmpl, sources, mode="preferred")
        assert res.outcome == "CANONICAL_FALLBACK" and res.lease is None and res.deferred is not None
        assert "certainly a miss" in res.reason
        assert calls.names == ["ResolveLease"]  # answered at once
    # The start's client is closed (its model closed) while the daemon
    # hashes: the identity still completes, joining the hashes on a
    # connection of its own, as the background publication needs.
    assert res.identity_now(timeout=60).key == identity_of(tmpl, sources).key
    with daemon.client() as c:
        # Required never loads canonically: it waits for the hashes and fails saying how to populate.
        res = resolve_start(c, dict(tmpl, extra={"t": "cold-required"}), sources, mode="required")
        assert res.outcome == "FAILED" and isinstance(res.error, NotFound) and "prewarm" in str(res.error)
    assert hashed == []  # the daemon hashed, on its threads


def test_an_unproven_client_hashes_and_says_why(daemon, sources, hashed):
    tmpl = dict(TEMPLATE, extra={"t": "anon"})
    with daemon.client() as c:
        c.publish(identity_of(tmpl, sources), sample_tensors(seed=2))
    # The credentials socket gone: this process cannot prove its uid (the
    # token it holds from the publication above is dropped).
    os.unlink(daemon.socket + PEER_SOCKET_SUFFIX)
    forget_peer_token(daemon.socket)
    with hwr_client.connect(daemon.socket) as c:
        res = resolve_start(c, tmpl, sources, mode="preferred")
        assert res.outcome == "LOCAL_HIT"  # an artifact could match: hashed first, then leased
        assert sorted(hashed) == sorted(p for _, p in sources)
        (note,) = res.notes
        assert "2 of 2 source file(s) hashed in this worker" in note
        assert "did not prove its uid" in note and PEER_SOCKET_SUFFIX in note and "proved none" in note
        res.lease.close()


def test_no_daemon(tmp_path, sources, hashed):
    tmpl = dict(TEMPLATE, extra={"t": "nodaemon"})
    with hwr_client.connect(str(tmp_path / "absent.sock")) as c:
        res = resolve_start(c, tmpl, sources, mode="preferred")
        assert res.outcome == "CANONICAL_FALLBACK" and isinstance(res.error, Unavailable)
        assert res.identity_now(timeout=60).key == identity_of(tmpl, sources).key  # hashed here, meanwhile
        assert "is hashed in this worker" not in res.notes[0] and "`hwr serve` running" in res.notes[0]
        res = resolve_start(c, tmpl, sources, mode="required")
        assert res.outcome == "FAILED" and isinstance(res.error, Unavailable) and "hwr serve" in str(res.error)
    assert len(hashed) == 2


def test_bad_input_fails_before_any_call(daemon, sources):
    with daemon.client() as c:
        calls = Calls(c)
        for tmpl, srcs in ((dict(TEMPLATE, representation={"dtype": "int3"}), sources),
                           (dict(TEMPLATE, sources=[]), sources),
                           (TEMPLATE, [("a", sources[0][1]), ("a", sources[1][1])])):
            for mode in ("preferred", "required"):
                res = resolve_start(c, tmpl, srcs, mode=mode)
                assert res.outcome == "FAILED" and isinstance(res.error, InvalidArgument)
        assert resolve_start(c, TEMPLATE, sources, mode="disabled").reason == "HWR disabled"
        with pytest.raises(InvalidArgument):
            resolve_start(c, TEMPLATE, sources, mode="sometimes")
        assert calls.names == []
