"""PullOnMiss, a runtime rpc any user of the socket may call, against a
registry that hangs: each call is admitted like a client stream (the
caller's ``max_streams_per_peer``), pulls in flight are bounded per user
and per node, a cancelled call leaves no thread behind, another user's
Lookup is answered meanwhile, and a recent failure is answered from memory
instead of asking the registry again. PullGate's rules on their own, with a
fake clock."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import Counter

import pytest

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.errors import NotFound, ResourceExhausted, Unavailable
from tests.support.hostile_pull import (  # noqa: F401 - fixtures, used by name
    REPO, hostile, node_for, pull_on_miss, pull_on_miss_calls, threads,
)

CALLS = 200


def test_cancelled_calls_against_a_hung_registry_leave_no_threads(make_daemon_fixture, tmp_path, hostile):
    """200 calls of distinct keys, each given up after 1 s, while the
    registry answers nothing: the landed daemon kept a thread per call
    (waiting on the hung pull); now at most ``max_pulls_per_peer`` pulls
    run and the rest are refused at once."""
    hostile.hang = threading.Event()
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, pull_on_miss=True, extra={"timeout_s": 60.0})
    pull_on_miss_calls(node, [secrets.token_hex(32) for _ in range(64)], timeout=0.2)  # every server thread made once
    before = threads(node)
    codes = pull_on_miss_calls(node, [secrets.token_hex(32) for _ in range(CALLS)], timeout=1.0)
    assert sum(codes.values()) == CALLS, codes
    grew = threads(node) - before
    assert grew < 16, (before, grew, codes)
    assert codes["RESOURCE_EXHAUSTED"] >= CALLS - 10, codes
    in_flight = sum(1 for h in hostile.take() if "/manifests/" in h.path)
    assert in_flight <= 4, in_flight  # the registry was asked once per admitted pull, not per call


def test_another_users_lookup_is_served_while_64_calls_wait(make_daemon_fixture, tmp_path, hostile):
    """64 PullOnMiss calls held against the hung registry (the landed daemon
    gave each a server thread, all 64 of them): a Lookup from another
    client is answered; the calls over the caller's stream cap are refused
    naming max_streams_per_peer."""
    hostile.hang = threading.Event()
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, pull_on_miss=True, extra={"timeout_s": 60.0})
    codes: Counter = Counter()
    holder = threading.Thread(target=pull_on_miss_calls, args=(node, [secrets.token_hex(32) for _ in range(64)], 20.0, 64, codes))
    holder.start()
    try:
        for _ in range(600):  # until every call is held at the registry or answered
            if hostile.waiting + sum(codes.values()) >= 64:
                break
            time.sleep(0.05)
        with node.client() as c:
            for _ in range(5):
                with pytest.raises(NotFound):  # answered, not DEADLINE_EXCEEDED (the calls hold for 20 s)
                    c.call(c.runtime.Lookup, pb.LookupRequest(key=secrets.token_hex(32)), timeout=10)
    finally:
        hostile.hang.set()
        holder.join(120)
    assert codes["RESOURCE_EXHAUSTED"] >= 64 - 8, codes
    assert "max_streams_per_peer" in node.log() or "max_pulls_per_peer" in node.log()


def test_a_recent_miss_is_answered_from_memory(make_daemon_fixture, tmp_path, hostile):
    node = node_for(make_daemon_fixture, tmp_path, hostile.host, pull_on_miss=True)
    key = secrets.token_hex(32)
    with pytest.raises(NotFound, match="no such manifest"):
        pull_on_miss(node, key)
    with pytest.raises(NotFound, match="remembered from"):
        pull_on_miss(node, key)
    assert sum(1 for h in hostile.take() if "/manifests/" in h.path) == 1
    with node.client() as c:
        stats = json.loads(c.call(c.reader.GetStats, pb.GetStatsRequest()).stats_json)
    assert stats["hwr_remote_pulls_on_miss_cached_total"] == 1


# -- PullGate on its own ----------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pull_gate_bounds_and_memory():
    from hwr_server.remote.gate import MAX_CACHED, PullGate  # here: the daemon tests above run on any tree

    clock = _Clock()
    gate = PullGate(max_pulls=3, max_per_peer=2, miss_cache_s=30, clock=clock)
    gate.enter("uid 1", "a")
    gate.enter("uid 1", "b")
    with pytest.raises(ResourceExhausted, match="max_pulls_per_peer"):
        gate.enter("uid 1", "c")
    gate.enter("uid 2", "c")
    with pytest.raises(ResourceExhausted, match=r"max_pulls\)"):
        gate.enter("uid 3", "d")  # the node's bound, though uid 3 has none
    gate.leave("uid 1", "a", NotFound("a: the registry has no such manifest"))
    gate.enter("uid 3", "d")
    with pytest.raises(NotFound, match="no such manifest.*remembered from 0 s ago"):
        gate.cached("a")
    clock.now = 30.0
    gate.cached("a")  # forgotten after miss_cache_s
    gate.leave("uid 1", "b", RuntimeError("not an HWR error"))  # not remembered
    gate.cached("b")
    assert gate.in_flight() == 2
    wide = PullGate(max_pulls=1, max_per_peer=1, miss_cache_s=30, clock=clock)
    for i in range(MAX_CACHED + 10):  # random keys cannot grow the memory past MAX_CACHED
        wide.enter("uid 9", f"k{i}")
        wide.leave("uid 9", f"k{i}", Unavailable("down"))
    with pytest.raises(Unavailable):
        wide.cached(f"k{MAX_CACHED + 9}")
    with pytest.raises(Unavailable):
        wide.cached("k10")
    for i in range(10):
        wide.cached(f"k{i}")  # the oldest went first
