"""DLO on a CUDA machine, in one short run (< 3 minutes with --quick):

1. H2D GB/s of whole blocks out of a mapped artifact: pageable (the mapping
   as is), staging (two pinned slots: memcpy, then async DMA) and registered
   (the mapping registered read-only with cudaHostRegister, DMA straight
   from it); the device bytes of every method are compared for equality.
   The staging row also reports the host memcpy per block: the backend runs
   it on the forward-hook thread, so it is compared
   with a block's compute time.
2. Registration of one file on disk (``--reg-gib``, default 4 GiB), cold
   (page cache dropped: the driver reads pages inside cudaHostRegister) and
   pre-faulted (MADV_POPULATE_READ from threads first): seconds per GiB of
   prefault, register and unregister, and /proc/meminfo Dirty before
   registration and right after unregistration (the driver
   releases pinned pages as dirty, which schedules writeback of every
   registered byte of a file-backed store).
3. Per-block wall time of a layerwise-offloaded forward (registered and
   staging transports) against max(compute, copy) and compute + copy: 1.0
   of max() means copy fully hidden behind compute. Attention runs 4-D
   (B, H, T, D) so a fused SDPA kernel applies; the run checks that one does.

    python bench/dlo_gpu.py              # ~8 GiB artifact in /dev/shm
    python bench/dlo_gpu.py --quick      # ~0.75 GiB

Prints a table and writes JSON (default bench/results/dlo_gpu.json). Exits 2
without a CUDA device, 1 when a check fails (``checks`` in the JSON). NOTE:
written without a GPU at hand; the first CUDA run is its first run
(README.md, "DLO runtime" → "What ran where").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import bench_dir, result_path, save_result  # noqa: E402
from dlo_runtime import enable_layerwise_offload, restore_model  # noqa: E402
from dlo_runtime.cuda_host import CudaRegistrar, NullRegistrar  # noqa: E402
from dlo_runtime.transports import register_regions, registration_decline_reason  # noqa: E402
from hwr_client.mapping import Region  # noqa: E402
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


def _h2d(lease, method: str, slots: list[torch.Tensor], pinned: list[torch.Tensor],
         memcpy_s: list[float] | None = None) -> tuple[float, torch.Tensor]:
    srcs = [lease.block_bytes(i) for i in range(len(lease.blocks))]
    stream = torch.cuda.Stream()
    free = [torch.cuda.Event(), torch.cuda.Event()]

    def run():
        if memcpy_s is not None:
            memcpy_s.clear()
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
                t0 = time.perf_counter()
                pinned[s][:n].copy_(src)
                if memcpy_s is not None:
                    memcpy_s.append(time.perf_counter() - t0)
                with torch.cuda.stream(stream):
                    slots[s][:n].copy_(pinned[s][:n], non_blocking=True)
                    free[s].record(stream)

    run()  # warm-up (faults the mapping in)
    seconds = _sync_time(run)
    total = sum(s.numel() for s in srcs)
    last = srcs[-1].numel()
    return total / seconds / 1e9, slots[(len(srcs) - 1) % 2][:last].clone()


def _meminfo_kib(field: str) -> int:
    """One /proc/meminfo field in KiB (-1 where unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _fstype(path: str) -> str:
    """Filesystem type of ``path`` (longest mount-point prefix in /proc/mounts)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and (real == fields[1] or real.startswith(fields[1].rstrip("/") + "/")) \
                        and len(fields[1]) >= len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


def _write_cold_file(path: str, nbytes: int) -> None:
    """``nbytes`` of incompressible data, durable and out of the page cache."""
    piece = os.urandom(64 * 2**20)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(piece[: min(len(piece), left)])
        f.flush()
        os.fsync(f.fileno())  # clean pages only: DONTNEED can then drop them (a cold start)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _registration_case(directory: str, gib: float, registrar: CudaRegistrar, cap) -> dict:
    """Registers one disk file cold, then pre-faulted; Dirty around each."""
    import mmap

    path = os.path.join(directory, "hwr-dlo-gpu-registration.bin")
    nbytes = int(gib * GIB) // mmap.PAGESIZE * mmap.PAGESIZE
    out: dict = {"gib": nbytes / GIB, "dir": directory, "fstype": _fstype(directory)}
    t0 = time.perf_counter()
    _write_cold_file(path, nbytes)
    out["write_s"] = time.perf_counter() - t0
    try:
        for mode in ("cold", "prefaulted"):
            with open(path, "rb") as f:
                # A fresh mapping each time: DONTNEED cannot drop pages we
                # still map, so each case needs the previous mapping gone; and
                # it cannot drop dirty pages (the previous unregistration
                # dirtied them), so write them back first.
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffer: we only take its address
                address = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
            dirty0 = _meminfo_kib("Dirty")
            choice = register_regions(registrar, cap, [Region(path, address, nbytes)], keepalive=mm,
                                      chunk_bytes=GIB, prefault_fn=None if mode == "cold" else _prefault)
            row: dict = {"kind": choice.kind, "reason": choice.reason, "dirty_before_kib": dirty0}
            if choice.ranges is not None:
                faulted = sum(sec for _, _, sec in choice.ranges.prefaults)
                t0 = time.perf_counter()
                choice.ranges.unregister()
                unreg = time.perf_counter() - t0
                dirty1 = _meminfo_kib("Dirty")
                row.update({"prefault_s_per_gib": faulted / out["gib"],
                            "prefault_how": sorted({how for _, how, _ in choice.ranges.prefaults}),
                            "register_s_per_gib": choice.registration_seconds / out["gib"],
                            "unregister_s_per_gib": unreg / out["gib"],
                            "dirty_after_unregister_kib": dirty1,
                            "dirty_delta_mib": (dirty1 - dirty0) / 1024,
                            "dirty_delta_over_registered": (dirty1 - dirty0) * 1024 / nbytes})
            mm.close()
            out[mode] = row
    finally:
        os.unlink(path)
    return out


def _prefault(address: int, nbytes: int) -> str:
    from dlo_runtime.cuda_host import prefault

    return prefault(address, nbytes)


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


def run(gib: float, width: int, tokens: int, repeats: int, directory: str, reg_gib: float = 0.0,
        disk_dir: str | None = None) -> dict:
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
    memcpy_s: list[float] = []
    for method in ("pageable", "staging"):
        result["h2d_gbps"][method], payloads[method] = _h2d(lease, method, slots, pinned,
                                                             memcpy_s if method == "staging" else None)
    result["staging_memcpy_ms_per_block"] = 1e3 * sum(memcpy_s) / max(1, len(memcpy_s))
    registrar = CudaRegistrar()
    cap = registrar.capability(torch.device("cuda", torch.cuda.current_device()))
    result["capability"] = cap.__dict__
    result["decline_reason"] = registration_decline_reason(cap)
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
    if reg_gib > 0:
        result["registration_disk"] = _registration_case(disk_dir or directory, reg_gib, registrar, cap)

    with torch.device("cuda"):
        blk = Block(width)
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        blk(x)
        result["fused_attention"] = _fused_attention_ok(blk, x)
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
    result["hook_memcpy_over_compute"] = result["staging_memcpy_ms_per_block"] / (compute * 1e3)
    result["checks"] = _checks(result)
    return result


def _checks(r: dict) -> dict:
    """Named pass/fail checks; any False makes the exit status 1."""
    checks = {"payload_equal": bool(r["payload_equal"]),
              "output_equal_registered_vs_staging": bool(r["output_equal_registered_vs_staging"]),
              "fused_attention": r.get("fused_attention", "") == ""}
    if not r.get("decline_reason"):
        # The platform allows registration: it must have happened.
        checks["registered"] = "skipped" not in r["registration"] and r["offload"]["registered"]["transport"] == "registered"
        disk = r.get("registration_disk")
        if disk:
            checks["disk_registration"] = all(disk[m]["kind"] == "registered" for m in ("cold", "prefaulted"))
    return checks


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
    lines.append(f"staging memcpy on the hook thread: {r['staging_memcpy_ms_per_block']:.2f} ms/block "
                 f"= {r['hook_memcpy_over_compute']:.2f} x compute; fused attention: "
                 f"{r['fused_attention'] or 'yes'}")
    disk = r.get("registration_disk")
    if disk:
        lines.append(f"registration of {disk['gib']:.2f} GiB on {disk['fstype']} ({disk['dir']}):")
        for mode in ("cold", "prefaulted"):
            d = disk[mode]
            if d["kind"] != "registered":
                lines.append(f"  {mode:11} {d['kind']}: {d['reason']}")
                continue
            lines.append(f"  {mode:11} prefault {d['prefault_s_per_gib']:.3f} + register {d['register_s_per_gib']:.3f} "
                         f"s/GiB, unregister {d['unregister_s_per_gib']:.3f} s/GiB; Dirty +{d['dirty_delta_mib']:.0f} MiB "
                         f"after unregister ({d['dirty_delta_over_registered']:.2f} of registered)")
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
    ap.add_argument("--reg-gib", type=float, default=4.0, help="disk-file registration case size (0: skip)")
    ap.add_argument("--disk-dir", default=None,
                    help="directory on a disk filesystem for the registration case (default: the --out directory)")
    ap.add_argument("--out", default=result_path("dlo_gpu.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dlo_gpu: no CUDA device; nothing measured (run bench/dlo_cpu.py on CPU)", file=sys.stderr)
        return 2
    if args.quick:
        args.gib, args.width, args.tokens, args.repeats = 0.75, 2048, 4096, 2
    # The registration case writes its file next to the results: make the directory first.
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    disk_dir = args.disk_dir or os.path.dirname(os.path.abspath(args.out))
    with bench_dir("dlo-gpu", args.dir) as directory:
        result = run(args.gib, args.width, args.tokens, args.repeats, directory, args.reg_gib, disk_dir)
    print(_table(result))
    save_result(result, args.out, indent=1, default=str)
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
