"""DLO on a CUDA machine, in one short run (< 90 s with --quick):

1. H2D GB/s of whole blocks out of a mapped artifact: ``pageable`` (the
   mapping as is), ``staging`` (memcpy into two pinned slots, then async
   DMA), ``pinned`` (the DMA out of a pinned slot alone: the copy engine's
   ceiling) and ``registered`` (the mapping registered with
   cudaHostRegister, DMA straight from it) where this GPU registers a
   read-only mapping; the device bytes of every method are compared. The
   slots are the backend's own exact-size pinned buffers
   (:class:`dlo_runtime.pinned.PinnedBuffers`).
2. The model resident on the GPU (the reference a user would otherwise
   run): its forward time per block is the compute time.
3. Layerwise-offloaded forwards (``registered`` where it registers, and
   ``staging``): per-block wall time against max(compute, copy) and
   compute + copy (1.0 of max() = the copy fully hidden), the staging
   memcpy on the thread that runs the forward hooks against compute, and
   output parity against the resident model. Attention runs 4-D (B, H, T,
   D) so a fused SDPA kernel applies; the run checks that one does.

Registration seconds per GiB, cold and pre-faulted, and the Dirty pages an
unregistration leaves are bench/gpu/probe.py's (its matrix registers each
kind of mapping the machine allows).

    python bench/dlo_gpu.py              # ~8 GiB artifact in /dev/shm
    python bench/dlo_gpu.py --quick      # ~0.75 GiB

Prints a table and writes JSON (default bench/results/dlo_gpu.json). Exits 2
without a CUDA device, 1 when a check fails (``checks`` in the JSON). NOTE:
written without a GPU at hand (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import bench_dir, result_path, save_result  # noqa: E402
from dlo_runtime import enable_layerwise_offload, restore_model  # noqa: E402
from dlo_runtime.cuda_host import CudaRegistrar  # noqa: E402
from dlo_runtime.pinned import PinnedBuffers  # noqa: E402
from dlo_runtime.transports import register_regions, registration_decline_reason  # noqa: E402
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
        # 4-D (B=1, H, T, D=128): the layout the fused SDPA kernels take. A
        # 3-D input falls back to the math path (a T x T score matrix per
        # head), which inflates compute and flatters the overlap ratios.
        heads = (t.view(1, tokens, width // 128, 128).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attn = torch.nn.functional.scaled_dot_product_attention(*heads)
        x = x + self.proj(attn.transpose(1, 2).reshape(tokens, width))
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
    """GB/s of moving every block once by ``method``, and the last block's device bytes."""
    srcs = [lease.block_bytes(i) for i in range(len(lease.blocks))]
    stream = torch.cuda.Stream()
    free = [torch.cuda.Event(), torch.cuda.Event()]

    def run():
        for i, src in enumerate(srcs):
            s, n = i % 2, src.numel()
            if method == "pageable":
                slots[s][:n].copy_(src)
            elif method in ("registered", "pinned"):
                with torch.cuda.stream(stream):
                    slots[s][:n].copy_(src if method == "registered" else pinned[s][:n], non_blocking=True)
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


class X86Registrar(CudaRegistrar):
    """This GPU's registrar, answering as an x86 discrete GPU does (no
    read-only registration): the lease stages, the slots still pin."""

    def capability(self, device):
        return dataclasses.replace(super().capability(device), read_only_supported=False,
                                   uses_host_page_tables=False)


def _fused_attention_ok(blk: nn.Module, x: torch.Tensor) -> str:
    """"" when SDPA runs with the math fallback disabled, else why not."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return "torch.nn.attention unavailable: fused kernel not checked"
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            blk(x)
        torch.cuda.synchronize()  # a kernel error surfaces here, inside the check
    except RuntimeError as exc:
        return f"no fused SDPA kernel for this input: {exc}"
    return ""


def _resident(lease, n: int, width: int, x: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor, str]:
    """The model resident on the GPU: seconds per forward, output, fused-attention check."""
    with torch.device("meta"):
        model = Model(n, width)
    restore_model(model, lease)
    model.to("cuda")
    with torch.no_grad():
        model(x)  # warm-up
        fused = _fused_attention_ok(model.blocks[0], x)
        seconds = _sync_time(lambda: [model(x) for _ in range(repeats)]) / repeats
        out = model(x).float().cpu()
    del model
    torch.cuda.empty_cache()
    return seconds, out, fused


def _offload_pass(manifest, paths, n, width, x, registrar, repeats) -> dict:
    lease = local_lease(manifest, paths)
    with torch.device("meta"):
        model = Model(n, width)
    restore_model(model, lease)
    handle = enable_layerwise_offload(model, list(model.blocks), device="cuda", source=lease, registrar=registrar)
    with torch.no_grad():
        model(x)  # warm-up
        before = handle.stats
        seconds = _sync_time(lambda: [model(x) for _ in range(repeats)]) / repeats
        after = handle.stats
        out = model(x).float().cpu()
    loads = sum(b.copies for b in after.blocks) - sum(b.copies for b in before.blocks)
    row = {"transport": after.transport, "reason": after.reason, "seconds": seconds, "out": out,
           "staging_ms_per_load": 1e3 * (after.staging_seconds - before.staging_seconds) / max(1, loads),
           "pinned_host_bytes": after.pinned_host_bytes, "staging_bytes": after.staging_bytes,
           "registered_bytes": after.registered_bytes}
    handle.close()
    return row


def run(gib: float, width: int, tokens: int, repeats: int, directory: str) -> dict:
    block_bytes = 12 * width * width * 2
    n = max(2, int(gib * GIB // block_bytes))
    t0 = time.perf_counter()
    manifest, paths = _make_artifact(directory, n, width)
    write_s = time.perf_counter() - t0
    lease = local_lease(manifest, paths)
    total = sum(b.nbytes for b in manifest.blocks)
    size = max(b.nbytes for b in manifest.blocks)
    registrar = CudaRegistrar(torch.device("cuda", torch.cuda.current_device()))
    cap = registrar.capability(torch.device("cuda", torch.cuda.current_device()))
    slots = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(2)]
    pins = PinnedBuffers(registrar, cap, [size, size], pin=True, label="bench staging slots")
    result: dict = {"config": {"blocks": n, "width": width, "block_bytes": size, "artifact_bytes": total,
                               "tokens": tokens, "device": torch.cuda.get_device_name(), "write_s": write_s},
                    "capability": cap.__dict__, "decline_reason": registration_decline_reason(cap),
                    "own_buffers_decline": registration_decline_reason(cap, writable=True),
                    "slots_pinned": pins.pinned and all(b.is_pinned() for b in pins.buffers),
                    "slots_reason": pins.choice.reason, "h2d_gbps": {}}
    payloads = {}
    for method in ("pageable", "staging", "pinned"):
        result["h2d_gbps"][method], payloads[method] = _h2d(lease, method, slots, pins.buffers)
    choice = register_regions(registrar, cap, lease.regions(), keepalive=lease,
                              spans=[(int(lease.block_bytes(b.index).data_ptr()), b.nbytes) for b in manifest.blocks])
    if choice.ranges is not None:
        result["h2d_gbps"]["registered"], payloads["registered"] = _h2d(lease, "registered", slots, pins.buffers)
        choice.ranges.unregister()
    result["registration"] = {"kind": choice.kind, "reason": choice.reason}
    result["payload_equal"] = all(torch.equal(payloads["pageable"], p) for p in payloads.values())
    pins.unregister()
    del slots, pins, payloads
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    resident_s, expected, result["fused_attention"] = _resident(lease, n, width, x, repeats)
    lease.close()
    compute = resident_s / n
    result["resident"] = {"per_block_ms": compute * 1e3, "forward_ms": resident_s * 1e3}
    passes = {"staging": X86Registrar(torch.device("cuda", torch.cuda.current_device()))}
    if choice.kind == "registered":
        passes = {"registered": registrar, **passes}
    offload = {}
    for label, reg in passes.items():
        r = _offload_pass(manifest, paths, n, width, x, reg, repeats)
        out = r.pop("out")
        gbps = result["h2d_gbps"].get(label) or result["h2d_gbps"]["staging"]
        copy = size / (gbps * 1e9)
        per_block = r["seconds"] / n
        r.update(per_block_ms=per_block * 1e3, compute_ms=compute * 1e3, copy_ms=copy * 1e3,
                 over_max_compute_copy=per_block / max(compute, copy), over_sum_compute_copy=per_block / (compute + copy),
                 over_resident=r["seconds"] / resident_s, bitwise_equal_resident=bool(torch.equal(out, expected)),
                 max_abs_diff_resident=float((out - expected).abs().max()),
                 close_to_resident=bool(torch.allclose(out, expected, rtol=1e-2, atol=1e-2)),
                 staging_memcpy_over_compute=r["staging_ms_per_load"] / (compute * 1e3))
        offload[label] = r
    result["offload"] = offload
    result["hook_memcpy_over_compute"] = offload["staging"]["staging_memcpy_over_compute"]
    result["checks"] = _checks(result)
    return result


def _checks(r: dict) -> dict:
    """Named pass/fail checks; any False makes the exit status 1."""
    checks = {"payload_equal": bool(r["payload_equal"]), "fused_attention": r.get("fused_attention", "") == "",
              # Where the device pins the process's own memory, the slots must be pinned.
              "staging slots pinned": bool(r["slots_pinned"]) or bool(r["own_buffers_decline"])}
    for label, o in r["offload"].items():
        checks[f"{label} output close to resident"] = o["close_to_resident"]
        checks[f"{label} transport"] = o["transport"] == label
    if not r.get("decline_reason"):
        # The platform allows registration: it must have happened.
        checks["registered"] = r["registration"]["kind"] == "registered"
    return checks


def _table(r: dict) -> str:
    c = r["config"]
    lines = [f"{c['device']}: {c['blocks']} blocks x {c['block_bytes'] / 2**20:.0f} MiB "
             f"({c['artifact_bytes'] / GIB:.2f} GiB), written in {c['write_s']:.1f}s"]
    lines.append("H2D GB/s  " + "  ".join(f"{k} {v:.2f}" for k, v in r["h2d_gbps"].items())
                 + f"   payload equal: {r['payload_equal']}; slots pinned: {r['slots_pinned']}")
    lines.append(f"lease registration: {r['registration']['kind']} ({r['registration']['reason']})")
    lines.append(f"resident: {r['resident']['per_block_ms']:.2f} ms/block; fused attention: "
                 f"{r['fused_attention'] or 'yes'}")
    lines.append(f"{'offload':12}{'block ms':>10}{'compute':>10}{'copy':>10}{'/max':>8}{'/sum':>8}{'/resident':>10}"
                 f"{'memcpy/compute':>16}{'max|diff|':>11}")
    for k, o in r["offload"].items():
        lines.append(f"{k:12}{o['per_block_ms']:>10.2f}{o['compute_ms']:>10.2f}{o['copy_ms']:>10.2f}"
                     f"{o['over_max_compute_copy']:>8.2f}{o['over_sum_compute_copy']:>8.2f}{o['over_resident']:>10.2f}"
                     f"{o['staging_memcpy_over_compute']:>16.2f}{o['max_abs_diff_resident']:>11.2e}")
    lines.append("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r["checks"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="artifact size")
    ap.add_argument("--width", type=int, default=4096, help="block width (block = 24*width^2 bytes)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--quick", action="store_true", help="~0.75 GiB, width 2048")
    ap.add_argument("--out", default=result_path("dlo_gpu.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dlo_gpu: no CUDA device; nothing measured (run bench/dlo_cpu.py on CPU)", file=sys.stderr)
        return 2
    if args.quick:
        args.gib, args.width, args.tokens, args.repeats = 0.75, 2048, 4096, 2
    with bench_dir("dlo-gpu", args.dir) as directory:
        result = run(args.gib, args.width, args.tokens, args.repeats, directory)
    print(_table(result))
    save_result(result, args.out, indent=1, default=str)
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
