"""Startup: ordinary loading vs cold publication vs warm start, per
checkpoint size, with output parity, node memory and transfer volume.

Everything runs in ONE invocation against a real daemon on a temporary root,
with real worker processes (``python -m dlo_runtime.worker``) on the
reference DiT (:mod:`dlo_runtime.models.tiny_dit`). For each fp32
checkpoint size:

- ``ordinary``: HWR disabled, canonical load, model resident — what a worker
  does without HWR (the checkpoint is in the page cache: ordinary's best case);
- ``ordinary (cold page cache)``: the same worker, run after the hot ones, the
  same number of times, each time after evicting only the checkpoint's files
  from the page cache (``os.sync()``, then ``posix_fadvise(DONTNEED)`` per
  file — never ``drop_caches``, which would also evict the HWR artifact and
  anything else on the node); the residency left before each run is measured
  with ``mincore`` and recorded, and a run where more than 5% stayed resident
  is flagged in the table rather than passed off as cold. This is what a
  freshly booted or memory-pressured node sees. The checkpoint is read back
  into the page cache afterwards, so the later phases see it hot as before;
- ``cold``: preferred miss — canonical load, DLO forward, then
  ``publish_after_load``; ``publish_s`` is compared with writing the same
  number of bytes to a file with fsync (``fsync_s``) on the same filesystem;
- ``warm (staging)``: preferred hit — restore from the lease, DLO forward;
  on a CUDA node a tiny registration limit forces the staging transport;
- ``warm (registered)``: CUDA only (``--device cuda``); skipped here;
- 1 and 4 workers at once: sum of PSS (``/proc/PID/smaps_rollup``) read
  while all are alive; minus per-process baselines (the same worker on a
  1 MiB model) and, for DLO workers on ``device=cpu``, minus their two
  "device" buffers (host memory here, HBM on a GPU);
- page-cache residency of the artifact's blobs (``mincore``) after the warm
  workers ran; device-buffer bytes and H2D payload per forward pass.

Targets (ratios, same run): warm ≥ 10× faster than ordinary (hot page cache,
``speedup_warm_vs_ordinary``; the cold-cache ratio,
``speedup_warm_vs_ordinary_cold``, is reported beside it) at 1 GiB and the
gap grows with size; sum of PSS of 4 warm workers ≤ 1.1 × one model above
baselines, ordinary ≈ 4×; ``publish_s ≤ 1.3 × fsync_s``.

    python bench/startup.py                # 256 MiB, 1 GiB, 4 GiB
    python bench/startup.py --big          # adds 8 GiB (needs ~20 GiB free RAM + disk)
    python bench/startup.py --quick        # 2 MiB and 8 MiB, 2 workers: what the test runs

Prints a table and writes JSON (default bench/results/startup.json) and a PNG
chart next to it (needs matplotlib, in the dev extra).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import add_daemon_args, save_result  # noqa: E402
from dlo_runtime.worker import pss_breakdown  # noqa: E402
from hwr_client.cli.workers import WorkerProcesses, daemon_for  # noqa: E402
from hwr_client.core.defaults import human, parse_size  # noqa: E402

GIB = 1 << 30
#: Skip 4 concurrent ordinary workers above this much private memory.
ORDINARY4_BUDGET = 6 * GIB
#: A "cold page cache" run with more of the checkpoint resident than this is
#: flagged as not cold (e.g. a filesystem that ignores DONTNEED, like tmpfs).
COLD_RESIDENCY_LIMIT = 0.05


def mincore_fraction(paths: list[str]) -> float:
    """Fraction of the files' pages resident in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(_map_address(mm)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            resident += sum(v & 1 for v in vec)
            total += pages
        finally:
            mm.close()
    return resident / total if total else 0.0


def _map_address(mm: mmap.mmap) -> int:
    """Start address of a read-only mmap (via a zero-copy torch view)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        view = torch.frombuffer(mm, dtype=torch.uint8, count=1)
    addr = view.data_ptr()
    del view
    return addr


def checkpoint_files(directory: str) -> list[str]:
    """Every regular file under a checkpoint directory (config, index, shards)."""
    paths = []
    for dirpath, _dirs, names in os.walk(directory):
        paths.extend(os.path.join(dirpath, n) for n in sorted(names))
    return [p for p in paths if os.path.isfile(p) and not os.path.islink(p)]


def evict_from_page_cache(paths: list[str]) -> None:
    """Drops these files' pages from the page cache, and only theirs
    (``os.sync()``, then ``POSIX_FADV_DONTNEED`` per file, as
    bench/sources.py does). Not ``/proc/sys/vm/drop_caches``: that would
    also evict the HWR artifact the warm path maps, and whatever else runs
    on the node."""
    from bench.sources import drop_page_cache

    drop_page_cache(paths, system_wide=False)


def read_into_page_cache(paths: list[str]) -> None:
    """Reads the files once so their pages are resident again."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


def write_fsync_seconds(directory: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file and fsync it (the floor any
    durable publication of those bytes pays)."""
    chunk = os.urandom(4 << 20)
    path = os.path.join(directory, f".fsync-probe-{os.getpid()}")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = f.write(chunk[: min(left, len(chunk))])
            left -= n
        f.flush()
        os.fsync(f.fileno())  # durability is what we time: the data must be on disk
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return seconds


def _parity(results: list[dict[str, Any]], reference: str) -> bool:
    return all(r.get("output_sha256") == reference for r in results)


class Bench:
    """One benchmark run: a daemon, a workdir, and the worker processes."""

    def __init__(self, args: argparse.Namespace, workdir: str, socket: str):
        self.args, self.workdir, self.socket = args, workdir, socket
        self.root = os.path.join(workdir, "root")
        self.workers = WorkerProcesses()

    def group(self, ckpt: str, mode: str, n: int, **kw: Any) -> list[dict[str, Any]]:
        socket = None if mode == "disabled" else self.socket
        return self.workers.group(ckpt, mode, socket, n, device=self.args.device, measure=pss_breakdown, **kw)

    def checkpoint(self, size: int) -> str:
        from dlo_runtime.models.tiny_dit import TinyDiTConfig, write_checkpoint

        cfg = TinyDiTConfig.for_size(size)
        path = os.path.join(self.workdir, f"ckpt-{size >> 20}MiB")
        _say(f"  writing {human(size)} checkpoint (hidden {cfg.hidden}, {cfg.depth} blocks)")
        write_checkpoint(path, cfg, seed=self.args.seed)
        return path

    def baselines(self) -> dict[str, int]:
        """PSS (KiB) of one worker on a 1 MiB model, per path."""
        ckpt = self.checkpoint(1 << 20)
        ordinary = self.group(ckpt, "disabled", 1, offload=False)[0]
        self.group(ckpt, "preferred", 1)  # publishes
        warm = self.group(ckpt, "preferred", 1)[0]
        return {"ordinary_anon_kib": ordinary["pss_anon_kib"], "warm_anon_kib": warm["pss_anon_kib"],
                "ordinary_total_kib": ordinary["pss_kib"], "warm_total_kib": warm["pss_kib"]}

    def repeat(self, ckpt: str, mode: str, first: dict[str, Any], **kw: Any) -> list[float]:
        """Startup seconds of ``--repeat`` runs (the first, plus more without
        a forward pass); the summary uses their median (the box is shared)."""
        runs = [first["startup_s"]]
        for _ in range(self.args.repeat - 1):
            runs.append(self.group(ckpt, mode, 1, forward=False, **kw)[0]["startup_s"])
        return runs

    def blobs(self, key: str) -> list[str]:
        import hwr_client

        with hwr_client.connect(self.socket) as client:
            manifest = client.lookup(key)
        return [os.path.join(self.root, "blobs", "sha256", f.blob) for f in manifest.files]

    def measure(self, size: int, base: dict[str, int]) -> dict[str, Any]:
        args, n = self.args, self.args.workers
        ckpt = self.checkpoint(size)
        # Both "hot" claims are measured, not assumed: an idle node's reclaim
        # (e.g. DAMON) may page out cold file pages between phases.
        hot_before = mincore_fraction(checkpoint_files(ckpt))
        _say("  ordinary (HWR disabled, resident)")
        ordinary = self.group(ckpt, "disabled", 1, offload=False)[0]
        reference = ordinary["output_sha256"]
        ordinary["startup_runs"] = self.repeat(ckpt, "disabled", ordinary, offload=False)
        ordinary_cold = self.ordinary_cold(ckpt)
        _say("  cold (preferred miss: canonical load, DLO forward, publish)")
        cold = self.group(ckpt, "preferred", 1)[0]
        blobs = self.blobs(cold["key"])
        artifact = sum(os.path.getsize(p) for p in blobs)
        fsync_s = write_fsync_seconds(self.root, artifact)
        staging_extra: tuple[str, ...] = ("--registration-limit-gib", "1e-9") if args.device.startswith("cuda") else ()
        warm_before = mincore_fraction(blobs)
        _say("  warm (staging), 1 worker")
        warm = self.group(ckpt, "preferred", 1, extra=staging_extra)[0]
        warm["startup_runs"] = self.repeat(ckpt, "preferred", warm, extra=staging_extra)
        registered = None
        if args.device.startswith("cuda"):
            _say("  warm (registered), 1 worker")
            registered = self.group(ckpt, "preferred", 1)[0]
        _say(f"  warm, {n} workers at once")
        warm_n = self.group(ckpt, "preferred", n, extra=staging_extra)
        residency = mincore_fraction(blobs)
        ordinary_n = None
        if n * artifact <= args.ordinary_budget:
            _say(f"  ordinary, {n} workers at once")
            ordinary_n = self.group(ckpt, "disabled", n, offload=False)
        shutil.rmtree(ckpt, ignore_errors=True)
        out = self._summary(size, artifact, fsync_s, residency, base, ordinary, ordinary_cold, cold, warm,
                            registered, warm_n, ordinary_n, reference)
        out["checkpoint_residency_before_hot"] = round(hot_before, 4)
        out["artifact_residency_before_warm"] = round(warm_before, 4)
        return out

    def ordinary_cold(self, ckpt: str) -> dict[str, Any]:
        """``--repeat`` ordinary runs, each right after evicting the checkpoint
        (and only it) from the page cache; the first one runs the forward pass
        (parity), like the hot series. Reads the checkpoint back in afterwards:
        the phases that follow (cold publication, N ordinary workers) expect it
        hot, as they did before this phase existed."""
        files = checkpoint_files(ckpt)
        runs: list[float] = []
        residency: list[float] = []
        first: dict[str, Any] | None = None
        _say(f"  ordinary (HWR disabled, resident), cold page cache, {self.args.repeat} run(s)")
        for i in range(self.args.repeat):
            evict_from_page_cache(files)
            residency.append(round(mincore_fraction(files), 4))
            r = self.group(ckpt, "disabled", 1, offload=False, **({} if i == 0 else {"forward": False}))[0]
            first = first or r
            runs.append(r["startup_s"])
        read_into_page_cache(files)
        assert first is not None
        return {"result": first, "runs": runs, "residency_before": residency,
                "residency_after_rewarm": round(mincore_fraction(files), 4)}

    def _summary(self, size, artifact, fsync_s, residency, base, ordinary, ordinary_cold, cold, warm, registered,
                 warm_n, ordinary_n, reference) -> dict[str, Any]:
        n = len(warm_n)
        # Per-worker transport buffers, bounded by two blocks each: the two
        # DLO "device" buffers (host memory on device=cpu, HBM on a GPU) and
        # the two staging slots (none with the registered transport).
        buffers = (warm["device_buffer_bytes"] if self.args.device == "cpu" else 0) + warm["staging_bytes"]
        warm_mem = sum((r["pss_artifact_kib"] + r["pss_anon_kib"]) * 1024 for r in warm_n) - n * base["warm_anon_kib"] * 1024
        warm_model = warm_mem - n * buffers
        cold_s = _median(ordinary_cold["runs"])
        cold_left = max(ordinary_cold["residency_before"])
        ord_model = (sum(r["pss_anon_kib"] for r in ordinary_n) - n * base["ordinary_anon_kib"]) * 1024 \
            if ordinary_n else None
        out = {
            "checkpoint_bytes": size, "artifact_bytes": artifact, "blocks": warm["block_copies"],
            "ordinary_s": _median(ordinary["startup_runs"]), "ordinary_runs_s": ordinary["startup_runs"],
            "ordinary_cold_s": cold_s, "ordinary_cold_runs_s": ordinary_cold["runs"],
            "checkpoint_residency_before_cold": cold_left,
            "checkpoint_residency_before_cold_runs": ordinary_cold["residency_before"],
            "checkpoint_residency_after_rewarm": ordinary_cold["residency_after_rewarm"],
            "ordinary_cold_note": None if cold_left <= COLD_RESIDENCY_LIMIT else
            f"eviction left {100 * cold_left:.0f}% of the checkpoint resident (> {100 * COLD_RESIDENCY_LIMIT:.0f}%): "
            "not a cold-page-cache figure (does this filesystem ignore POSIX_FADV_DONTNEED?)",
            "cold_s": cold["startup_s"],
            "publish_s": (cold.get("publish") or {}).get("seconds"), "fsync_s": round(fsync_s, 4),
            "warm_s": _median(warm["startup_runs"]), "warm_runs_s": warm["startup_runs"],
            "warm_n_max_s": max(r["startup_s"] for r in warm_n),
            "registered_s": registered["startup_s"] if registered else None,
            "registered_note": None if registered else "skipped: no CUDA device (registered transport is GPU only)",
            "speedup_warm_vs_ordinary": round(_median(ordinary["startup_runs"]) / _median(warm["startup_runs"]), 1),
            "speedup_warm_vs_ordinary_cold": round(cold_s / _median(warm["startup_runs"]), 1),
            "publish_over_fsync": round((cold.get("publish") or {}).get("seconds", 0) / fsync_s, 2) if fsync_s else None,
            "parity": _parity([ordinary_cold["result"], cold, warm, *warm_n, *(ordinary_n or []), *([registered] if registered else [])], reference),
            "workers": n,
            "pss_kib": {"ordinary_1": ordinary["pss_kib"], "cold_1": cold["pss_kib"], "warm_1": warm["pss_kib"],
                        f"warm_{n}": sum(r["pss_kib"] for r in warm_n),
                        f"ordinary_{n}": sum(r["pss_kib"] for r in ordinary_n) if ordinary_n else None},
            "baseline_pss_kib": base,
            "pss_breakdown_kib": {
                f"warm_{n}": {k: sum(r[k] for r in warm_n) for k in ("pss_artifact_kib", "pss_anon_kib", "pss_files_kib")},
                f"ordinary_{n}": {k: sum(r[k] for r in ordinary_n) for k in ("pss_artifact_kib", "pss_anon_kib", "pss_files_kib")}
                if ordinary_n else None},
            "warm_n_pss_above_baselines_over_model": round(warm_model / artifact, 3),
            "warm_n_pss_incl_transport_buffers_over_model": round(warm_mem / artifact, 3),
            "transport_buffer_bytes_per_worker": buffers,
            "ordinary_n_pss_above_baselines_over_model": round(ord_model / artifact, 3) if ordinary_n else None,
            "artifact_page_cache_residency": round(residency, 4),
            "bytes_materialized": {"ordinary": ordinary["bytes_materialized"], "cold": cold["bytes_materialized"],
                                   "warm": warm["bytes_materialized"]},
            "producer_calls_warm": sum(r["producer_calls"] for r in [warm, *warm_n]),
            "device_buffer_bytes": warm["device_buffer_bytes"], "staging_bytes": warm["staging_bytes"],
            "h2d_bytes_per_forward": {"cold": cold["bytes_copied_to_device"], "warm": warm["bytes_copied_to_device"],
                                      "registered": registered["bytes_copied_to_device"] if registered else None},
            "transport": {"cold": cold["transport"], "warm": warm["transport"],
                          "registered": registered["transport"] if registered else None},
            "phases": {"ordinary": ordinary["phases"], "ordinary_cold": ordinary_cold["result"]["phases"],
                       "cold": cold["phases"], "warm": warm["phases"]},
        }
        return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def print_results(results: list[dict[str, Any]]) -> None:
    header = ["checkpoint", "ordinary s", "ord cold-cache s", "cold s", "publish s", "fsync s", "warm s",
              "warm/ord", "warm/ord cold-cache", "pub/fsync", "PSS warm xN", "PSS ord xN", "resident", "H2D/fwd", "parity"]
    rows = []
    for r in results:
        n = r["workers"]
        rows.append([
            human(r["checkpoint_bytes"]), f"{r['ordinary_s']:.3f}",
            f"{r['ordinary_cold_s']:.3f}" + ("*" if r["ordinary_cold_note"] else ""),
            f"{r['cold_s']:.3f}", f"{r['publish_s']:.3f}", f"{r['fsync_s']:.3f}", f"{r['warm_s']:.3f}",
            f"{r['speedup_warm_vs_ordinary']:.1f}x", f"{r['speedup_warm_vs_ordinary_cold']:.1f}x",
            f"{r['publish_over_fsync']:.2f}", f"{r['warm_n_pss_above_baselines_over_model']:.2f}x model (n={n})",
            "-" if r["ordinary_n_pss_above_baselines_over_model"] is None
            else f"{r['ordinary_n_pss_above_baselines_over_model']:.2f}x model",
            f"{100 * r['artifact_page_cache_residency']:.0f}%", human(r["h2d_bytes_per_forward"]["warm"]),
            "yes" if r["parity"] else "NO",
        ])
    table = [header] + rows
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print("ordinary s: checkpoint in the page cache (ordinary's best case; the targets use warm/ord). "
          "ord cold-cache s: checkpoint evicted from the page cache before each run (a freshly booted or "
          "memory-pressured node); checkpoint residency before those runs: "
          + ", ".join(f"{human(r['checkpoint_bytes'])} {100 * r['checkpoint_residency_before_cold']:.1f}%"
                      for r in results))
    for r in results:
        if r["ordinary_cold_note"]:
            print(f"* {human(r['checkpoint_bytes'])}: {r['ordinary_cold_note']}")
    for r in results:
        if r["registered_note"]:
            print(f"warm (registered): {r['registered_note']}")
            break


def chart(doc: dict[str, Any], path: str) -> str | None:
    """Two panels: startup seconds per path (log scale, speedups marked) and
    sum of PSS of N workers above baselines, in models. Returns the path, or
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say("matplotlib not installed (pip install -e '.[dev]'): no chart")
        return None
    results = doc["results"]
    labels = [human(r["checkpoint_bytes"]).replace(".0 ", " ") for r in results]
    xs = range(len(results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.2))
    not_cold = any(r.get("ordinary_cold_note") for r in results)
    series = [("ordinary (hot page cache)", "ordinary_s", "#b0b0b0"),
              ("ordinary (cold page cache)" + (" *eviction incomplete" if not_cold else ""), "ordinary_cold_s",
               "#555555"),
              ("cold: load + publish", None, "#d98c2b"), ("warm start (HWR)", "warm_s", "#2b7bd9")]
    width = 0.2
    offset = (len(series) - 1) / 2
    for k, (name, field, color) in enumerate(series):
        vals = [r[field] if field else r["cold_s"] + (r["publish_s"] or 0) for r in results]
        bars = ax1.bar([x + (k - offset) * width for x in xs], vals, width, label=name, color=color)
        ax1.bar_label(bars, [f"{v:.2g}" for v in vals], fontsize=7, padding=2)
    tops = []
    for x, r in zip(xs, results):
        # Above the group's tallest bar, so it covers none of them.
        top = max(r["ordinary_s"], r["ordinary_cold_s"], r["cold_s"] + (r["publish_s"] or 0))
        tops.append(top)
        sp, spc = r["speedup_warm_vs_ordinary"], r["speedup_warm_vs_ordinary_cold"]
        ax1.annotate(f"warm {_x(sp)} faster\n(hot); {_x(spc)} (cold)", (x, top), textcoords="offset points",
                     xytext=(0, 12), ha="center", va="bottom", fontsize=8, color="#2b7bd9", fontweight="bold")
    ax1.set_yscale("log")
    low = min(min(r["warm_s"], r["ordinary_s"]) for r in results)
    ax1.set_ylim(low / 2, max(tops) * 12)
    ax1.set_xticks(list(xs), [f"{lab} fp32" for lab in labels])
    ax1.set_ylabel("seconds to ready (log scale)")
    ax1.set_title("Worker startup by checkpoint size")
    ax1.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    n = results[0]["workers"]
    ordv = [r["ordinary_n_pss_above_baselines_over_model"] or 0 for r in results]
    warmv = [r["warm_n_pss_above_baselines_over_model"] for r in results]
    b1 = ax2.bar([x - 0.2 for x in xs], ordv, 0.4, label=f"{n} ordinary workers", color="#888888")
    b2 = ax2.bar([x + 0.2 for x in xs], warmv, 0.4, label=f"{n} warm workers (HWR)", color="#2b7bd9")
    ax2.bar_label(b1, [f"{v:.2f}x" if v else "skipped (RAM)" for v in ordv], fontsize=9, padding=2)
    ax2.bar_label(b2, [f"{v:.2f}x" for v in warmv], fontsize=9, padding=2)
    ax2.axhline(1.0, color="black", lw=0.8, ls="--", label="one copy of the model")
    ax2.set_ylim(0, max([*ordv, *warmv, 1.0]) * 1.2)
    ax2.set_xticks(list(xs), [f"{lab} fp32" for lab in labels])
    ax2.set_ylabel("sum of PSS above baselines (x model size)")
    ax2.set_title(f"Host memory of {n} workers on one node")
    ax2.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False)
    fig.suptitle(f"HWR vs ordinary loading — {doc['machine']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _x(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.big:
        sizes.append(8 * GIB)
    workdir = tempfile.mkdtemp(prefix="hwr-bench-startup-", dir=args.dir)
    ns = argparse.Namespace(socket=args.socket, admin_socket=None)
    results = []
    try:
        with daemon_for(ns, workdir) as socket:
            bench = Bench(args, workdir, socket)
            try:
                _say("baselines (1 MiB model)")
                base = bench.baselines()
                for size in sizes:
                    _say(f"size {human(size)}")
                    results.append(bench.measure(size, base))
            finally:
                bench.workers.kill_all()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    machine = f"{os.cpu_count()} cores, {platform.machine()}, device={args.device}"
    return {"bench": "startup", "machine": machine, "device": args.device, "results": results,
            "page_cache": "ordinary_s: checkpoint files are in the page cache when ordinary loads (its best "
                          "case; the targets use it). ordinary_cold_s: the checkpoint's files (only them) are "
                          "evicted with posix_fadvise(DONTNEED) before each run, residency checked with mincore "
                          "(what a freshly booted or memory-pressured node sees); the checkpoint is read back "
                          "into the page cache before the later phases"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256MiB,1GiB,4GiB", help="fp32 checkpoint sizes, comma-separated")
    parser.add_argument("--big", action="store_true", help="add 8 GiB (mind RAM: ~4 GiB artifact + checkpoint)")
    parser.add_argument("--workers", type=int, default=4, help="workers started at once for the PSS rows")
    parser.add_argument("--device", default="cpu", help="DLO device: cpu, or cuda for the registered row")
    parser.add_argument("--ordinary-budget", type=parse_size, default=ORDINARY4_BUDGET,
                        help="skip N concurrent ordinary workers above N x artifact bytes (default 6GiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="ordinary (hot and cold page cache) and warm single-worker runs (median)")
    parser.add_argument("--quick", action="store_true", help="2 MiB and 8 MiB, 2 workers")
    add_daemon_args(parser, "startup", where="where checkpoints and the store live (default: system temp)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.workers, args.big, args.repeat = "2MiB,8MiB", 2, False, 1
    doc = run(args)
    save_result(doc, args.out, indent=1, sort_keys=True, quiet=True)
    print_results(doc["results"])
    png = chart(doc, os.path.splitext(args.out)[0] + ".png")
    print(f"\nJSON: {args.out}" + (f"\nchart: {png}" if png else ""))
    return 0 if all(r["parity"] for r in doc["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
