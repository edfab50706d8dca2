"""Hostile input against a real daemon: what another client sees while one
process misbehaves, measured in ONE run against the same calls without it.

Each case starts ``hwr serve`` on its own temp root (tests/daemon.py) and
sends the requests of tests/server/test_hostile_streams.py and
tests/server/test_hostile_publications.py (their builders are imported, not copied):

- ``streams``: one process (tests.support.streams.HOSTILE) holds 64
  silent Session streams and 64 plan-only Publish streams on an anonymous
  channel. Reported: how many the daemon refused, and another client's
  GetStats / Lookup latency (ms) and a new worker's first lease (a separate
  process, its torch import included), each without the hostile process
  (baseline) and with it;
- ``huge_plan``: a Publish plan of N scalar tensors (default 200,000, over
  ``max_artifact_tensors``): time to the refusal and the daemon's RSS before
  and after, against a plan exactly at the limit (accepted; what building it
  costs);
- ``idle_publications``: a legitimate publish behind as many plan-only
  publications as there are slots (``max_publications``), with
  ``publication_idle_s`` lowered in the config, against the same publish
  with no hogs;
- ``shared_node``: one user (uid ``nobody``) against root's worker on a
  shared daemon: a flood of waiting registrations, six processes of streams,
  four trickling publications, a stalled registration; root's Lookup p50/p99
  and the daemon's RSS, threads and fds, with and without each attack
  (bench/hostile_local.py);
- the pull cases (``bench/hostile_registry.py``): a hostile registry on
  127.0.0.1 (tests/support/hostile_registry.py) throws 401 and 307 bombs, a
  trickled layer, 1,320 cancelled and 64 held PullOnMiss calls against a
  hung registry, a 350k-tensor config, a 10,000-layer manifest and lying
  sizes at a daemon each; another process's Lookup p50/p99 while each runs,
  the daemon's peak RSS, threads and descriptors.

The daemon as shipped (default config) except where a case names a field.

    python bench/hostile.py           # 200k-tensor plan, idle 5 s, 20 calls per phase, all pull cases
    python bench/hostile.py --quick   # max_artifact_tensors = 4096, idle 1 s, no baseline worker,
                                      # smaller pull cases; what the test runs
    python bench/hostile.py --cases pull   # only the pull cases

Prints a table and writes JSON (default bench/results/hostile.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.common import bench_dir, result_command, result_path, save_result  # noqa: E402
from bench.hostile_registry import print_pull_table, run_pull_cases  # noqa: E402
from hwr_client.core._proto import hwr_pb2 as pb  # noqa: E402
from hwr_client.core.identity import Identity  # noqa: E402
from hwr_client.core.plan import to_proto  # noqa: E402
from hwr_client.tensors import build_plan  # noqa: E402
from hwr_server.config import ServerConfig  # noqa: E402
from tests.conftest import identity, sample_tensors  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.raw_publish import COMMIT, daemon_rss_mib, held_stream, raw_publish, toml  # noqa: E402
from tests.support.streams import CALL_BOUND_S, HOSTILE, readline, wait_for  # noqa: E402
from bench.hostile_local import print_local, run_local  # noqa: E402

#: A new worker: interpreter start, torch and hwr_client imports, connect, lease, map.
FIRST_LEASE = ("import sys, torch, hwr_client\n"
               "c = hwr_client.connect(sys.argv[1])\n"
               "c.acquire(sys.argv[2]).close()\n")


def start(directory: str, name: str, config: dict | None = None):
    """A daemon on ``<directory>/<name>/root``, with ``config`` as its TOML file."""
    tmp = pathlib.Path(directory) / name
    tmp.mkdir()
    args: list[str] = []
    if config:
        (tmp / "hwr.toml").write_text(toml(config))
        args = ["--config", str(tmp / "hwr.toml")]
    return make_daemon(tmp, *args).start()


def daemon_stats(d) -> dict:
    with d.client() as c:
        return json.loads(c.call(c.reader.GetStats, pb.GetStatsRequest(), timeout=CALL_BOUND_S).stats_json)


def summary(ms: list[float]) -> dict[str, float]:
    return {"median": statistics.median(ms), "max": max(ms)} if ms else {"median": float("nan"), "max": float("nan")}


def unary_latencies(d, key: str, calls: int) -> dict[str, Any]:
    """``calls`` GetStats and ``calls`` Lookup from one fresh client, each
    bounded by CALL_BOUND_S; latencies of the served ones (ms), and the
    error class of any that was not."""
    got: dict[str, list[float]] = {"getstats": [], "lookup": []}
    failed: list[str] = []
    with d.client() as c:
        c.call(c.reader.GetStats, pb.GetStatsRequest(), timeout=CALL_BOUND_S)  # the channel's set-up, not timed
        for _ in range(calls):
            for name, method, request in (("getstats", c.reader.GetStats, pb.GetStatsRequest()),
                                          ("lookup", c.runtime.Lookup, pb.LookupRequest(key=key))):
                t0 = time.perf_counter()
                try:
                    c.call(method, request, timeout=CALL_BOUND_S)
                    got[name].append((time.perf_counter() - t0) * 1e3)
                except Exception as exc:  # noqa: BLE001 - counted: the hostile case's "before" was all of them
                    failed.append(f"{name}: {type(exc).__name__}")
    return {"calls": 2 * calls, "ok": len(got["getstats"]) + len(got["lookup"]), "failed": failed,
            "getstats_ms": summary(got["getstats"]), "lookup_ms": summary(got["lookup"])}


def first_lease(d, key: str) -> dict[str, Any]:
    """Wall seconds of a new worker process from spawn to its first lease."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", FIRST_LEASE, d.socket, key], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    return {"seconds": time.perf_counter() - t0, "ok": proc.returncode == 0,
            "error": proc.stderr.strip().splitlines()[-1] if proc.returncode and proc.stderr.strip() else ""}


def case_streams(directory: str, calls: int, baseline_lease: bool = True) -> dict[str, Any]:
    """``baseline_lease`` False skips the baseline worker (--quick: a process start and a torch import)."""
    d = start(directory, "streams")
    try:
        with d.client() as c:
            key = c.publish(identity(bench="hostile-streams"), sample_tensors()).key
        baseline = unary_latencies(d, key, calls)
        lease0 = first_lease(d, key) if baseline_lease else None
        hostile = subprocess.Popen([sys.executable, "-c", HOSTILE, d.socket], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=REPO))
        try:
            if readline(hostile, timeout=60).strip() != "open":
                raise RuntimeError("the hostile process did not open its streams")

            def outcomes() -> list[list[str]]:
                assert hostile.stdin is not None
                hostile.stdin.write("\n")
                hostile.stdin.flush()
                return json.loads(readline(hostile, timeout=30) or "[]")

            held = 128
            cap = ServerConfig().max_streams_anonymous
            # Measured once every stream over the cap has its answer (refusals come at once).
            wait_for(lambda: len(outcomes()) >= held - cap, timeout=30, step=0.2)
            under = unary_latencies(d, key, calls)
            under_lease = first_lease(d, key)
            got = outcomes()
            figures = daemon_stats(d)
        finally:
            hostile.kill()
            hostile.wait()
    finally:
        cleanup(d)
    codes = Counter(code for code, _ in got)
    return {
        "hostile_streams": held, "max_streams_anonymous": cap,
        "refused": codes.get("RESOURCE_EXHAUSTED", 0),
        "refusals_name_the_field": all("max_streams_anonymous" in details for code, details in got
                                       if code == "RESOURCE_EXHAUSTED"),
        "outcome_codes": dict(codes), "hwr_streams_refused_total": figures["hwr_streams_refused_total"],
        "hwr_streams_active": figures["hwr_streams_active"],
        "baseline": baseline, "under_load": under,
        "first_lease": {"baseline": lease0, "under_load": under_lease},
    }


def scalar_plan(tag: str, n: int) -> pb.PublishPlan:
    """The wire plan of ``n`` U8 scalars in one file, built as the hostile
    client would (no client-side checks)."""
    return pb.PublishPlan(identity_json=Identity.from_dict(identity(bench=tag)).to_json(), files=[
        pb.FilePlan(name="f", tensors=[pb.TensorPlan(name=f"t{i}", dtype="U8") for i in range(n)])])


def case_huge_plan(directory: str, sizes: list[int], limit: int | None) -> dict[str, Any]:
    """Each size in ``sizes`` (over the limit) refused on one daemon, then a
    plan exactly at the limit accepted (held, then cancelled)."""
    config = {"max_artifact_tensors": limit} if limit else None
    limit = limit or ServerConfig().max_artifact_tensors
    d = start(directory, "plan", config)
    rows = []
    try:
        rss_start = daemon_rss_mib(d)
        for n in sizes:
            msg = scalar_plan(f"huge-{n}", n)
            rss0 = daemon_rss_mib(d)
            with d.client() as client:
                t0 = time.perf_counter()
                code, details = raw_publish(client, [pb.PublishRequest(plan=msg), COMMIT], timeout=120)
                seconds = time.perf_counter() - t0
            rss1 = daemon_rss_mib(d)
            rows.append({"tensors": n, "plan_bytes": msg.ByteSize(), "code": code.name, "seconds": seconds,
                         "names_the_field": "max_artifact_tensors" in details,
                         "rss_before_mib": rss0, "rss_after_mib": rss1, "rss_delta_mib": rss1 - rss0})
        msg = scalar_plan("at-limit", limit)
        release = threading.Event()
        rss0 = daemon_rss_mib(d)
        with d.client() as client:
            call = held_stream(client, [pb.PublishRequest(plan=msg)], release, timeout=120)
            t0 = time.perf_counter()
            try:
                accepted = next(call).WhichOneof("kind") == "accepted"
            except grpc.RpcError as err:
                accepted = False
                print(f"plan at the limit: {err.code().name} {err.details()}", file=sys.stderr)
            seconds = time.perf_counter() - t0
            rss1 = daemon_rss_mib(d)  # while the accepted publication is still open
            release.set()
            call.cancel()
    finally:
        cleanup(d)
    return {"max_artifact_tensors": limit, "rss_start_mib": rss_start, "refused": rows,
            "at_limit": {"tensors": limit, "plan_bytes": msg.ByteSize(), "accepted": accepted, "seconds": seconds,
                         "rss_before_mib": rss0, "rss_after_mib": rss1, "rss_delta_mib": rss1 - rss0}}


def case_idle(directory: str, idle_s: float) -> dict[str, Any]:
    """A real publish with no hogs, then behind max_publications plan-only ones."""
    slots = ServerConfig().max_publications
    d = start(directory, "idle", {"publication_idle_s": idle_s})
    release = threading.Event()
    calls = []
    try:
        with d.client() as client:
            t0 = time.perf_counter()
            client.publish(identity(bench="idle-baseline"), {"w": torch.ones(4)})
            baseline = time.perf_counter() - t0
            for i in range(slots):
                plan = build_plan(identity(bench=f"hog-{i}"), {"w": torch.zeros(4)})
                # The call's own deadline is far past the idle one: the daemon must end them.
                calls.append(held_stream(client, [pb.PublishRequest(plan=to_proto(plan))], release,
                                          timeout=idle_s * 4 * slots + 60))
            t0 = time.perf_counter()
            report = client.publish(identity(bench="idle-legit"), {"w": torch.full((4,), 2.0)})
            seconds = time.perf_counter() - t0
            committed = client.lookup(report.key).key == report.key
            codes = []
            for call in calls:
                try:
                    for _ in call:
                        pass
                    codes.append("OK")
                except grpc.RpcError as err:
                    codes.append(err.code().name)
    finally:
        release.set()
        cleanup(d)
    return {"publication_idle_s": idle_s, "hogs": slots, "baseline_seconds": baseline, "legit_seconds": seconds,
            "legit_committed": committed, "hog_codes": dict(Counter(codes))}


def run(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    quick = args.quick
    sizes = [2 * 4096] if quick else [int(n) for n in args.plan_tensors.split(",")]
    out: dict[str, Any] = {"quick": quick, "cores": os.cpu_count()}
    if args.cases in ("all", "local"):
        out["streams"] = case_streams(directory, 5 if quick else args.calls, baseline_lease=not quick)
        out["huge_plan"] = case_huge_plan(directory, sizes, 4096 if quick else None)
        out["idle_publications"] = case_idle(directory, 1.0 if quick else args.idle)
        out["shared_node"] = run_local(directory, 5 if quick else args.calls)
    if args.cases in ("all", "pull"):
        pull_dir = os.path.join(directory, "pull")
        os.mkdir(pull_dir)
        out["pull"] = run_pull_cases(pull_dir, quick=quick, bomb=(64 if quick else args.bomb_mib) << 20,
                                     calls=200 if quick else args.pull_calls,
                                     tensors=100_000 if quick else args.pull_tensors)
    return out


def print_table(r: dict) -> None:
    if "streams" in r:
        print_local_table(r)
    if "pull" in r:
        print_pull_table(r["pull"])


def print_local_table(r: dict) -> None:
    s, h, i = r["streams"], r["huge_plan"], r["idle_publications"]
    b, u = s["baseline"], s["under_load"]
    lb, lu = s["first_lease"]["baseline"], s["first_lease"]["under_load"]
    print(f"{'case':58} {'baseline':>18} {'hostile':>18}")
    print(f"{'GetStats ms median/max (another client)':58} "
          f"{b['getstats_ms']['median']:8.2f}/{b['getstats_ms']['max']:<9.2f} "
          f"{u['getstats_ms']['median']:8.2f}/{u['getstats_ms']['max']:<9.2f}")
    print(f"{'Lookup ms median/max':58} {b['lookup_ms']['median']:8.2f}/{b['lookup_ms']['max']:<9.2f} "
          f"{u['lookup_ms']['median']:8.2f}/{u['lookup_ms']['max']:<9.2f}")
    print(f"{'unary calls served':58} {b['ok']:>8}/{b['calls']:<9} {u['ok']:>8}/{u['calls']:<9}")
    lease0 = f"{lb['seconds']:>8.2f}{'' if lb['ok'] else ' FAIL':9}" if lb else f"{'-':>8}{'':9}"
    print(f"{'new worker first lease s (process, torch import)':58} "
          f"{lease0} {lu['seconds']:>8.2f}{'' if lu['ok'] else ' FAIL':9}")
    print(f"  {s['hostile_streams']} hostile streams: {s['refused']} refused (cap {s['max_streams_anonymous']}), "
          f"outcomes {s['outcome_codes']}")
    at = h["at_limit"]
    rss = f"{at['rss_before_mib']}->{at['rss_after_mib']}"
    print(f"{'plan at the limit, ' + format(at['tensors'], ',') + ' tensors: s, daemon RSS MiB':58} "
          f"{at['seconds']:8.2f} {rss:>9} {'(accepted)' if at['accepted'] else '(NOT accepted)'}")
    for row in h["refused"]:
        rss = f"{row['rss_before_mib']}->{row['rss_after_mib']}"
        print(f"{'plan of ' + format(row['tensors'], ',') + ' tensors: s, daemon RSS MiB':58} "
              f"{'':18} {row['seconds']:8.2f} {rss:>9} ({row['code']})")
    print(f"{'publish behind ' + str(i['hogs']) + ' plan-only publications s (idle ' + format(i['publication_idle_s'], 'g') + ' s)':58} "
          f"{i['baseline_seconds']:>8.2f}{'':9} {i['legit_seconds']:>8.2f}{'' if i['legit_committed'] else ' FAIL':9}")
    print(f"  hogs ended: {i['hog_codes']}")
    print_local(r["shared_node"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="GetStats and Lookup calls per phase (default 20)")
    parser.add_argument("--plan-tensors", default="200000",
                        help="comma-separated plan sizes over max_artifact_tensors (default 200000)")
    parser.add_argument("--idle", type=float, default=5.0, help="publication_idle_s of the idle case (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="max_artifact_tensors = 4096 (an 8,192-tensor plan), idle 1 s, 5 calls: a smoke run")
    parser.add_argument("--cases", choices=("all", "local", "pull"), default="all",
                        help="local: streams, plans, idle publications; pull: the hostile registry (default all)")
    parser.add_argument("--bomb-mib", type=int, default=1024, help="body of the 401/307 bombs, MiB (default 1024)")
    parser.add_argument("--pull-calls", type=int, default=1320,
                        help="cancelled PullOnMiss calls against a hung registry (default 1320)")
    parser.add_argument("--pull-tensors", type=int, default=350_000,
                        help="tensors of the forged pulled config (default 350000)")
    parser.add_argument("--dir", help="where the daemons' roots go (default: system temp)")
    parser.add_argument("--out", default=result_path("hostile.json"))
    args = parser.parse_args(argv)
    with bench_dir("hostile", args.dir) as directory:
        result = run(args, directory)
    result["command"] = result_command("bench/hostile.py", argv)
    print_table(result)
    save_result(result, args.out, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
