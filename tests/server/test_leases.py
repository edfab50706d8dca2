"""LeaseManager in-process: sessions, leases, persistence, grace, reaper.

The store is a fake at its one seam (``store.get``): these tests exercise
the lease bookkeeping; tests/server/test_leases_daemon.py runs the same behaviour
through the real daemon.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from hwr_client.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from hwr_server.config import ServerConfig
from hwr_server.leases.manager import ATTACHED, AWAITING, LeaseManager

KEY_A = "a" * 64
KEY_B = "b" * 64
KEY_Q = "c" * 64


@dataclasses.dataclass
class _FakeManifest:
    """Stands in for hwr_client.core.manifest.Manifest at the store seam."""

    key: str
    to_json_calls: int = 0

    def to_json(self) -> str:
        self.to_json_calls += 1
        return '{"key": "%s"}' % self.key


class FakeStore:
    """The seam: ``get(key)`` as the real Store answers it."""

    def __init__(self):
        self.manifests = {KEY_A: _FakeManifest(KEY_A), KEY_B: _FakeManifest(KEY_B)}

    def contains(self, key):
        return key in self.manifests

    def get(self, key):
        if key == KEY_Q:
            raise FailedPrecondition(f"artifact {key[:12]}: quarantined")
        if key not in self.manifests:
            raise NotFound(f"artifact {key[:12]}: not published")
        return self.manifests[key], [f"/blobs/{key}"]


def make(tmp_path, **cfg) -> LeaseManager:
    config = ServerConfig(root=str(tmp_path), **cfg)
    return LeaseManager(config, FakeStore())


def test_acquire_release_and_queries(tmp_path):
    m = make(tmp_path)
    s = m.open_session(123, "w0")
    g = m.acquire(s.session_id, KEY_A)
    assert len(g.lease_id) >= 32 and g.blob_paths == (f"/blobs/{KEY_A}",)
    assert m.pinned_keys() == {KEY_A}
    [h] = m.holders(KEY_A)
    assert (h.pid, h.client_name, h.state, h.lease_id_prefix) == (123, "w0", ATTACHED, g.lease_id[:8])
    assert m.last_leased(KEY_A) > 0 and m.last_leased(KEY_B) == 0
    assert m.stats()["hwr_leases_active"] == 1 and m.stats()["hwr_sessions_active"] == 1
    assert m.release(s.session_id, g.lease_id) is True
    assert m.release(s.session_id, g.lease_id) is False  # double release
    assert m.pinned_keys() == set() and m.holders(KEY_A) == []


def test_errors(tmp_path):
    m = make(tmp_path)
    s = m.open_session(1, "")
    with pytest.raises(NotFound):
        m.acquire(s.session_id, "d" * 64)
    with pytest.raises(FailedPrecondition, match="quarantined"):
        m.acquire(s.session_id, KEY_Q)
    with pytest.raises(InvalidArgument):
        m.acquire(s.session_id, "not-a-key")
    with pytest.raises(FailedPrecondition, match="session"):
        m.acquire("forged-session", KEY_A)
    assert m.stats()["hwr_leases_active"] == 0


def test_foreign_and_garbage_ids_change_nothing(tmp_path):
    m = make(tmp_path)
    s1, s2 = m.open_session(1, "a"), m.open_session(2, "b")
    g = m.acquire(s1.session_id, KEY_A)
    for sid, lid in [(s2.session_id, g.lease_id), (s1.session_id, "garbage"), (s1.session_id, ""),
                     ("nope", g.lease_id), (s1.session_id, "\udcff" * 3)]:
        assert m.release(sid, lid) is False
    assert [h.pid for h in m.holders(KEY_A)] == [1]


def test_session_end_releases(tmp_path):
    m = make(tmp_path)
    s = m.open_session(1, "")
    m.acquire(s.session_id, KEY_A)
    m.acquire(s.session_id, KEY_B)
    assert m.end_session(s.session_id) == 2
    assert m.end_session(s.session_id) == 0
    assert m.pinned_keys() == set()
    assert m.stats()["hwr_sessions_active"] == 0


def test_keepalive_timeout_reaps(tmp_path):
    m = make(tmp_path, keepalive_interval_ms=100, keepalive_timeout_ms=300)
    expired = []
    s = m.open_session(1, "", on_expire=lambda: expired.append(1))
    m.acquire(s.session_id, KEY_A)
    base = m._sessions[s.session_id].last_seen
    assert m.reap(now=base + 0.2) == (0, 0)
    assert m.keepalive(s.session_id)
    base = m._sessions[s.session_id].last_seen
    assert m.reap(now=base + 0.31) == (1, 0)
    assert expired == [1] and m.pinned_keys() == set()
    assert not m.keepalive(s.session_id)


def test_restart_keeps_records_for_reattach(tmp_path):
    m = make(tmp_path, lease_grace_s=60)
    s = m.open_session(7, "w")
    g1, _g2 = m.acquire(s.session_id, KEY_A), m.acquire(s.session_id, KEY_B)
    m.begin_shutdown()  # a graceful stop must not release
    m.end_session(s.session_id)
    m.stop()
    m2 = make(tmp_path, lease_grace_s=60)
    assert m2.pinned_keys() == {KEY_A, KEY_B}
    assert {h.state for h in m2.list()} == {AWAITING}
    assert m2.in_grace()
    s2 = m2.open_session(7, "w", reattach_ids=[g1.lease_id, "lost-one"])
    assert s2.reattached == (g1.lease_id,) and s2.lost == ("lost-one",)
    assert m2.release(s2.session_id, g1.lease_id)
    # The other one expires at the end of the grace period.
    assert m2.reap(now=m2._grace_deadline + 1)[1] == 1
    assert m2.pinned_keys() == set() and not m2.in_grace()
    assert m2.last_leased(KEY_B) > 0  # usage survives restarts
    m2.stop()
    assert make(tmp_path).list() == []


def test_reattach_cannot_steal_attached_lease(tmp_path):
    m = make(tmp_path)
    s1 = m.open_session(1, "")
    g = m.acquire(s1.session_id, KEY_A)
    s2 = m.open_session(2, "", reattach_ids=[g.lease_id])
    assert s2.lost == (g.lease_id,)
    assert [h.pid for h in m.holders(KEY_A)] == [1]


def test_database_holds_no_lease_secret(tmp_path):
    m = make(tmp_path)
    s = m.open_session(1, "")
    g = m.acquire(s.session_id, KEY_A)
    m.stop()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("index.sqlite*"))
    assert g.lease_id[:8].encode() in raw  # the shown prefix is stored ...
    assert g.lease_id.encode() not in raw and s.session_id.encode() not in raw  # ... the secret is not


def test_manifest_serialized_once(tmp_path):
    m = make(tmp_path)
    s = m.open_session(1, "")
    for _ in range(5):
        m.acquire(s.session_id, KEY_A)
    assert m.store.manifests[KEY_A].to_json_calls == 1


def test_threads_count_matches(tmp_path):
    m = make(tmp_path)
    sessions = [m.open_session(i, "") for i in range(4)]
    held: list[list[str]] = [[] for _ in range(40)]

    def worker(i: int) -> None:
        sid = sessions[i % 4].session_id
        for n in range(50):
            held[i].append(m.acquire(sid, KEY_A if n % 2 else KEY_B).lease_id)
            if n % 3:
                assert m.release(sid, held[i].pop(0))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.stats()["hwr_leases_active"] == sum(len(h) for h in held)
    assert len(m.list()) == sum(len(h) for h in held)


def test_artifact_deleted_during_grant_is_not_granted(tmp_path):
    m = make(tmp_path)
    s = m.open_session(1, "")
    store = m.store
    real_get = store.get

    def get_then_deleted(key):  # a GC unlinks right after our store.get
        out = real_get(key)
        del store.manifests[key]
        return out

    store.get = get_then_deleted
    with pytest.raises(NotFound, match="deleted while"):
        m.acquire(s.session_id, KEY_A)
    assert m.list() == [] and m.stats()["hwr_leases_active"] == 0


def test_session_cap_leaves_threads_for_calls(tmp_path):
    m = make(tmp_path, grpc_threads=16)
    assert m.max_sessions == 12
    sessions = [m.open_session(i, "") for i in range(12)]
    with pytest.raises(ResourceExhausted, match="grpc_threads"):
        m.open_session(99, "")
    m.end_session(sessions[0].session_id)
    m.open_session(100, "")  # a slot freed


def test_index_write_failure_grants_nothing(tmp_path):
    m = make(tmp_path)
    s = m.open_session(1, "")
    m._db.execute("DROP TABLE leases")  # the seam: the index refuses the write
    with pytest.raises(Unavailable, match="nothing was granted"):
        m.acquire(s.session_id, KEY_A)
    assert m.list() == [] and m.pinned_keys() == set()
