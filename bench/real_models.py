"""A FLUX-shaped diffusers transformer through HWR: the library's own
``from_pretrained`` vs HWR cold, warm and ``host_plan="auto"``, in one run,
real processes, against a daemon started with DEFAULT settings (a root and
sockets for the run; no --source-root, no config).

The model is the real ``diffusers.FluxTransformer2DModel`` class with a
FLUX-like shape (head dim 128, joint attention dim 4096, two block stacks)
scaled down in depth and width to about 1 GiB of bf16 weights (``--big``:
about 4 GiB), random weights saved with ``save_pretrained`` in shards, once
as a bf16 checkpoint (how FLUX ships) and once as fp32 (how many fine-tunes
and other families ship); the runtime is bf16 either way. Each
row is a separate worker process (``python bench/real_models.py --worker``)
that imports its stack before its clock starts, then:

- ``library``: ``FluxTransformer2DModel.from_pretrained(dir, torch_dtype=bf16)``,
  the library's call itself (then ``eval().requires_grad_(False)``, as HWR's
  models are: on the CPU a bf16 weight that requires grad takes a ~4x slower
  linear kernel): what users do today; page cache hot, and cold
  (the checkpoint's files evicted with fadvise, as ``bench/startup.py`` does);
- ``hwr cold``: ``dlo_runtime.from_pretrained`` on an empty store: canonical
  load, then publish-after-load (``publish_s``);
- ``hwr warm``: the same call again: LOCAL_HIT, restored from the lease;
- ``hwr auto``: ``host_plan="auto"``: the checkpoint's own mapping where its
  layout is the runtime's (a same-dtype checkpoint: outcome
  CHECKPOINT_MMAP), else HWR as above;
- 4 workers at once, library and warm: the sum of their PSS above the PSS of
  a process that imported the same stack and holds no model.

``library``, ``hwr warm`` and ``hwr auto`` run ``--repeat`` times each,
interleaved, every run a fresh process; the table gives medians (min in the
JSON): a shared machine's noise moves single runs by more than the
differences measured here.

Every worker runs one forward pass on fixed inputs; ``outputs_equal`` says
whether its output is bitwise the library row's, and ``first_output_s``
(startup + that forward) is reported beside ``startup_s``: a load that maps
the checkpoint lazily (the library, HWR warm and checkpoint-mmap alike) pays
its page faults in the first forward instead. On a CPU-only node the model
stays resident (``device=None``); the DLO row (``--dlo``) streams blocks
through the CPU backend. diffusers' ``enable_group_offload`` peer needs CUDA
and is not run here.

    python bench/real_models.py            # ~1 GiB
    python bench/real_models.py --big      # ~4 GiB as well (needs ~24 GiB RAM)
    python bench/real_models.py --quick    # a tiny model, 2 workers: what the test runs

Prints a table, writes JSON (default bench/results/real_models.json) and a
PNG beside it when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench.common import private_bytes_of, result_path, save_result  # noqa: E402

GIB = 1 << 30
#: 4 concurrent library workers are skipped above this much private memory
#: (4 x the runtime model), as bench/startup.py does for its ordinary workers.
LIBRARY4_BUDGET = 6 * GIB

#: name -> FluxTransformer2DModel config (FLUX.1: 19 + 38 blocks of width 3072).
SHAPES = {
    "1GiB": dict(patch_size=1, in_channels=64, num_layers=3, num_single_layers=7, attention_head_dim=128,
                 num_attention_heads=12, joint_attention_dim=4096, pooled_projection_dim=768,
                 axes_dims_rope=[16, 56, 56]),
    # What the test runs (tests/e2e/test_real_models_bench.py): the script end to end.
    "quick": dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=32,
                  num_attention_heads=2, joint_attention_dim=128, pooled_projection_dim=64,
                  axes_dims_rope=[8, 12, 12]),
    "4GiB": dict(patch_size=1, in_channels=64, num_layers=3, num_single_layers=8, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                 axes_dims_rope=[16, 56, 56]),
}


# -- the worker process ----------------------------------------------------------------


def _inputs(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    img, txt = 16, 8  # a short sequence: the forward proves parity, it is not the benchmark
    return {"hidden_states": torch.randn(1, img, cfg["in_channels"], generator=g).to(torch.bfloat16),
            "encoder_hidden_states": torch.randn(1, txt, cfg["joint_attention_dim"], generator=g).to(torch.bfloat16),
            "pooled_projections": torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(torch.bfloat16),
            "timestep": torch.tensor([0.5], dtype=torch.bfloat16),
            "img_ids": torch.randint(0, 8, (img, 3), generator=g).float(), "txt_ids": torch.zeros(txt, 3)}


def worker(args: argparse.Namespace) -> int:
    """One start; prints one JSON line; holds until stdin closes."""
    import torch
    # Imported before the clock, as a serving process has them: diffusers
    # imports a model class lazily on first attribute access (~2 s here).
    from diffusers import FluxTransformer2DModel

    import dlo_runtime
    import hwr_client.session  # noqa: F401
    from dlo_runtime.worker import pss_kib

    result: dict[str, Any] = {"pid": os.getpid(), "mode": args.mode, "host_plan": args.host_plan}
    if args.mode == "baseline":
        result["pss_kib"] = pss_kib()
        print(json.dumps(result), flush=True)
        sys.stdin.read()
        return 0
    t0, c0 = time.perf_counter(), time.process_time()
    if args.mode == "library":
        # The library's own call, exactly what a user writes (no HWR code on
        # the clock), then inference mode as HWR's models are: on the CPU,
        # torch's bf16 linear takes a ~4x slower path for weights that
        # require grad (no_grad or not), which would slow every library
        # forward for a reason that has nothing to do with loading.
        model = FluxTransformer2DModel.from_pretrained(args.model, torch_dtype=torch.bfloat16)
        model.eval().requires_grad_(False)
        result["startup_s"] = round(time.perf_counter() - t0, 4)
        result.update(outcome="LIBRARY", bytes_materialized=private_bytes_of(model), producer_calls=1, publish_s=0.0,
                      seconds={}, notes=[])
        loaded = None
    else:
        loaded = dlo_runtime.from_pretrained(args.model, mode=args.mode, socket=args.socket, progress=False,
                                             device=args.device, host_plan=args.host_plan)
        result["startup_s"] = round(time.perf_counter() - t0, 4)
        model, rep = loaded.model, loaded.report
        result.update(outcome=str(loaded.outcome), bytes_materialized=rep.bytes_materialized,
                      producer_calls=rep.producer_calls, publish_s=(rep.seconds.get("publish", 0.0)),
                      seconds=rep.seconds, notes=rep.notes, host_plan_taken=rep.host_plan)
    # CPU seconds of this process (every thread) beside the wall clock: on a
    # shared machine other jobs stretch the wall clock of every row, the
    # CPU this start spent much less.
    result["startup_cpu_s"] = round(time.process_time() - c0, 4)
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    t1, c1 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model(**_inputs(cfg)).sample
    result["forward_s"] = round(time.perf_counter() - t1, 4)
    result["first_output_s"] = round(result["startup_s"] + result["forward_s"], 4)
    result["first_output_cpu_s"] = round(result["startup_cpu_s"] + time.process_time() - c1, 4)
    result["output_sha256"] = hashlib.sha256(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    _cold_publication(loaded, result, t0)
    print(json.dumps(result), flush=True)
    try:
        sys.stdin.read()  # the parent reads every worker's PSS, then closes stdin
    finally:
        if loaded is not None:
            loaded.close()
    return 0


def _cold_publication(loaded: Any, result: dict[str, Any], t0: float) -> None:
    """A cold row: the publication runs in the background after the start
    returned; once the first output is measured, wait for it (the next row
    must find the artifact) and report it apart: ``publish_s`` its own
    seconds, ``published_after_s`` from the start's clock to its end."""
    if loaded is None or loaded.publication is None:
        return
    pub = loaded.wait_published()
    result.update(publish_s=pub["seconds"], publish_state=pub["state"], publish_transport=pub["transport"],
                  published_after_s=round(time.perf_counter() - t0, 4))


def cold_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size and checkpoint dtype: the cold start's first output against
    the library's (hot page cache, same run) and the targets (fp32
    checkpoint: at most 1.1 x; bf16: at most the library + 0.3 s)."""
    out = []
    for res in results:
        lib, cold = res["rows"]["library"], res["rows"]["hwr cold"]
        lib_first, cold_first = lib["startup_s"] + lib["forward_s"], cold["startup_s"] + cold["forward_s"]
        fp32 = res["checkpoint_dtype"] == "float32"
        target = 1.1 * lib_first if fp32 else lib_first + 0.3
        out.append({"shape": res["shape"], "checkpoint_dtype": res["checkpoint_dtype"],
                    "library_first_output_s": round(lib_first, 4), "cold_first_output_s": round(cold_first, 4),
                    "ratio": round(cold_first / lib_first, 3), "delta_s": round(cold_first - lib_first, 4),
                    "target": "<= 1.1 x library" if fp32 else "<= library + 0.3 s", "target_s": round(target, 4),
                    "met": cold_first <= target, "resolve_s": cold.get("seconds", {}).get("resolve"),
                    "publish_s": cold.get("publish_s"), "publish_state": cold.get("publish_state"),
                    "published_after_s": cold.get("published_after_s"),
                    "next_start": res["rows"]["hwr warm"]["outcome"],
                    "next_start_equal": res["rows"]["hwr warm"]["outputs_equal"]})
    return out


def print_cold_rows(rows: list[dict[str, Any]]) -> None:
    from hwr_client.cli.common import print_table

    print()
    print_table([[r["shape"], r["checkpoint_dtype"], f"{r['library_first_output_s']:.3f}",
                  f"{r['cold_first_output_s']:.3f}", f"{r['ratio']}x", f"{r['delta_s']:+.3f}", r["target"],
                  "met" if r["met"] else "NOT met", r["resolve_s"], r["publish_s"], r["publish_state"],
                  f"{r['next_start']} (equal: {r['next_start_equal']})"] for r in rows],
                ["size", "checkpoint", "library first output s", "cold first output s", "ratio", "delta s",
                 "target", "", "resolve s", "publish s (background)", "publication", "next start"])
# -- the parent -------------------------------------------------------------------------


def _workers() -> Any:
    from hwr_client.cli.workers import WorkerProcesses

    class Workers(WorkerProcesses):
        """WorkerProcesses running this script's worker instead of the tiny-dit one."""

        def spawn(self, checkpoint: str, mode: str, socket: str | None, *, device: str | None = None,
                  host_plan: str = "hwr", **_: Any) -> Any:
            import subprocess

            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode, "--model", checkpoint,
                   "--host-plan", host_plan]
            if socket:
                cmd += ["--socket", socket]
            if device:
                cmd += ["--device", device]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            proc.t0 = time.perf_counter()  # type: ignore[attr-defined]
            self.procs.append(proc)
            return proc

    return Workers()


def build_checkpoint(workdir: str, shape: str, dtype: str) -> str:
    """The FLUX-shaped model with random weights (drawn in bf16), saved in
    shards as ``dtype`` (reused when already there)."""
    import torch
    from diffusers import FluxTransformer2DModel

    path = os.path.join(workdir, f"flux-{shape}-{dtype}")
    if os.path.isfile(os.path.join(path, "diffusion_pytorch_model.safetensors.index.json")):
        return path
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: half the memory, as FLUX ships
    try:
        model = FluxTransformer2DModel(**SHAPES[shape])
    finally:
        torch.set_default_dtype(old)
    model.to(getattr(torch, dtype)).save_pretrained(path, max_shard_size="256MB")
    del model
    return path


def _sum_pss(rows: list[dict[str, Any]], baseline_kib: int) -> int:
    return sum(r["pss_kib"] - baseline_kib for r in rows)


def measure(args: argparse.Namespace, workdir: str, socket: str, shape: str, ckpt_dtype: str,
            baseline_kib: int) -> dict[str, Any]:
    from startup import evict_from_page_cache, mincore_fraction, read_into_page_cache

    from dlo_runtime.pretrained import model_files

    ckpt = build_checkpoint(workdir, shape, ckpt_dtype)
    shards = list(model_files(ckpt).weights)
    nbytes = sum(os.path.getsize(p) for p in shards)
    _say(f"{shape}, {ckpt_dtype} checkpoint: {nbytes / GIB:.2f} GiB in {len(shards)} shards")
    w = _workers()
    runs: dict[str, list[dict[str, Any]]] = {"library": [], "hwr warm": [], "hwr auto": []}
    try:
        evict_from_page_cache(shards)
        residency = mincore_fraction(shards)
        lib_cold = w.group(ckpt, "library", None, 1)[0]
        lib_cold["residency_before"] = round(residency, 4)
        read_into_page_cache(shards)
        cold = w.group(ckpt, "preferred", socket, 1)[0]
        for _ in range(args.repeat):  # interleaved: the machine's noise falls on every row alike
            runs["library"].append(w.group(ckpt, "library", None, 1)[0])
            runs["hwr warm"].append(w.group(ckpt, "preferred", socket, 1)[0])
            runs["hwr auto"].append(w.group(ckpt, "preferred", socket, 1, host_plan="auto")[0])
        dlo = w.group(ckpt, "preferred", socket, 1, device="cpu")[0] if args.dlo else None
        # A same-dtype checkpoint is mapped, not copied, by the library: 4
        # workers share it. Otherwise each holds a private model.
        private = ckpt_dtype != "bfloat16"
        n = args.concurrent
        lib4 = (w.group(ckpt, "library", None, n)
                if not private or n * lib_cold_model_bytes(nbytes, ckpt_dtype) <= LIBRARY4_BUDGET else None)
        warm4 = w.group(ckpt, "preferred", socket, n)
    finally:
        w.kill_all()
    ref = runs["library"][0]["output_sha256"]
    rows = {"library": _summary(runs["library"], ref), "library (cold page cache)": _summary([lib_cold], ref),
            "hwr cold": _summary([cold], ref), "hwr warm": _summary(runs["hwr warm"], ref),
            "hwr auto": _summary(runs["hwr auto"], ref)}
    if dlo is not None:
        rows["hwr warm + DLO (cpu)"] = _summary([dlo], ref)
    lib, warm, auto = rows["library"], rows["hwr warm"], rows["hwr auto"]
    # The runtime (bf16) model's size, from the checkpoint's: a cold start of
    # a bf16 checkpoint materializes nothing (its tensors are views of the file).
    model_bytes = lib_cold_model_bytes(nbytes, ckpt_dtype)
    model_kib = model_bytes // 1024
    return {
        "shape": shape, "checkpoint_dtype": ckpt_dtype, "concurrent": args.concurrent, "config": SHAPES[shape],
        "checkpoint_bytes": nbytes, "model_bytes": model_bytes, "shards": len(shards),
        "repeat": args.repeat, "rows": rows,
        "pss4_library_kib": _sum_pss(lib4, baseline_kib) if lib4 else None,
        "pss4_warm_kib": _sum_pss(warm4, baseline_kib),
        "pss4_library_x_model": round(_sum_pss(lib4, baseline_kib) / model_kib, 3) if lib4 else None,
        "pss4_warm_x_model": round(_sum_pss(warm4, baseline_kib) / model_kib, 3),
        "outputs4_equal": all(r["output_sha256"] == ref for r in (lib4 or []) + warm4),
        "warm4_outcomes": sorted({r["outcome"] for r in warm4}),
        "speedup_warm_vs_library": round(lib["startup_s"] / warm["startup_s"], 2),
        "speedup_warm_vs_library_cold": round(rows["library (cold page cache)"]["startup_s"] / warm["startup_s"], 2),
        "vs_library": {name: _versus(lib, r) for name, r in (("hwr warm", warm), ("hwr auto", auto))},
    }


def _summary(runs: list[dict[str, Any]], ref: str) -> dict[str, Any]:
    """One row from its runs: the medians of startup and first output (and
    every value), the outcome(s), and whether every output equals ``ref``."""
    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 4)

    mid = sorted(runs, key=lambda r: r["startup_s"])[len(runs) // 2]
    return {
        "runs": len(runs), "startup_s": median("startup_s"), "first_output_s": median("first_output_s"),
        "startup_cpu_s": median("startup_cpu_s"), "first_output_cpu_s": median("first_output_cpu_s"),
        "startup_best_s": min(r["startup_s"] for r in runs), "first_output_best_s": min(r["first_output_s"] for r in runs),
        "forward_s": median("forward_s"), "startup_all": [r["startup_s"] for r in runs],
        "first_output_all": [r["first_output_s"] for r in runs], "publish_s": max(r["publish_s"] for r in runs),
        "outcome": "/".join(sorted({r["outcome"] for r in runs})), "host_plan": mid.get("host_plan_taken", ""),
        "bytes_materialized": max(r["bytes_materialized"] for r in runs),
        "producer_calls": max(r["producer_calls"] for r in runs), "seconds": mid["seconds"],
        "notes": sorted({n for r in runs for n in r["notes"]}),
        "outputs_equal": all(r["output_sha256"] == ref for r in runs), "output_sha256": mid["output_sha256"],
        "publish_state": mid.get("publish_state"), "published_after_s": mid.get("published_after_s"),
    }


def _versus(lib: dict[str, Any], row: dict[str, Any]) -> dict[str, float]:
    """A row against the library's, medians of the same run: the ratios the
    targets are stated in."""
    return {"first_output_ratio": round(row["first_output_s"] / lib["first_output_s"], 3),
            "first_output_cpu_ratio": round(row["first_output_cpu_s"] / lib["first_output_cpu_s"], 3),
            "startup_cpu_delta_ms": round(1000 * (row["startup_cpu_s"] - lib["startup_cpu_s"]), 1),
            # Best of the runs: the estimate least moved by other jobs on the machine.
            "startup_best_delta_ms": round(1000 * (row["startup_best_s"] - lib["startup_best_s"]), 1),
            "first_output_best_ratio": round(row["first_output_best_s"] / lib["first_output_best_s"], 3),
            "startup_delta_ms": round(1000 * (row["startup_s"] - lib["startup_s"]), 1),
            "startup_speedup": round(lib["startup_s"] / row["startup_s"], 2),
            "first_output_speedup": round(lib["first_output_s"] / row["first_output_s"], 2)}


def lib_cold_model_bytes(checkpoint_bytes: int, ckpt_dtype: str) -> int:
    """The bf16 runtime model's size from its checkpoint's."""
    return checkpoint_bytes // (4 if ckpt_dtype == "float32" else 2) * 2


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def print_results(results: list[dict[str, Any]]) -> None:
    from hwr_client.cli.common import print_table

    rows = []
    for res in results:
        for name, r in res["rows"].items():
            rows.append([res["shape"], res["checkpoint_dtype"], name, r["runs"], r["outcome"], f"{r['startup_s']:.3f}",
                         f"{r['first_output_s']:.3f}", f"{r['publish_s']:.3f}",
                         f"{r['bytes_materialized'] / GIB:.2f}", r["producer_calls"], r["outputs_equal"]])
    print_table(rows, ["size", "checkpoint", "path", "runs", "outcome", "startup_s (median)",
                       "first_output_s (median)", "publish_s", "materialized_GiB", "producer_calls", "outputs_equal"])
    print()
    vs = []
    for r in results:
        for name, v in r["vs_library"].items():
            vs.append([r["shape"], r["checkpoint_dtype"], name, f"{v['startup_delta_ms']:+.1f}",
                       f"{v['startup_best_delta_ms']:+.1f}", f"{v['startup_cpu_delta_ms']:+.1f}",
                       f"{v['startup_speedup']}x", f"{v['first_output_ratio']}", f"{v['first_output_best_ratio']}",
                       f"{v['first_output_cpu_ratio']}"])
    print_table(vs, ["size", "checkpoint", "path", "startup - library ms (median)", "(best)", "(CPU)",
                     "startup speedup", "first output / library (median)", "(best)", "(CPU)"])
    print()
    n = results[0]["concurrent"]
    print_table([[r["shape"], r["checkpoint_dtype"], f"{r['checkpoint_bytes'] / GIB:.2f}", f"{r['speedup_warm_vs_library']}x",
                  f"{r['speedup_warm_vs_library_cold']}x",
                  f"{r['pss4_library_x_model']}x" if r["pss4_library_x_model"] is not None else "skipped",
                  f"{r['pss4_warm_x_model']}x", r["outputs4_equal"]] for r in results],
                ["size", "checkpoint", "checkpoint GiB", "warm vs library (hot)", "warm vs library (cold cache)",
                 f"PSS {n} library / model", f"PSS {n} warm / model", f"{n} outputs equal"])


def chart(doc: dict[str, Any], path: str) -> str | None:
    """Startup seconds per path and size (PNG); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    results = doc["results"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    paths = list(results[0]["rows"])
    width = 0.8 / len(results)
    for i, res in enumerate(results):
        ax.bar([j + i * width for j in range(len(paths))], [res["rows"][p]["startup_s"] for p in paths], width,
               label=f"{res['shape']} {res['checkpoint_dtype']} ckpt")
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(paths))])
    ax.set_xticklabels(paths, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("startup seconds")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("FluxTransformer2DModel start")
    for i, res in enumerate(results):
        bx.bar([i - 0.2, i + 0.2], [res["pss4_library_x_model"] or 0.0, res["pss4_warm_x_model"]], 0.4,
               color=["tab:gray", "tab:green"])
    bx.set_xticks(range(len(results)))
    bx.set_xticklabels([f"{r['shape']}\n{r['checkpoint_dtype']} ckpt" for r in results])
    bx.set_ylabel("sum of PSS of 4 workers / model size")
    bx.set_title("4 workers: library (gray) vs HWR warm (green)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@contextlib.contextmanager
def default_daemon(workdir: str) -> Iterator[str]:
    """``hwr serve`` with its default settings (a root and sockets of its
    own for this run; no --source-root, no config), stopped on exit;
    yields the runtime socket."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc

    sockdir = tempfile.mkdtemp(prefix="hwr-bench-", dir="/tmp")  # a socket path must fit 108 bytes
    sock = os.path.join(sockdir, "hwr.sock")
    cmd = [sys.executable, "-m", "hwr_client.cli", "serve", "--root", os.path.join(workdir, "root"), "--socket", sock,
           "--admin-socket", os.path.join(sockdir, "admin.sock")]
    with open(os.path.join(workdir, "daemon.log"), "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon not serving (exit {proc.poll()}); see {workdir}/daemon.log")
            try:
                with grpc.insecure_channel(f"unix:{sock}") as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                time.sleep(0.05)
        yield sock
    finally:
        proc.terminate()  # SIGTERM: in-flight calls finish, the daemon stops cleanly
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(sockdir, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = args.workdir or tempfile.mkdtemp(prefix="hwr-bench-real-")
    os.makedirs(workdir, exist_ok=True)
    shapes = args.sizes or (["1GiB"] + (["4GiB"] if args.big else []))
    try:
        with default_daemon(workdir) as socket:
            w = _workers()
            try:
                baseline = w.group("", "baseline", None, 1)[0]["pss_kib"]
            finally:
                w.kill_all()
            results = [measure(args, workdir, socket, s, d, baseline) for s in shapes for d in args.checkpoint_dtypes]
    finally:
        if not args.workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    import diffusers
    import torch

    return {"bench": "real_models", "results": results, "baseline_pss_kib": baseline,
            "env": {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
                    "accelerate": _version("accelerate"), "cpus": os.cpu_count(), "machine": platform.machine()}}


def _version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.metadata.version(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big", action="store_true", help="also run the ~4 GiB model")
    parser.add_argument("--quick", action="store_true", help="a tiny model, fp32 checkpoint, 2 workers at once")
    parser.add_argument("--concurrent", type=int, default=4, help="workers started at once (default 4)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="fresh-process runs of library, hwr warm and hwr auto each (medians; default 5)")
    parser.add_argument("--sizes", nargs="+", choices=sorted(SHAPES), help="model sizes (overrides --big)")
    parser.add_argument("--checkpoint-dtypes", nargs="+", default=["bfloat16", "float32"],
                        help="dtypes the checkpoint is saved in (the runtime is bf16 either way)")
    parser.add_argument("--dlo", action="store_true", help="add a warm row streaming blocks with DLO on the CPU")
    parser.add_argument("--workdir", help="checkpoints and store (default: a temp dir, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the temp workdir")
    parser.add_argument("--out", default=result_path("real_models.json"))
    # worker-process flags
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--host-plan", default="hwr", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.sizes, args.checkpoint_dtypes, args.concurrent, args.repeat = ["quick"], ["float32"], 2, 2
    doc = run(args)
    doc["cold"] = cold_rows(doc["results"])
    print_results(doc["results"])
    print_cold_rows(doc["cold"])
    save_result(doc, args.out, sort_keys=True, quiet=True)
    png = chart(doc, os.path.splitext(args.out)[0] + ".png")
    _say(f"wrote {args.out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
