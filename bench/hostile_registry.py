"""bench/hostile.py's pull cases: a hostile registry (tests/support/hostile_registry.py)
against a real daemon, what another client sees while each attack runs.

For every case: another process's Lookup latency (p50 / p99 / max, ms, and
how many of its calls failed), sampled every 20 ms for as long as the
attack runs, against the same probe with no attack on the same daemon; the
daemon's peak RSS (VmHWM) before and after, its threads and open
descriptors at the end; what the attack got (the status, the time to it).

- ``bomb_401``: PullOnMiss against a registry whose 401 carries ``--bomb``
  bytes (default 1 GiB);
- ``bomb_307``: a pull whose every blob GET is answered 307 with that body;
- ``trickle``: a pull of a 40 MiB layer sent a byte every 0.1 s (the
  daemon's ``timeout_s`` 5 s, 2 s with --quick; default ``min_rate_bytes``);
- ``hung_calls``: ``--calls`` (default 1,320) PullOnMiss of distinct keys,
  each given up after 1 s, 64 at a time, against a registry that answers
  nothing;
- ``held_64``: 64 PullOnMiss held for 20 s (--quick: 5 s) against the hung registry;
- ``many_tensors`` / ``many_layers``: a pulled config of ``--tensors``
  (350,000) tensors and a manifest of 10,000 layers;
- ``claimed_sizes``: capacity 100 MiB holding three unleased 24 MiB
  artifacts; a registry claims a 40 MiB layer and sends 100 bytes (the
  artifacts kept are counted).
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable

import torch

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.manifest import FileEntry, Manifest, TensorEntry, content_digest
from tests.conftest import identity
from tests.support.daemon import cleanup, make_daemon
from tests.support.hostile_pull import MiB, REPO, Source, fds, peak_rss_mib, pull_on_miss_calls, threads
from tests.support.hostile_registry import HostileRegistry, registry_config

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Another client, in its own process: Lookup every 20 ms until stdin has a
#: line, then one JSON line of (latencies ms, errors).
PROBE = ("import sys, time, json, threading, hwr_client\n"
         "from hwr_client.core._proto import hwr_pb2 as pb\n"
         "c = hwr_client.connect(sys.argv[1]); stop = threading.Event(); out = []; errors = []\n"
         "threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()\n"
         "print('ready', flush=True)\n"
         "while not stop.is_set():\n"
         "    t0 = time.perf_counter()\n"
         "    try:\n"
         "        c.call(c.runtime.Lookup, pb.LookupRequest(key=sys.argv[2]), timeout=10); "
         "out.append((time.perf_counter() - t0) * 1e3)\n"
         "    except Exception as e:\n"
         "        errors.append(type(e).__name__)\n"
         "    stop.wait(0.02)\n"
         "print(json.dumps([out, errors]), flush=True)\n")


def _percentiles(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {"calls": 0, "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else [ms[0]] * 99
    return {"calls": len(ms), "p50": statistics.median(ms), "p99": q[98], "max": max(ms)}


def probed(daemon, key: str, attack: Callable[[], Any], *, min_s: float = 1.0) -> dict[str, Any]:
    """Runs ``attack`` while another process looks ``key`` up; returns the
    attack's outcome, the probe's latencies and the daemon's figures."""
    probe = subprocess.Popen([sys.executable, "-c", PROBE, daemon.socket, key], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=REPO_DIR))
    try:
        assert probe.stdout is not None and probe.stdin is not None
        if probe.stdout.readline().strip() != "ready":
            raise RuntimeError("the probe did not start")
        rss0 = peak_rss_mib(daemon)
        t0 = time.perf_counter()
        try:
            outcome = attack()
        except Exception as exc:  # noqa: BLE001 - the refusal IS the outcome
            outcome = f"{type(exc).__name__}: {str(exc)[:600]}"
        seconds = time.perf_counter() - t0
        time.sleep(max(0.0, min_s - seconds))  # enough samples for a p99 on a quick attack
        figures = {"peak_rss_mib_before": rss0, "peak_rss_mib_after": peak_rss_mib(daemon),
                   "threads": threads(daemon), "fds": fds(daemon)}
        probe.stdin.write("\n")
        probe.stdin.flush()
        latencies, errors = json.loads(probe.stdout.readline())
    finally:
        probe.kill()
        probe.wait()
    return {"outcome": outcome, "seconds": seconds, "lookup_ms": _percentiles(latencies),
            "lookup_errors": dict(Counter(errors)), **figures}


class Bench:
    """One work directory: a source daemon (artifacts), one hostile registry
    per case, and a daemon per case configured for it."""

    def __init__(self, directory: str):
        self.dir = pathlib.Path(directory)
        self.source = Source(self._mkdir("source"))
        self.started: list = []
        self._nodes = 0

    def _mkdir(self, name: str) -> pathlib.Path:
        path = self.dir / name
        path.mkdir()
        return path

    def node(self, registry: str, *, args: tuple[str, ...] = (), **remote: Any):
        """A daemon for ``registry``, with one published artifact to look up."""
        self._nodes += 1
        tmp = self._mkdir(f"node-{self._nodes}")
        cfg = registry_config(str(tmp / "hwr.toml"), registry, pull_on_miss=True,
                              extra={"layer_attempts": 1, **remote})
        d = make_daemon(tmp, "--config", cfg, *args).start()
        self.started.append(d)
        with d.client() as c:
            d.probe_key = c.publish(identity(bench=f"probe-{self._nodes}"), {"w": torch.ones(4)}).key
        return d

    def each(self, setup: Callable[[HostileRegistry], Any], case: Callable[..., Any]) -> dict:
        """One case: a fresh registry, ``setup`` (what it serves), ``case``
        (the daemon and the attack), the probe without and with the attack."""
        reg = HostileRegistry()
        try:
            d, attack = case(reg, setup(reg))
            base = probed(d, d.probe_key, lambda: None)
            return {"baseline_lookup_ms": base["lookup_ms"], **probed(d, d.probe_key, attack)}
        finally:
            reg.close()
            for d in self.started:
                cleanup(d)
            self.started = []

    def close(self) -> None:
        self.source.close()


def _pull(d, ref: str) -> str:
    with d.client() as c:
        done = c.transfer(c.admin.Pull, pb.PullRequest(reference=ref))
    return f"OK ({done.bytes_transferred} bytes)"


def _pull_on_miss(d, key: str) -> str:
    with d.client() as c:
        c.pull_on_miss(key)
    return "OK"


def case_bomb_401(b: Bench, bomb: int) -> dict:
    def case(reg, art):
        key, config, blobs = art
        reg.add(REPO, config, blobs)
        reg.auth, reg.unauthorized_body = ("basic", "u", "p"), bomb
        d = b.node(reg.host)
        return d, lambda: _pull_on_miss(d, key)
    return b.each(lambda reg: b.source.artifact("b401"), case)


def case_bomb_307(b: Bench, bomb: int) -> dict:
    def case(reg, art):
        key, config, blobs = art
        reg.add(REPO, config, blobs)
        reg.redirect_body = bomb
        d = b.node(reg.host)
        return d, lambda: _pull(d, f"{reg.host}/{REPO}:{key}")
    return b.each(lambda reg: b.source.artifact("b307"), case)


def case_trickle(b: Bench, timeout_s: float) -> dict:
    def case(reg, art):
        key, config, blobs = art
        reg.add(REPO, config, blobs)
        reg.trickle_s, (reg.trickle_blob,) = 0.1, blobs
        d = b.node(reg.host, timeout_s=timeout_s)
        return d, lambda: _pull(d, f"{reg.host}/{REPO}:{key}")
    return b.each(lambda reg: b.source.artifact("trickle", {"w": torch.ones(10 * MiB)}), case)


def case_hung(b: Bench, calls: int, timeout: float) -> dict:
    def case(reg, _):
        reg.hang = threading.Event()
        d = b.node(reg.host, timeout_s=60.0)
        return d, lambda: dict(pull_on_miss_calls(d, [secrets.token_hex(32) for _ in range(calls)], timeout, 64))
    return b.each(lambda reg: None, case)


def forged_config(tensors: int, files: int = 1) -> tuple[str, bytes, Manifest]:
    """(key, manifest.json, manifest) of an artifact of ``tensors`` 4-byte
    tensors in ``files`` files: valid, never stored anywhere (its layers
    are never fetched by a daemon that refuses it)."""
    from hwr_client.core.identity import Identity

    ident = Identity.from_dict(identity(bench=f"forged-{tensors}-{files}"))
    per = -(-tensors // files)
    entries, rows = [], []
    for fi in range(files):
        n = min(per, tensors - fi * per)
        entries.append(FileEntry(fi, f"f{fi}", secrets.token_hex(32), 64 + 4 * n, "0" * 32, 64))
        rows += [TensorEntry(f"t{fi}.{i}", fi, "F32", (1,), 64 + 4 * i, 4, "", "0" * 32) for i in range(n)]
    digest = content_digest((t.name, t.dtype, t.shape, t.digest) for t in rows)
    m = Manifest(ident.key, ident, digest, int(time.time()), tuple(entries), tuple(rows), ())
    return ident.key, m.to_json().encode(), m


def case_forged(b: Bench, tensors: int, files: int) -> dict:
    def case(reg, art):
        key, config, manifest = art
        reg.add(REPO, config, {}, manifest=manifest)
        d = b.node(reg.host)
        return d, lambda: _pull(d, f"{reg.host}/{REPO}:{key}")
    return b.each(lambda reg: forged_config(tensors, files), case)


def case_claimed_sizes(b: Bench) -> dict:
    def case(reg, art):
        key, config, blobs = art
        reg.add(REPO, config, blobs)
        (layer,) = blobs
        reg.short = {layer: 100}
        d = b.node(reg.host, args=("--capacity", "100MiB"))
        with d.client() as c:
            kept = {c.publish(identity(bench=f"kept{v}"), {"blocks.0.w": torch.full((6 * MiB,), float(v))}).key
                    for v in (1, 2, 3)}

        def attack() -> str:
            try:
                outcome = _pull(d, f"{reg.host}/{REPO}:{key}")
            except Exception as exc:  # noqa: BLE001 - expected: the layer never arrives
                outcome = type(exc).__name__
            with d.client() as c:
                left = {a.key for a in c.call(c.admin.ListArtifacts, pb.ListArtifactsRequest()).artifacts}
            return f"{outcome}; {len(kept & left)} of 3 unleased artifacts kept"
        return d, attack
    return b.each(lambda reg: b.source.artifact("claims", {"blocks.0.w": torch.full((10 * MiB,), 9.0)}), case)


def run_pull_cases(directory: str, *, quick: bool, bomb: int, calls: int, tensors: int) -> dict[str, Any]:
    b = Bench(directory)
    try:
        out = {
            "bomb_401": case_bomb_401(b, bomb),
            "bomb_307": case_bomb_307(b, bomb),
            "trickle": case_trickle(b, 2.0 if quick else 5.0),
            "hung_calls": case_hung(b, calls, 1.0),
            "held_64": case_hung(b, 64, 5.0 if quick else 20.0),
            "many_tensors": case_forged(b, tensors, 1),
            "many_layers": case_forged(b, 10_000 if not quick else 2_000, 10_000 if not quick else 2_000),
            "claimed_sizes": case_claimed_sizes(b),
        }
    finally:
        b.close()
    return {"bomb_bytes": bomb, "calls": calls, "tensors": tensors, "cases": out}


def print_pull_table(r: dict) -> None:
    print(f"\n{'pull case (hostile registry)':30} {'lookup p50/p99 ms':>19} {'baseline':>15} {'fail':>4} "
          f"{'peak RSS MiB':>13} {'thr':>4} {'fds':>4} {'s':>6}  outcome")
    for name, c in r["cases"].items():
        lm, bl = c["lookup_ms"], c["baseline_lookup_ms"]
        fails = sum(c["lookup_errors"].values())
        rss = f"{c['peak_rss_mib_before']}->{c['peak_rss_mib_after']}"
        print(f"{name:30} {lm['p50']:8.2f}/{lm['p99']:<10.2f} {bl['p50']:6.2f}/{bl['p99']:<8.2f} {fails:>4} "
              f"{rss:>13} {c['threads']:>4} {c['fds']:>4} {c['seconds']:6.2f}  {str(c['outcome'])[:90]}")


__all__ = ["print_pull_table", "run_pull_cases"]
