"""Registration admission on a node shared by two users, against the REAL
daemon: the attacker is a process of uid ``nobody`` using ``hwr_client``
(its credentials handshake names uid 65534); root plays the node's own
workers.

- No rpc holds a daemon thread while it waits for the in-flight slot: the
  landed daemon parked every AdmitRegistration for up to 300 s on a gRPC
  thread, so one process sending a few dozen of them starved every runtime
  call of every user (36 of 41 lookups failed in the red-team run).
- A chunk that is never reported blocks only its own session: the landed
  watchdog refused every worker of the node until it completed.
- One uid holds at most ``registration_uid_share`` of the budget: the landed
  daemon let one client take it all with fake chunk reports.

Assertions are on counts, reasons and config-field names; waits are bounded
generously and never asserted as times.
"""

from __future__ import annotations

import json
from collections import Counter

from hwr_client.registration import RegistrationBroker
from tests.conftest import identity, sample_tensors
from tests.support.hostile_users import REGISTRATION_ATTACKER
from tests.support.registration import poll, stats
from tests.support.shared_node import finish, lookups, popen_nobody, served_to_nobody
from tests.support.streams import readline

MIB = 1024 * 1024


def _attacker(d):
    p = popen_nobody(REGISTRATION_ATTACKER, d.socket)
    hello = readline(p, timeout=60)
    assert hello, f"the attacker did not start: {p.stderr.read() if p.poll() is not None else ''}"
    assert json.loads(hello) == {"uid": 65534}
    return p


def _ask(p, **cmd) -> dict:
    p.stdin.write(json.dumps(cmd) + "\n")
    p.stdin.flush()
    line = readline(p, timeout=60)
    assert line, f"no answer to {cmd}"
    return json.loads(line)


def test_waiting_registrations_hold_no_daemon_thread(make_daemon_fixture, tmp_path):
    # Eight gRPC threads, and a watchdog that never trips during the test:
    # on the landed daemon the flood parks every thread for its 300 s.
    d = served_to_nobody(make_daemon_fixture, tmp_path, {
        "grpc_threads": 8, "registration_budget_bytes": "64MiB", "registration_chunk_bytes": "1MiB",
        "registration_chunk_timeout_s": 600.0, "max_registrations_in_flight": 1})
    with d.client() as c:
        key = c.publish(identity(t="reg-flood"), sample_tensors()).key
    p = _attacker(d)
    try:
        assert _ask(p, op="admit", nbytes=4096)["admitted"]  # the slot, never reported
        assert _ask(p, op="flood", n=16, wait_ms=300_000) == {"fired": 16}
        # Another user's runtime calls are served while the flood is on.
        assert lookups(d, key, 10, timeout=5.0) == ["OK"] * 10
        # Every flooded request was answered at once: queued (at most
        # max_registration_waiters_per_uid of them) or busy; none waits.
        line = readline(p, timeout=30)
        assert line, "the flooded AdmitRegistration calls were not answered (parked on daemon threads)"
        results = Counter(json.loads(line)["results"])
        assert results == Counter({"queued": 4, "busy": 12}), results
        s = stats(d)
        assert s["hwr_registrations_queued"] <= 4
        assert s['hwr_registration_admissions_total{outcome="queued"}'] == 4
    finally:
        finish(p)


def test_a_stalled_registration_blocks_only_its_own_session(make_daemon_fixture, tmp_path):
    d = served_to_nobody(make_daemon_fixture, tmp_path, {
        "registration_budget_bytes": "64MiB", "registration_chunk_bytes": "1MiB",
        "registration_chunk_timeout_s": 1.0, "max_registrations_in_flight": 1})
    p = _attacker(d)
    try:
        # 4 KiB admitted and never reported: the in-flight slot, then a stall.
        assert _ask(p, op="admit", nbytes=4096)["admitted"]
        with d.client() as c:
            broker = RegistrationBroker(c.session(), wait_s=60)
            grant = broker.request(MIB, label="root worker")
            # Queued behind the attacker's slot until the watchdog gives it
            # away; the landed daemon refused it "watchdog".
            assert grant.admitted, (grant.reason, grant.detail)
            s = stats(d)
            assert s["hwr_registration_watchdog_stalled"] == 1
            assert s['hwr_registration_admissions_total{outcome="watchdog"}'] == 0
            # The stalled session itself is refused until its chunk completes.
            again = _ask(p, op="admit", nbytes=4096)
            assert (again["admitted"], again["reason"]) == (False, "watchdog")
            assert "this session's registration" in again["detail"]
            for offset, length in grant.chunks:
                assert broker.chunk_done(grant, length, 0.001)
            assert broker.release(grant)
        assert "its slot goes to the next request" in d.log()
    finally:
        finish(p)


def test_one_user_cannot_take_the_whole_budget(make_daemon_fixture, tmp_path):
    d = served_to_nobody(make_daemon_fixture, tmp_path, {
        "registration_budget_bytes": "8MiB", "registration_chunk_bytes": "1MiB"})
    p = _attacker(d)
    try:
        whole = _ask(p, op="admit", nbytes=8 * MIB)
        assert (whole["admitted"], whole["reason"]) == (False, "budget")
        assert "registration_uid_share" in whole["detail"] and "uid 65534" in whole["detail"]
        half = _ask(p, op="admit", nbytes=4 * MIB)
        assert half["admitted"]
        for _ in range(4):  # fake chunk reports: the daemon cannot tell
            assert _ask(p, op="report", rid=half["rid"], nbytes=MIB) == {"known": True}
        more = _ask(p, op="admit", nbytes=MIB)
        assert (more["admitted"], more["reason"]) == (False, "budget") and "registration_uid_share" in more["detail"]
        s = stats(d)
        assert s['hwr_registration_worker_bytes{session="%s",pid="%d",client="uid 65534"}'
                 % (next(k for k in s if "uid 65534" in k).split('session="')[1][:6], p.pid)] == 4 * MIB
        # The node's own worker (root) finds the rest of the budget.
        with d.client() as c:
            grant = RegistrationBroker(c.session(), wait_s=10).request(4 * MIB, label="root worker")
            assert grant.admitted, (grant.reason, grant.detail)
        poll(d, lambda s: s["hwr_registration_admitted_bytes"] == 4 * MIB, "root's bytes back at its session's end")
    finally:
        finish(p)
