"""DLO on a CUDA machine, in one short run (< 5 minutes at the defaults):

1. H2D GB/s of whole blocks out of a mapped artifact: pageable (the mapping
   as is), staging (two pinned slots: memcpy, then async DMA) and registered
   (the mapping registered read-only with cudaHostRegister, DMA straight
   from it); the device bytes of every method are compared for equality.
2. Registration seconds per GiB (register and unregister).
3. Per-block wall time of a layerwise-offloaded forward (registered and
   staging transports) against max(compute, copy) and compute + copy: 1.0
   of max() means copy fully hidden behind compute.

    python bench/dlo_gpu.py              # ~8 GiB artifact in /dev/shm
    python bench/dlo_gpu.py --quick      # ~0.75 GiB

Prints a table and writes JSON (default bench/results/dlo_gpu.json). Exits 2
without a CUDA device. NOTE: written without a GPU at hand; the first CUDA
run is its first run (README.md, "DLO runtime" → "What ran where").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dlo_runtime import enable_layerwise_offload, restore_model  # noqa: E402
from dlo_runtime.cuda_host import CudaRegistrar, NullRegistrar  # noqa: E402
from dlo_runtime.transports import register_regions  # noqa: E402
from hwr_client.lease import local_lease  # noqa: E402
from hwr_client.local import write_artifact  # noqa: E402
from hwr_client.tensors import build_plan  # noqa: E402

GIB = 1024**3
IDENTITY = {
    "contract": {"name": "bench-dlo-gpu", "version": 1},
    "sources": [{"name": "none", "content_id": "sha256:" + "00" * 32}],
    "representation": {"dtype": "bfloat16"},
    "layout": {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
    "producer": {"id": "bench", "version": "1"},
    "extra": {},
}


class Block(nn.Module):
    """12 * width^2 bf16 weights: qkv, proj, up, down (no bias)."""

    def __init__(self, width: int):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width, bias=False, dtype=torch.bfloat16)
        self.proj = nn.Linear(width, width, bias=False, dtype=torch.bfloat16)
        self.up = nn.Linear(width, 4 * width, bias=False, dtype=torch.bfloat16)
        self.down = nn.Linear(4 * width, width, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, width = x.shape
        heads = (t.view(tokens, width // 128, 128).transpose(0, 1) for t in self.qkv(x).chunk(3, dim=-1))
        attn = torch.nn.functional.scaled_dot_product_attention(*heads)  # 128-wide heads: flash kernels apply
        x = x + self.proj(attn.transpose(0, 1).reshape(tokens, width))
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, n: int, width: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()  # the measured work is asynchronous: wait for it
    return time.perf_counter() - t0


def _make_artifact(directory: str, n: int, width: int) -> tuple:
    """Weights generated on the GPU (fast), written as a final-layout artifact."""
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {}
    for i in range(n):
        for name, shape in (("qkv", (3 * width, width)), ("proj", (width, width)), ("up", (4 * width, width)),
                            ("down", (width, 4 * width))):
            w = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).mul_(width ** -0.5)
            sd[f"blocks.{i}.{name}.weight"] = w.to(torch.bfloat16).cpu()
    manifest, paths = write_artifact(directory, build_plan(IDENTITY, sd), sd)
    return manifest, paths


def _h2d(lease, method: str, slots: list[torch.Tensor], pinned: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
    srcs = [lease.block_bytes(i) for i in range(len(lease.blocks))]
    stream = torch.cuda.Stream()
    free = [torch.cuda.Event(), torch.cuda.Event()]

    def run():
        for i, src in enumerate(srcs):
            s, n = i % 2, src.numel()
            if method == "pageable":
                slots[s][:n].copy_(src)
            elif method == "registered":
                with torch.cuda.stream(stream):
                    slots[s][:n].copy_(src, non_blocking=True)
            else:
                # Host wait: the DMA out of this pinned slot must finish
                # before the memcpy overwrites it.
                free[s].synchronize()
                pinned[s][:n].copy_(src)
                with torch.cuda.stream(stream):
                    slots[s][:n].copy_(pinned[s][:n], non_blocking=True)
                    free[s].record(stream)

    run()  # warm-up (faults the mapping in)
    seconds = _sync_time(run)
    total = sum(s.numel() for s in srcs)
    last = srcs[-1].numel()
    return total / seconds / 1e9, slots[(len(srcs) - 1) % 2][:last].clone()


def _offload_pass(directory, manifest, paths, n, width, x, registrar, repeats) -> tuple[float, str, torch.Tensor]:
    lease = local_lease(manifest, paths)
    with torch.device("meta"):
        model = Model(n, width)
    restore_model(model, lease)
    handle = enable_layerwise_offload(model, list(model.blocks), device="cuda", source=lease, registrar=registrar)
    with torch.no_grad():
        model(x)  # warm-up
        seconds = _sync_time(lambda: [model(x) for _ in range(repeats)]) / repeats
        out = model(x).float().cpu()
    transport = handle.stats.transport
    handle.close()
    return seconds, transport, out


def run(gib: float, width: int, tokens: int, repeats: int, directory: str) -> dict:
    block_bytes = 12 * width * width * 2
    n = max(2, int(gib * GIB // block_bytes))
    t0 = time.perf_counter()
    manifest, paths = _make_artifact(directory, n, width)
    write_s = time.perf_counter() - t0
    lease = local_lease(manifest, paths)
    total = sum(b.nbytes for b in manifest.blocks)
    size = max(b.nbytes for b in manifest.blocks)
    slots = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(2)]
    pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    result: dict = {"config": {"blocks": n, "width": width, "block_bytes": size, "artifact_bytes": total,
                               "tokens": tokens, "device": torch.cuda.get_device_name(), "write_s": write_s},
                    "h2d_gbps": {}, "payload_equal": None, "registration": {}}
    payloads = {}
    for method in ("pageable", "staging"):
        result["h2d_gbps"][method], payloads[method] = _h2d(lease, method, slots, pinned)
    registrar = CudaRegistrar()
    cap = registrar.capability(torch.device("cuda", torch.cuda.current_device()))
    result["capability"] = cap.__dict__
    choice = register_regions(registrar, cap, lease.regions(), keepalive=lease)
    reg_gib = choice.registered_bytes / GIB
    if choice.ranges is not None:
        result["h2d_gbps"]["registered"], payloads["registered"] = _h2d(lease, "registered", slots, pinned)
        t0 = time.perf_counter()
        choice.ranges.unregister()
        unreg = time.perf_counter() - t0
        result["registration"] = {"gib": reg_gib, "calls": len(choice.calls),
                                  "register_s_per_gib": choice.registration_seconds / reg_gib,
                                  "unregister_s_per_gib": unreg / reg_gib}
    else:
        result["registration"] = {"skipped": choice.reason}
    ref = payloads["pageable"]
    result["payload_equal"] = all(torch.equal(ref, p) for p in payloads.values())
    lease.close()
    del slots, pinned

    with torch.device("cuda"):
        blk = Block(width)
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        blk(x)
        compute = _sync_time(lambda b=blk: [b(x) for _ in range(repeats)]) / repeats
    del blk
    offload = {}
    outs = {}
    for label, reg in (("registered", CudaRegistrar()), ("staging", NullRegistrar("bench: staging run"))):
        seconds, transport, outs[label] = _offload_pass(directory, manifest, paths, n, width, x, reg, repeats)
        gbps = result["h2d_gbps"].get(transport) or result["h2d_gbps"]["staging"]
        copy = size / (gbps * 1e9)
        per_block = seconds / n
        offload[label] = {"transport": transport, "per_block_ms": per_block * 1e3, "compute_ms": compute * 1e3,
                          "copy_ms": copy * 1e3, "over_max_compute_copy": per_block / max(compute, copy),
                          "over_sum_compute_copy": per_block / (compute + copy)}
    result["offload"] = offload
    result["output_equal_registered_vs_staging"] = bool(torch.equal(outs["registered"], outs["staging"]))
    return result


def _table(r: dict) -> str:
    c = r["config"]
    lines = [f"{c['device']}: {c['blocks']} blocks x {c['block_bytes'] / 2**20:.0f} MiB "
             f"({c['artifact_bytes'] / GIB:.2f} GiB), written in {c['write_s']:.1f}s"]
    lines.append("H2D GB/s  " + "  ".join(f"{k} {v:.2f}" for k, v in r["h2d_gbps"].items())
                 + f"   payload equal: {r['payload_equal']}")
    reg = r["registration"]
    if "skipped" in reg:
        lines.append(f"registration skipped: {reg['skipped']}")
    else:
        lines.append(f"registration {reg['register_s_per_gib']:.3f} s/GiB, unregistration "
                     f"{reg['unregister_s_per_gib']:.3f} s/GiB ({reg['calls']} calls)")
    lines.append(f"{'offload':12}{'transport':>12}{'block ms':>10}{'compute':>10}{'copy':>10}{'/max':>8}{'/sum':>8}")
    for k, o in r["offload"].items():
        lines.append(f"{k:12}{o['transport']:>12}{o['per_block_ms']:>10.2f}{o['compute_ms']:>10.2f}"
                     f"{o['copy_ms']:>10.2f}{o['over_max_compute_copy']:>8.2f}{o['over_sum_compute_copy']:>8.2f}")
    lines.append(f"output registered == staging: {r['output_equal_registered_vs_staging']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="artifact size")
    ap.add_argument("--width", type=int, default=4096, help="block width (block = 24*width^2 bytes)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--quick", action="store_true", help="~0.75 GiB, width 2048")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dlo_gpu.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dlo_gpu: no CUDA device; nothing measured (run bench/dlo_cpu.py on CPU)", file=sys.stderr)
        return 2
    if args.quick:
        args.gib, args.width, args.tokens, args.repeats = 0.75, 2048, 4096, 2
    directory = tempfile.mkdtemp(prefix="hwr-dlo-gpu-", dir=args.dir)
    try:
        result = run(args.gib, args.width, args.tokens, args.repeats, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(_table(result))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {args.out}")
    return 0 if result["payload_equal"] and result["output_equal_registered_vs_staging"] else 1


if __name__ == "__main__":
    sys.exit(main())
