"""The shared-node cases of bench/hostile.py: one user (uid ``nobody``, real
processes through tests/support/privdrop.py) attacks a daemon shared with
root, and root's worker measures what it gets.

Each case starts ``hwr serve`` on its own temp root with its runtime socket
in group ``nogroup`` (so nobody reaches it, as a worker in the socket's
group would), publishes one small artifact, measures another user's (root's)
Lookup latency without the attack (baseline) and while it runs (p50 / p99 /
max over N calls, each bounded by CALL_BOUND_S), and the daemon's RSS,
threads and open descriptors at both points. The attackers are the programs
of tests/support/hostile_users.py, the ones the tests run:

- ``registration_flood``: one process holds the registration slot (4 KiB,
  never reported) and sends 64 AdmitRegistration calls that ask to wait
  300 s (the landed daemon parked each on a gRPC thread);
- ``uid_streams``: six processes of one uid open eight Session streams each
  (the landed daemon gave them all 48 stream places); plus root's first lease;
- ``trickle_publications``: four processes each trickle a publication one
  byte every half second (the landed daemon let them hold every publication
  slot); plus root's publication time, against the same publication alone;
- ``registration_stall``: one process admits 4 KiB and never reports;
  root's registration request (its outcome and how long it was queued)
  against the same request without the stall.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.plan import to_proto
from hwr_client.registration import RegistrationBroker
from hwr_client.tensors import build_plan
from tests.conftest import identity, sample_tensors
from tests.support.daemon import cleanup, make_daemon
from tests.support.hostile_users import REGISTRATION_ATTACKER, STREAM_HOG, TRICKLER
from tests.support.raw_publish import COMMIT, chunks, raw_publish
from tests.support.shared_node import finish, popen_nobody, toml
from tests.support.streams import CALL_BOUND_S, readline


def start_shared(directory: str, name: str, config: dict) -> Any:
    """A daemon whose runtime socket nobody may use (group nogroup)."""
    tmp = pathlib.Path(directory) / name
    tmp.mkdir()
    (tmp / "hwr.toml").write_text(toml(config))
    d = make_daemon(tmp, "--config", str(tmp / "hwr.toml"), "--socket-group", "nogroup")
    os.chmod(os.path.dirname(d.socket), 0o755)  # mkdtemp made it 0700
    return d.start()


def process_figures(d) -> dict[str, int]:
    """The daemon's RSS (MiB), threads and open file descriptors now."""
    with open(f"/proc/{d.proc.pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) // 1024, "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{d.proc.pid}/fd"))}


def lookup_latencies(d, key: str, calls: int) -> dict[str, Any]:
    """``calls`` Lookups by root's client; p50 / p99 / max (ms) of the
    served ones, and the error class of any that was not."""
    ms: list[float] = []
    failed: list[str] = []
    with d.client() as c:
        c.call(c.runtime.Lookup, pb.LookupRequest(key=key), timeout=CALL_BOUND_S)  # the channel's set-up
        for _ in range(calls):
            t0 = time.perf_counter()
            try:
                c.call(c.runtime.Lookup, pb.LookupRequest(key=key), timeout=CALL_BOUND_S)
                ms.append((time.perf_counter() - t0) * 1e3)
            except Exception as exc:  # noqa: BLE001 - counted: the landed daemon failed them
                failed.append(type(exc).__name__)
    q = statistics.quantiles(ms, n=100) if len(ms) >= 2 else [float("nan")] * 99
    return {"calls": calls, "ok": len(ms), "failed": failed, "p50_ms": q[49] if ms else float("nan"),
            "p99_ms": q[98] if ms else float("nan"), "max_ms": max(ms, default=float("nan"))}


def _baseline(d, tag: str, calls: int) -> tuple[str, dict[str, Any]]:
    with d.client() as c:
        key = c.publish(identity(bench=tag), sample_tensors()).key
    return key, {"lookups": lookup_latencies(d, key, calls), "daemon": process_figures(d)}


def _ask(p, **cmd) -> dict:
    p.stdin.write(json.dumps(cmd) + "\n")
    p.stdin.flush()
    return json.loads(readline(p, timeout=60) or "{}")


def _attacker(d):
    p = popen_nobody(REGISTRATION_ATTACKER, d.socket)
    if json.loads(readline(p, timeout=60) or "{}").get("uid") != 65534:
        raise RuntimeError("the registration attacker did not start as nobody")
    return p


def case_registration_flood(directory: str, calls: int, flood: int = 64) -> dict[str, Any]:
    d = start_shared(directory, "reg-flood", {"registration_budget_bytes": "64MiB",
                                              "registration_chunk_timeout_s": 600.0})
    p = None
    try:
        key, base = _baseline(d, "reg-flood", calls)
        p = _attacker(d)
        held = _ask(p, op="admit", nbytes=4096)["admitted"]
        _ask(p, op="flood", n=flood, wait_ms=300_000)
        under = {"lookups": lookup_latencies(d, key, calls), "daemon": process_figures(d)}
        results = json.loads(readline(p, timeout=60) or '{"results": []}')["results"]
    finally:
        finish(p)
        cleanup(d)
    return {"flood": flood, "slot_held": held, "answers": dict(Counter(results)), "baseline": base,
            "under_attack": under}


def first_lease(d, key: str) -> dict[str, Any]:
    """A new worker process (root), spawn to its first lease, torch import included."""
    t0 = time.perf_counter()
    lease = subprocess.run([sys.executable, "-c", "import sys, hwr_client\n"
                            "hwr_client.connect(sys.argv[1]).acquire(sys.argv[2]).close()", d.socket, key],
                           capture_output=True, text=True, timeout=120, env=d.env)
    return {"seconds": time.perf_counter() - t0, "ok": lease.returncode == 0}


def case_uid_streams(directory: str, calls: int, processes: int = 6) -> dict[str, Any]:
    d = start_shared(directory, "uid-streams", {"stream_first_message_timeout_s": 60.0})
    hogs, outcomes = [], []
    try:
        key, base = _baseline(d, "uid-streams", calls)
        lease_alone = first_lease(d, key)
        for _ in range(processes):
            hogs.append(popen_nobody(STREAM_HOG, d.socket, "8"))
            outcomes += json.loads(readline(hogs[-1], timeout=60) or "[]")
        under = {"lookups": lookup_latencies(d, key, calls), "daemon": process_figures(d)}
        lease_under = first_lease(d, key)
    finally:
        finish(*hogs)
        cleanup(d)
    return {"processes": processes, "streams": len(outcomes), "opened": outcomes.count("OPENED"),
            "refused": sum(o.startswith("RESOURCE_EXHAUSTED") for o in outcomes), "baseline": base,
            "under_attack": under, "root_first_lease": {"alone": lease_alone, "under_attack": lease_under}}


def _legit_publish(d, tag: str) -> dict[str, Any]:
    tensors = {"w": torch.arange(64, dtype=torch.float32)}
    plan = build_plan(identity(bench=tag), tensors)
    with d.client() as c:
        t0 = time.perf_counter()
        code, _ = raw_publish(c, [pb.PublishRequest(plan=to_proto(plan)), *chunks(plan, tensors, 4096), COMMIT],
                              timeout=60)
        return {"seconds": time.perf_counter() - t0, "code": code.name}


def case_trickle_publications(directory: str, calls: int, idle_s: float = 3.0) -> dict[str, Any]:
    d = start_shared(directory, "trickle", {"publication_idle_s": idle_s})
    tricklers = []
    try:
        key, base = _baseline(d, "trickle", calls)
        alone = _legit_publish(d, "trickle-alone")
        for i in range(4):
            tricklers.append(popen_nobody(TRICKLER, d.socket, f"b{i}"))
            readline(tricklers[-1], timeout=60)
        legit = _legit_publish(d, "trickle-legit")
        under = {"lookups": lookup_latencies(d, key, calls), "daemon": process_figures(d)}
        ends = [json.loads(readline(p, timeout=90) or '["NONE", ""]')[0] for p in tricklers]
    finally:
        finish(*tricklers)
        cleanup(d)
    return {"tricklers": 4, "publication_idle_s": idle_s, "publish_alone": alone, "publish_under_attack": legit,
            "trickler_ends": dict(Counter(ends)), "baseline": base, "under_attack": under}


def _registration(d) -> dict[str, Any]:
    with d.client() as c:
        broker = RegistrationBroker(c.session(), wait_s=60)
        t0 = time.perf_counter()
        grant = broker.request(1024 * 1024, label="root worker")
        seconds = time.perf_counter() - t0
        if grant.admitted:
            for _, length in grant.chunks:
                broker.chunk_done(grant, length, 0.001)
            broker.release(grant)
    return {"admitted": grant.admitted, "reason": grant.reason, "seconds": seconds}


def case_registration_stall(directory: str, calls: int, timeout_s: float = 1.0) -> dict[str, Any]:
    d = start_shared(directory, "reg-stall", {"registration_budget_bytes": "64MiB",
                                              "registration_chunk_timeout_s": timeout_s})
    p = None
    try:
        key, base = _baseline(d, "reg-stall", calls)
        alone = _registration(d)
        p = _attacker(d)
        _ask(p, op="admit", nbytes=4096)
        under = _registration(d)
        figures = {"lookups": lookup_latencies(d, key, calls), "daemon": process_figures(d)}
    finally:
        finish(p)
        cleanup(d)
    return {"registration_chunk_timeout_s": timeout_s, "root_registration_alone": alone,
            "root_registration_under_stall": under, "baseline": base, "under_attack": figures}


CASES = {"registration_flood": case_registration_flood, "uid_streams": case_uid_streams,
         "trickle_publications": case_trickle_publications, "registration_stall": case_registration_stall}


def run_local(directory: str, calls: int) -> dict[str, Any]:
    """Every shared-node case, ``calls`` lookups per phase."""
    return {name: case(directory, calls) for name, case in CASES.items()}


def print_local(r: dict[str, Any]) -> None:
    print(f"\n{'shared node (attacker: uid nobody)':44} {'root Lookup p50/p99 ms':>24} {'served':>8} "
          f"{'RSS MiB':>8} {'threads':>8} {'fds':>5}")
    for name, c in r.items():
        for phase in ("baseline", "under_attack"):
            lk, dm = c[phase]["lookups"], c[phase]["daemon"]
            print(f"{name + ' (' + phase.replace('_', ' ') + ')':44} {lk['p50_ms']:>11.2f}/{lk['p99_ms']:<12.2f} "
                  f"{lk['ok']:>3}/{lk['calls']:<4} {dm['rss_mib']:>8} {dm['threads']:>8} {dm['fds']:>5}")
    f, u, t, s = r["registration_flood"], r["uid_streams"], r["trickle_publications"], r["registration_stall"]
    print(f"  flood of {f['flood']} waiting AdmitRegistration: answers {f['answers']}")
    la, lu = u["root_first_lease"]["alone"], u["root_first_lease"]["under_attack"]
    print(f"  {u['processes']} processes x 8 streams: {u['opened']} opened, {u['refused']} refused; root's first "
          f"lease (new process, torch import) {la['seconds']:.2f} s alone, {lu['seconds']:.2f} s under attack "
          f"{'ok' if lu['ok'] else 'FAILED'}")
    print(f"  root's publish {t['publish_alone']['seconds']:.2f} s alone, {t['publish_under_attack']['seconds']:.2f} s "
          f"({t['publish_under_attack']['code']}) behind {t['tricklers']} tricklers; tricklers ended "
          f"{t['trickler_ends']}")
    a, b = s["root_registration_alone"], s["root_registration_under_stall"]
    print(f"  root's registration {a['seconds']:.2f} s alone ({'admitted' if a['admitted'] else a['reason']}), "
          f"{b['seconds']:.2f} s behind a stalled one ({'admitted' if b['admitted'] else b['reason']}; "
          f"watchdog {s['registration_chunk_timeout_s']:g} s)")
