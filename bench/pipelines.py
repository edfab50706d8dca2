"""A FLUX- or SD3-shaped diffusers pipeline in small memory: every
component resident vs lazy components reloaded from disk vs lazy components
reloaded warm from HWR, side by side in one run, each in its own worker
process.

The pipeline is the real ``diffusers.FluxPipeline`` (``--pipeline flux``,
the default) or ``StableDiffusion3Pipeline`` (``--pipeline sd3``: its use
order derived from the class's ``model_cpu_offload_seq``; called with CFG,
guidance 3) with real component classes (CLIP and T5 text encoders, the
class's transformer, ``AutoencoderKL``), random weights saved with
``save_pretrained`` (the builders the tests use,
``tests.support.real_models.save_flux_pipeline`` and
``tests.support.lazy_pipelines.save_sd3_pipeline``, with real shapes where
the memory is: FLUX head dim 128, SD3 hidden 1536 = 24 heads of 64, T5
d_model 4096 = joint attention dim), tiny text and a 16x16 image, so nearly
all the memory is weights. Cases:

- ``resident``: ``FluxPipeline.from_pretrained(dir, dtype=bf16)``, what
  diffusers does by default: every component in memory for the whole run;
- ``lazy-disk``: :func:`dlo_runtime.lazy_pipeline` with ``mode="disabled"``,
  i.e. the library's own ``from_pretrained`` at every (re)load: FastVideo's
  ``lazy_module_load`` behaviour;
- ``lazy-hwr``: :func:`dlo_runtime.lazy_pipeline` through HWR on a warm
  store (a prewarm worker ran one lazy call first: canonical loads and
  publication, its seconds reported as ``prewarm``): every load is a
  LOCAL_HIT.

Each worker samples its RSS every 5 ms from a thread; the table gives the
peak above the worker's RSS after imports (``baseline``), per-call seconds,
reload seconds per component (last call) and whether the images are
bitwise equal to the resident case's.

    python bench/pipelines.py                    # FLUX, ~1.4 GiB of bf16 weights
    python bench/pipelines.py --scale small      # ~90 MiB, a quick look
    python bench/pipelines.py --checkpoint-dtype bfloat16   # + lazy-mmap (host_plan="auto")
    python bench/pipelines.py --pipeline sd3     # SD3, ~1.4 GiB of bf16 weights

Prints a table, writes JSON (default ``bench/results/pipelines.json``, or
``pipelines-sd3.json``) and a
PNG of memory over time beside it when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MIB = 1 << 20
CASES = ("resident", "lazy-disk", "lazy-hwr")
#: With a bf16 checkpoint the runtime layout is the checkpoint's: a fourth case
#: serves every component from read-only views of its mapping.
MMAP_CASE = "lazy-mmap"

_T5 = {"full": {"d_model": 4096, "d_kv": 64, "num_heads": 64, "d_ff": 10240, "num_layers": 2},
       "small": {"d_model": 1024, "d_kv": 64, "num_heads": 16, "d_ff": 4096, "num_layers": 2}}
#: pipeline -> scale -> (T5 overrides, transformer overrides, checkpoint dtype)
SCALES: dict[str, dict[str, tuple[dict[str, Any], dict[str, Any], str]]] = {
    # T5: 2 layers of d_model 4096 (FLUX's and SD3's), ~0.6 GiB bf16; transformer:
    # 8 heads of 128 (inner 1024), 6 + 12 blocks, ~0.8 GiB bf16.
    "flux": {"full": (_T5["full"], {"attention_head_dim": 128, "num_attention_heads": 8, "num_layers": 6,
                                    "num_single_layers": 12, "axes_dims_rope": [16, 56, 56]}, "float32"),
             "small": (_T5["small"], {"attention_head_dim": 64, "num_attention_heads": 4, "num_layers": 2,
                                      "num_single_layers": 4, "axes_dims_rope": [8, 28, 28]}, "float32")},
    # SD3 medium's transformer width (24 heads of 64 = 1536), 5 of its 24 joint
    # blocks, ~0.8 GiB bf16.
    "sd3": {"full": (_T5["full"], {"attention_head_dim": 64, "num_attention_heads": 24, "num_layers": 5,
                                   "caption_projection_dim": 1536, "patch_size": 2}, "float32"),
            "small": (_T5["small"], {"attention_head_dim": 64, "num_attention_heads": 4, "num_layers": 2,
                                     "caption_projection_dim": 256, "patch_size": 2}, "float32")},
}


def _run_pipe(pipeline: str, pipe: Any) -> Any:
    """One call: FLUX as the tests run it; SD3 with CFG (guidance 3)."""
    if pipeline == "sd3":
        from tests.support.lazy_pipelines import run_sd3_pipeline

        return run_sd3_pipeline(pipe, guidance_scale=3.0)
    from tests.support.real_models import run_flux_pipeline

    return run_flux_pipeline(pipe)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler(threading.Thread):
    """RSS every ``period`` seconds: (seconds since start, bytes)."""

    def __init__(self, period: float = 0.005):
        super().__init__(daemon=True)
        self.period, self.samples, self.t0 = period, [], time.perf_counter()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.samples.append((time.perf_counter() - self.t0, _rss()))
            time.sleep(self.period)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def worker(args: argparse.Namespace) -> int:
    """One case in this process; writes its JSON and images to ``args.out``."""
    import torch
    from diffusers import DiffusionPipeline

    import dlo_runtime

    sampler = Sampler()
    sampler.start()
    time.sleep(0.05)
    baseline = _rss()
    marks: list[tuple[float, str]] = [(sampler.now(), "start")]
    t = time.perf_counter()
    lazy = None
    if args.case == "resident":
        pipe = DiffusionPipeline.from_pretrained(args.pipe, dtype=torch.bfloat16)
    else:
        mode = "disabled" if args.case == "lazy-disk" else "preferred"
        lazy = dlo_runtime.lazy_pipeline(args.pipe, mode=mode, socket=args.socket,
                                         host_plan="auto" if args.case == MMAP_CASE else None)
        pipe = lazy.pipe
    build_s = time.perf_counter() - t
    marks.append((sampler.now(), "built"))
    calls = []
    for i in range(args.calls):
        t0 = sampler.now()
        start_rss = _rss()
        t = time.perf_counter()
        image = _run_pipe(args.pipeline, pipe)
        seconds = time.perf_counter() - t
        t1 = sampler.now()
        torch.save(image, os.path.join(args.out, f"{args.case}-{i}.pt"))
        peak = max((b for s, b in sampler.samples if t0 <= s <= t1), default=_rss())
        calls.append({"seconds": round(seconds, 4), "peak_rss_mib": round((peak - baseline) / MIB, 1),
                      "added_in_call_mib": round((peak - start_rss) / MIB, 1)})
        marks.append((t1, f"call {i + 1}"))
    sampler.stop()
    doc: dict[str, Any] = {"case": args.case, "build_s": round(build_s, 4),
                           "baseline_rss_mib": round(baseline / MIB, 1),
                           "calls": calls, "marks": marks,
                           "samples": [(round(s, 4), round((b - baseline) / MIB, 1)) for s, b in sampler.samples[::4]]}
    if lazy is not None:
        doc["report"] = lazy.report
        lazy.close()
    else:
        doc["component_bytes"] = {n: sum(p.nbytes for p in m.parameters()) for n, m in pipe.components.items()
                                  if isinstance(m, torch.nn.Module)}
    with open(os.path.join(args.out, f"{args.case}.json"), "w") as f:
        json.dump(doc, f)
    return 0


def build(workdir: str, pipeline: str, scale: str, dtype: str | None) -> str:
    import torch

    from tests.support.lazy_pipelines import save_sd3_pipeline
    from tests.support.real_models import save_flux_pipeline

    t5, tr, default = SCALES[pipeline][scale]
    dtype = dtype or default
    path = os.path.join(workdir, f"{pipeline}-pipeline-{scale}-{dtype}")
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    # One shard per component: a block cut across shards is not one range
    # (the checkpoint-mmap preflight refuses it).
    save = save_sd3_pipeline if pipeline == "sd3" else save_flux_pipeline
    save(path, t5=t5, transformer=tr, shard="4GB", save_dtype=getattr(torch, dtype))
    return path


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from hwr_client.cli.workers import daemon_for

    workdir = args.workdir or tempfile.mkdtemp(prefix="hwr-bench-pipes-")
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "out")
    os.makedirs(out, exist_ok=True)
    try:
        t = time.perf_counter()
        pipe_dir = build(workdir, args.pipeline, args.scale, args.checkpoint_dtype)
        dtype = args.checkpoint_dtype or SCALES[args.pipeline][args.scale][2]
        cases = CASES + ((MMAP_CASE,) if dtype == "bfloat16" else ())
        print(f"built {pipe_dir} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        args.socket = None
        results = {}
        with daemon_for(args, workdir) as socket:
            # The store is warm before the measured run, as on a node that
            # served this pipeline before (or ran `hwr prewarm --model`): one
            # lazy call publishes every component (its cold seconds reported).
            pre = os.path.join(out, "prewarm")
            os.makedirs(pre, exist_ok=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--case", "lazy-hwr", "--pipe",
                            pipe_dir, "--socket", socket, "--out", pre, "--calls", "1", "--pipeline", args.pipeline],
                           check=True,
                           env={**os.environ, "PYTHONPATH": REPO})
            with open(os.path.join(pre, "lazy-hwr.json")) as f:
                prewarm = json.load(f)
            for case in cases:
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--case", case, "--pipe", pipe_dir,
                       "--socket", socket, "--out", out, "--calls", str(args.calls), "--pipeline", args.pipeline]
                subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": REPO})
                with open(os.path.join(out, f"{case}.json")) as f:
                    results[case] = json.load(f)
        ref = [torch.load(os.path.join(out, f"resident-{i}.pt")) for i in range(args.calls)]
        for case, res in results.items():
            res["outputs_equal"] = all(torch.equal(torch.load(os.path.join(out, f"{case}-{i}.pt")), ref[i])
                                       for i in range(args.calls))
    finally:
        if not args.workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    sizes = results["resident"]["component_bytes"]
    import diffusers

    cold = {n: {"seconds": r["load_seconds"][0], "outcome": r["outcomes"][0]}
            for n, r in prewarm["report"]["components"].items() if r["load_seconds"]}
    return {"bench": "pipelines", "pipeline": args.pipeline, "scale": args.scale, "calls": args.calls,
            "results": results, "prewarm": cold, "checkpoint_dtype": args.checkpoint_dtype or
            SCALES[args.pipeline][args.scale][2],
            "component_mib": {n: round(b / MIB, 1) for n, b in sizes.items()},
            "env": {"python": platform.python_version(), "torch": torch.__version__,
                    "diffusers": diffusers.__version__, "cpus": os.cpu_count(), "machine": platform.machine()}}


def summary(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case: peak per call, seconds per call, reloads."""
    sizes = doc["component_mib"]
    largest, total = max(sizes.values()), sum(sizes.values())
    rows = []
    for case, res in doc["results"].items():
        row = {"case": case, "peak_mib": [c["peak_rss_mib"] for c in res["calls"]],
               "seconds": [c["seconds"] for c in res["calls"]], "outputs_equal": res["outputs_equal"],
               "added_mib": [c["added_in_call_mib"] for c in res["calls"]],
               # The first call is what a short-lived worker serves (often its only one).
               "peak_first_x_largest": round(res["calls"][0]["peak_rss_mib"] / largest, 3),
               "peak_last_x_largest": round(res["calls"][-1]["peak_rss_mib"] / largest, 3),
               "peak_last_x_sum": round(res["calls"][-1]["peak_rss_mib"] / total, 3)}
        if "report" in res:
            comps = res["report"]["components"]
            row["reload_s"] = {n: r["load_seconds"][-1] for n, r in comps.items() if r["load_seconds"]}
            row["outcomes"] = {n: r["outcomes"][-1] for n, r in comps.items() if r["outcomes"]}
            row["bytes_materialized_last"] = {n: r["bytes_materialized"][-1] for n, r in comps.items()
                                              if r["bytes_materialized"]}
            row["plans"] = {n: r["plan"] for n, r in comps.items()}
        rows.append(row)
    disk = next(r for r in rows if r["case"] == "lazy-disk")
    for r in (r for r in rows if "reload_s" in r):
        r["transformer_reload_speedup"] = round(disk["reload_s"]["transformer"] / max(r["reload_s"]["transformer"],
                                                                                      1e-9), 1)
    return rows


def print_table(doc: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    sizes = doc["component_mib"]
    print(f"components (MiB bf16): {sizes}; largest {max(sizes.values())}, sum {round(sum(sizes.values()), 1)}")
    print(f"{'case':<10} {'peak RSS above baseline per call (MiB)':<40} {'seconds per call':<26} "
          f"{'x largest (first, last)':>24} {'x sum':>6} {'equal':>6}  transformer reload s")
    for r in rows:
        reload = r.get("reload_s", {}).get("transformer")
        xs = f"{r['peak_first_x_largest']}, {r['peak_last_x_largest']}"
        print(f"{r['case']:<10} {str(r['peak_mib']):<40} {str(r['seconds']):<26} {xs:>24} "
              f"{r['peak_last_x_sum']:>6} {str(r['outputs_equal']):>6}  {reload if reload is not None else '-'}")
    hwr = next(r for r in rows if r["case"] == "lazy-hwr")
    for r in rows:
        if r["case"] == MMAP_CASE:
            print(f"lazy-mmap plans: {r['plans']}; reload s {r['reload_s']}; "
                  f"transformer reload {r['transformer_reload_speedup']}x faster than disk")
    print(f"prewarm (cold load + publish) seconds: {doc['prewarm']}")
    print(f"RSS a call added above its start (MiB): "
          f"{ {r['case']: r['added_mib'] for r in rows} }")
    disk = next(r for r in rows if r["case"] == "lazy-disk")
    print(f"reload seconds per component, last call: disk {disk['reload_s']}"
          f"; hwr {hwr['reload_s']} ({hwr['outcomes']}); hwr transformer reload "
          f"{hwr['transformer_reload_speedup']}x faster than disk")


def chart(doc: dict[str, Any], path: str) -> str | None:
    """RSS above baseline over time, one line per case (PNG); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for case, res in doc["results"].items():
        xs, ys = zip(*res["samples"])
        ax.plot(xs, ys, label=case, linewidth=1.2)
    sizes = doc["component_mib"]
    ax.axhline(max(sizes.values()), color="grey", linestyle=":", label="largest component")
    ax.axhline(sum(sizes.values()), color="black", linestyle="--", linewidth=0.8, label="sum of components")
    ax.set_xlabel("seconds since the worker's imports")
    ax.set_ylabel("RSS above baseline (MiB)")
    ax.set_title(f"{doc['pipeline']} pipeline, {doc['calls']} calls: resident vs lazy (disk) vs lazy (HWR)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", choices=sorted(SCALES), default="flux")
    parser.add_argument("--scale", choices=["full", "small"], default="full")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--checkpoint-dtype", choices=["float32", "bfloat16"],
                        help="dtype of the saved checkpoint (default: the scale's, fp32); bfloat16 adds the "
                             "lazy-mmap case (host_plan='auto')")
    parser.add_argument("--workdir", help="pipeline, store and outputs (default: a temp dir, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the temp workdir")
    parser.add_argument("--out", help="JSON path (default: bench/results/pipelines.json, pipelines-sd3.json)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES + (MMAP_CASE,), help=argparse.SUPPRESS)
    parser.add_argument("--pipe", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    name = "pipelines.json" if args.pipeline == "flux" else f"pipelines-{args.pipeline}.json"
    args.out = args.out or os.path.join(REPO, "bench", "results", name)
    doc = run(args)
    rows = summary(doc)
    doc["summary"] = rows
    print_table(doc, rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
    png = chart(doc, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}" + (f" and {png}" if png else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
