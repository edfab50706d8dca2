"""Registration admission.

Unit tests drive :class:`hwr_server.registration.admission.RegistrationAdmission` with a
fake clock; the rest run against the REAL daemon with worker subprocesses
whose "registrar" is fake (it sleeps, fails at chunk k, or hangs until the
test lets it go). No CUDA: the decisions are what is tested. Timing bounds
are generous upper bounds on polls; assertions are on counts and orders.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from hwr_client.core.errors import InvalidArgument
from hwr_client.registration import plan_chunks
from hwr_server.config import ServerConfig
from hwr_server.metrics import families
from hwr_server.registration.admission import RegistrationAdmission
from tests.support.daemon import cleanup, make_daemon
from tests.support.registration import poll as _poll, start as _start, stats as _stats

MIB = 1024 * 1024

# A worker: asks for NBYTES, "registers" each chunk with a fake registrar,
# prints one JSON line (the grant and the chunk intervals), then holds its
# registration until stdin closes (or it is killed), releases it and exits.
#   argv: socket nbytes mode wait_s
#   mode: "sleep:S"  each chunk takes S seconds
#         "fail:K"   chunk K raises
#         "hang"     chunk 0 blocks until a line arrives on stdin
WORKER = textwrap.dedent("""
    import json, sys, time
    import hwr_client
    from hwr_client.registration import RegistrationBroker
    sock, nbytes, mode, wait_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    client = hwr_client.connect(sock)
    broker = RegistrationBroker(client.session(), wait_s=wait_s)
    spans, undone = [], []
    def register(offset, length):
        t0 = time.monotonic()
        if mode.startswith("sleep:"):
            time.sleep(float(mode[6:]))
        elif mode.startswith("fail:") and len(spans) == int(mode[5:]):
            raise OSError("fake cudaHostRegister failed")
        elif mode == "hang" and not spans:
            print(json.dumps({"hanging": True}), flush=True)
            sys.stdin.readline()
        spans.append([t0, time.monotonic()])
    grant = broker.register(nbytes, register, unregister_chunk=lambda o, n: undone.append(o), label=mode)
    print(json.dumps({"admitted": grant.admitted, "reason": grant.reason, "chunks": len(grant.chunks),
                      "chunk_bytes": grant.chunk_bytes,
                      "spans": spans, "undone": undone, "done_at": time.monotonic()}), flush=True)
    sys.stdin.read()
    broker.release(grant)
    client.close()
""")


# -- unit: the accounting itself ----------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _admission(open_sessions: set[str], clock: _Clock, **cfg) -> RegistrationAdmission:
    # The uid share is tested on its own (test_hostile_registration.py);
    # here every request is the anonymous uid's, so it holds the whole budget.
    base = dict(registration_budget_bytes=10 * MIB, registration_chunk_bytes=MIB,
                registration_chunk_timeout_s=5.0, max_registrations_in_flight=1, registration_uid_share=1.0)
    base.update(cfg)
    return RegistrationAdmission(ServerConfig(**base), lambda s: s in open_sessions, clock=clock)


def test_budget_in_flight_and_session_end():
    clock, sessions = _Clock(), {"a", "b"}
    adm = _admission(sessions, clock)
    first = adm.admit("a", 6 * MIB, pid=1)
    assert first.admitted and first.chunk_bytes == MIB
    # The slot is taken: an immediate request is refused "busy", not queued.
    assert adm.admit("b", MIB, pid=2).reason == "busy"
    for _ in range(6):
        adm.report_chunk("a", first.registration_id, MIB, 0.1)
    assert adm.stats()["hwr_registrations_in_flight"] == 0
    # 6 of 10 MiB admitted: 5 more is over budget, 4 fits.
    assert adm.admit("b", 5 * MIB, pid=2).reason == "budget"
    second = adm.admit("b", 4 * MIB, pid=2)
    assert second.admitted
    stats = adm.stats()
    assert stats["hwr_registration_admitted_bytes"] == 10 * MIB
    assert stats['hwr_registration_worker_bytes{session="a",pid="1",client=""}'] == 6 * MIB
    assert stats['hwr_registration_admissions_total{outcome="budget"}'] == 1
    # Every figure parses as a Prometheus sample (none skipped at scrape).
    fams = {f.name: f for f in families(stats)}
    assert len(fams["hwr_registration_worker_bytes"].samples) == 2
    assert sum(len(f.samples) for f in fams.values()) == len(stats)
    assert adm.end_session("a") == 1
    assert adm.stats()["hwr_registration_admitted_bytes"] == 4 * MIB
    assert not adm.release("a", second.registration_id)  # not a's to release
    assert adm.release("b", second.registration_id)
    assert adm.stats()["hwr_registration_admitted_bytes"] == 0
    # A closed session is refused before anything is counted.
    assert adm.admit("gone", MIB, pid=3).reason == "session"


def test_a_stall_frees_the_slot_and_refuses_only_its_own_session():
    clock, sessions = _Clock(), {"a", "b"}
    adm = _admission(sessions, clock)
    grant = adm.admit("a", 2 * MIB, pid=1)
    # Queued behind a's slot (the only one).
    queued = adm.admit("b", MIB, pid=2, wait_s=60)
    assert (queued.reason, queued.position) == ("queued", 0) and queued.ticket
    clock.t += 5.1
    assert adm.check_watchdog() == 1
    stats = adm.stats()
    assert stats["hwr_registration_watchdog_stalled"] == 1
    assert stats["hwr_registration_watchdog_stalls_total"] == 1
    assert stats["hwr_registrations_in_flight"] == 0  # the stalled one gave up its slot
    # The stalled session's next request is refused; another session's is not.
    assert adm.admit("a", MIB, pid=1).reason == "watchdog"
    second = adm.admit("b", MIB, pid=2, ticket=queued.ticket)
    assert second.admitted
    adm.report_chunk("a", grant.registration_id, MIB, 5.1)
    assert adm.stats()["hwr_registration_watchdog_stalled"] == 0
    adm.report_chunk("b", second.registration_id, MIB, 0.1)
    assert adm.admit("a", MIB, pid=1).admitted  # a is admitted again once its chunk completed


def test_queued_requests_are_answered_at_once_and_admitted_in_order():
    clock, sessions = _Clock(), {"a", "b", "c"}
    adm = _admission(sessions, clock)
    first = adm.admit("a", MIB, pid=1)
    b = adm.admit("b", MIB, pid=2, wait_s=60)
    c = adm.admit("c", MIB, pid=3, wait_s=60)
    assert (b.reason, b.position, c.reason, c.position) == ("queued", 0, "queued", 1)
    assert b.retry_after_ms > 0 and b.ticket != c.ticket
    assert adm.stats()["hwr_registrations_queued"] == 2
    adm.report_chunk("a", first.registration_id, MIB, 0.1)  # the slot frees
    # c asks first, but b is ahead of it: the slot waits for b.
    assert adm.admit("c", MIB, pid=3, ticket=c.ticket).reason == "queued"
    assert adm.admit("c", MIB, pid=3, wait_s=60).position == 2  # without its ticket: a new request, at the end
    granted = adm.admit("b", MIB, pid=2, ticket=b.ticket)
    assert granted.admitted
    adm.report_chunk("b", granted.registration_id, MIB, 0.1)
    assert adm.admit("c", MIB, pid=3, ticket=c.ticket).admitted
    assert adm.stats()["hwr_registrations_queued"] == 1  # c's second, ticketless request


def test_a_queued_request_leaves_when_it_stops_asking_or_its_wait_is_over():
    clock, sessions = _Clock(), {"a", "b", "c"}
    adm = _admission(sessions, clock, registration_chunk_timeout_s=100.0)  # no stall frees the slot here
    adm.admit("a", MIB, pid=1)  # holds the slot
    gone = adm.admit("b", MIB, pid=2, wait_s=60)
    clock.t += 6  # more than TICKET_TTL_S without asking again
    late = adm.admit("c", MIB, pid=3, wait_s=2)
    assert (late.reason, late.position) == ("queued", 0)  # b's place is gone
    assert adm.admit("b", MIB, pid=2, ticket=gone.ticket, wait_s=60).position == 1  # asks again: at the end now
    clock.t += 2  # c's 2 s are over
    over = adm.admit("c", MIB, pid=3, ticket=late.ticket)
    assert over.reason == "busy" and "wait is over" in over.detail


def test_one_uid_queues_at_most_its_share_of_waiters():
    clock, sessions = _Clock(), {"a", "b"}
    adm = _admission(sessions, clock, max_registration_waiters_per_uid=2)
    adm.admit("a", MIB, pid=1)  # holds the slot
    got = [adm.admit("b", MIB, pid=2, uid_key="uid 65534", wait_s=60).reason for _ in range(3)]
    assert got == ["queued", "queued", "busy"]
    refused = adm.admit("b", MIB, pid=2, uid_key="uid 65534", wait_s=60)
    assert "max_registration_waiters_per_uid" in refused.detail
    # Another uid, and the node's own (privileged) workers, still queue.
    assert adm.admit("b", MIB, pid=2, uid_key="uid 1000", wait_s=60).reason == "queued"
    assert all(adm.admit("a", MIB, pid=1, uid_key="uid 0", privileged=True, wait_s=60).reason == "queued"
               for _ in range(3))


def test_one_uid_holds_at_most_its_share_of_the_budget():
    clock, sessions = _Clock(), {"a", "b"}
    adm = _admission(sessions, clock, registration_uid_share=0.5, max_registrations_in_flight=8)
    assert adm.admit("a", 5 * MIB, pid=1, uid_key="uid 65534").admitted  # exactly the share
    refused = adm.admit("b", MIB, pid=2, uid_key="uid 65534")  # another process of the same uid
    assert refused.reason == "budget" and "registration_uid_share" in refused.detail
    assert adm.admit("b", 5 * MIB, pid=2, uid_key="uid 0", privileged=True).admitted  # the rest


def test_a_stopping_daemon_refuses_at_once():
    adm = RegistrationAdmission(ServerConfig(registration_budget_bytes=4 * MIB), lambda s: True)
    assert adm.admit("a", MIB, pid=1, privileged=True).admitted  # takes the only slot
    adm.stop()
    got = adm.admit("b", MIB, pid=2, privileged=True, wait_s=60)
    assert got.reason == "busy" and "stopping" in got.detail


def test_watchdog_clears_when_the_stalled_session_ends():
    clock, sessions = _Clock(), {"a", "b"}
    adm = _admission(sessions, clock)
    adm.admit("a", MIB, pid=1)
    clock.t += 6
    adm.check_watchdog()
    assert adm.stats()["hwr_registration_watchdog_stalled"] == 1
    adm.end_session("a")
    assert adm.stats()["hwr_registration_watchdog_stalled"] == 0
    assert adm.admit("b", MIB, pid=2).admitted


def test_oversized_chunk_and_bad_config_are_named():
    clock, sessions = _Clock(), {"a"}
    adm = _admission(sessions, clock)
    grant = adm.admit("a", 2 * MIB, pid=1)
    with pytest.raises(InvalidArgument, match="registration_chunk_bytes"):
        adm.report_chunk("a", grant.registration_id, 2 * MIB, 0.1)
    with pytest.raises(InvalidArgument, match="registration_budget_fraction"):
        RegistrationAdmission(ServerConfig(registration_budget_fraction=1.5), lambda s: True)
    with pytest.raises(InvalidArgument, match="max_registrations_in_flight"):
        RegistrationAdmission(ServerConfig(max_registrations_in_flight=0), lambda s: True)


def test_default_budget_is_a_fraction_of_memtotal():
    adm = RegistrationAdmission(ServerConfig(), lambda s: True, mem_total=lambda: 64 * 1024 * MIB)
    assert adm.budget == 32 * 1024 * MIB
    assert adm.uid_cap == 16 * 1024 * MIB  # registration_uid_share 0.5


def test_plan_chunks_covers_the_range():
    assert plan_chunks(5, 2) == ((0, 2), (2, 2), (4, 1))
    assert plan_chunks(4, 2) == ((0, 2), (2, 2))


# -- the real daemon ----------------------------------------------------------------


def _worker(d, nbytes: int, mode: str, wait_s: float = 60.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER, d.socket, str(nbytes), mode, str(wait_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=d.env)


def _result(p: subprocess.Popen) -> dict:
    line = p.stdout.readline()
    assert line, f"worker {p.pid} exited with {p.poll()} before reporting"
    return json.loads(line)


def _finish(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.stdin.close()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_eight_workers_share_the_budget_one_at_a_time(tmp_path):
    d = _start(tmp_path, registration_budget_bytes=5 * 2 * MIB, registration_chunk_bytes=MIB,
               max_registrations_in_flight=1)
    procs = []
    try:
        procs = [_worker(d, 2 * MIB, "sleep:0.05") for _ in range(8)]
        results = [_result(p) for p in procs]
        admitted = [r for r in results if r["admitted"]]
        assert len(admitted) == 5
        assert sorted(r["reason"] for r in results if not r["admitted"]) == ["budget"] * 3
        # Serialization: each admitted worker's chunks (first start to last
        # end, one system-wide monotonic clock) never overlap another's.
        spans = sorted((r["spans"][0][0], r["spans"][-1][1]) for r in admitted)
        assert all(len(r["spans"]) == 2 and r["chunk_bytes"] == MIB for r in admitted)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, f"two registrations in flight at once: {spans}"
        s = _stats(d)
        assert s["hwr_registration_admitted_bytes"] == 10 * MIB
        per_worker = {k: v for k, v in s.items() if k.startswith("hwr_registration_worker_bytes")}
        assert len(per_worker) == 5 and set(per_worker.values()) == {2 * MIB}
        pids = {f'pid="{p.pid}"' for p in procs}
        assert all(any(pid in k for pid in pids) for k in per_worker), per_worker
        assert s["hwr_registration_chunks_total"] == 10
        assert s["hwr_registration_chunk_bytes_total"] == 10 * MIB
        assert s['hwr_registration_admissions_total{outcome="budget"}'] == 3
        _finish(procs)
        _poll(d, lambda s: s["hwr_registration_admitted_bytes"] == 0, "budget returned after release")
        assert "chunk 1, 0.001 GiB" in d.log()  # the per-chunk progress log
    finally:
        _finish(procs)
        cleanup(d)


def test_watchdog_reports_a_hung_chunk_and_others_are_admitted_after_it(tmp_path):
    d = _start(tmp_path, registration_budget_bytes=64 * MIB, registration_chunk_bytes=MIB,
               registration_chunk_timeout_s=0.5, max_registrations_in_flight=1)
    procs = []
    try:
        hung = _worker(d, 2 * MIB, "hang")
        procs.append(hung)
        assert _result(hung) == {"hanging": True}
        # Asked while the hung worker holds the only slot: each is queued
        # (60 s allowed) until the watchdog gives the slot away, then
        # admitted in turn. A stall blocks only its own session.
        others = [_worker(d, MIB, "sleep:0", wait_s=60) for _ in range(3)]
        procs += others
        results = [_result(p) for p in others]
        assert [r["admitted"] for r in results] == [True] * 3, results
        assert hung.poll() is None  # ...while the hung one still hangs
        s = _stats(d)
        assert s["hwr_registration_watchdog_stalled"] == 1
        assert s["hwr_registration_watchdog_stalls_total"] == 1
        assert s['hwr_registration_admissions_total{outcome="watchdog"}'] == 0
        assert "has run for more than 0.5 s" in d.log()
        # The hang ends: the chunk completes and the stall clears.
        hung.stdin.write("go\n")
        hung.stdin.flush()
        assert _result(hung)["admitted"]
        _poll(d, lambda s: s["hwr_registration_watchdog_stalled"] == 0, "stall cleared")
        late = _worker(d, MIB, "sleep:0")
        procs.append(late)
        assert _result(late)["admitted"]
    finally:
        _finish(procs)
        cleanup(d)


def test_sigkill_of_a_registered_worker_returns_its_bytes(tmp_path):
    d = _start(tmp_path, registration_budget_bytes=4 * MIB, registration_chunk_bytes=MIB)
    procs = []
    try:
        holder = _worker(d, 4 * MIB, "sleep:0")
        procs.append(holder)
        assert _result(holder)["admitted"]
        s = _stats(d)
        assert s["hwr_registration_admitted_bytes"] == 4 * MIB
        assert any(f'pid="{holder.pid}"' in k for k in s if k.startswith("hwr_registration_worker_bytes"))
        # `hwr stats` shows the worker's registered bytes by pid.
        shown = d.cli("stats", check=True).stdout
        assert any("hwr_registration_worker_bytes" in ln and f'pid="{holder.pid}"' in ln
                   for ln in shown.splitlines()), shown
        refused = _worker(d, MIB, "sleep:0")
        procs.append(refused)
        assert _result(refused)["reason"] == "budget"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        _poll(d, lambda s: s["hwr_registration_admitted_bytes"] == 0, "budget returned after SIGKILL")
        again = _worker(d, 4 * MIB, "sleep:0")
        procs.append(again)
        assert _result(again)["admitted"]
    finally:
        _finish(procs)
        cleanup(d)


def test_failure_at_chunk_k_undoes_and_stages(tmp_path):
    d = _start(tmp_path, registration_budget_bytes=8 * MIB, registration_chunk_bytes=MIB)
    procs = []
    try:
        w = _worker(d, 3 * MIB, "fail:2")
        procs.append(w)
        r = _result(w)
        assert (r["admitted"], r["reason"]) == (False, "failed")
        assert r["undone"] == [MIB, 0]  # chunks 1 and 0 unregistered, last first
        s = _stats(d)
        assert s["hwr_registration_chunks_total"] == 2
        assert s["hwr_registration_admitted_bytes"] == 0
        assert s["hwr_registrations_in_flight"] == 0
        assert "chunk 2 [" in d.log()
    finally:
        _finish(procs)
        cleanup(d)


def test_a_session_that_ends_during_admission_keeps_nothing():
    clock = _Clock()
    answers = iter([True, False])  # open at the first check, gone at the re-check
    adm = RegistrationAdmission(ServerConfig(registration_budget_bytes=4 * MIB), lambda s: next(answers),
                                clock=clock)
    got = adm.admit("a", MIB, pid=1)
    assert (got.admitted, got.reason) == (False, "session")
    stats = adm.stats()
    assert stats["hwr_registration_admitted_bytes"] == 0
    assert stats["hwr_registrations_in_flight"] == 0


def test_an_unreachable_daemon_means_staging_not_an_error(tmp_path):
    from hwr_client.registration import RegistrationBroker
    from hwr_client.session import Session

    d = make_daemon(tmp_path).start()
    try:
        session = Session(d.socket, connect_timeout_s=2.0)
        broker = RegistrationBroker(session, wait_s=0)
        assert broker.request(MIB).admitted
        d.kill()
        grant = broker.request(MIB)
        assert (grant.admitted, grant.reason) == (False, "daemon")
        assert not broker.release(grant)
        session.close()
    finally:
        cleanup(d)
