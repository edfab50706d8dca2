"""DLO on CPU: per-block copy vs compute, and copies per block, for the
final-layout path (ONE contiguous copy per block out of the mapping) versus
per-tensor copies (what a per-module offload without a packed layout does).

The device is the CPU, so "copy" is a memcpy, not PCIe: the numbers show the
cost structure (how many copies, how many bytes, how long compared with the
block's compute), not H2D bandwidth — bench/dlo_gpu.py measures that.

    python bench/dlo_cpu.py            # 16 blocks, width 1024 (~400 MiB)
    python bench/dlo_cpu.py --quick    # seconds; what the test runs

Prints a table and writes JSON (default bench/results/dlo_cpu.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import result_path, save_result  # noqa: E402
from dlo_runtime import enable_layerwise_offload, restore_model  # noqa: E402
from dlo_runtime.cuda_host import HostCapability  # noqa: E402
from hwr_client.lease import local_lease  # noqa: E402
from hwr_client.local import write_artifact  # noqa: E402
from hwr_client.tensors import build_plan  # noqa: E402

IDENTITY = {
    "contract": {"name": "bench-dlo-cpu", "version": 1},
    "sources": [{"name": "none", "content_id": "sha256:" + "00" * 32}],
    "representation": {"dtype": "float32"},
    "layout": {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
    "producer": {"id": "bench", "version": "1"},
    "extra": {},
}


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q[None], k[None], v[None])[0])
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, n: int, width: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class _MappedCpuRegistrar:
    """On CPU there is nothing to register; this stand-in lets the backend
    take its 'registered' path (copy straight from the mapping, no staging)."""

    def capability(self, device):
        return HostCapability("cpu", True, True, False, False)

    def register(self, address, nbytes, flags):
        return 0

    def unregister(self, address):
        return 0

    def clear_error(self):
        return 0


def _per_tensor_offload(model: Model) -> list[int]:
    """Per-tensor offload: each parameter copied into its own fresh tensor
    before its block runs, released after. Returns the copy counter."""
    count = [0]
    hosts = {id(p): p.data for b in model.blocks for p in b.parameters()}

    def pre(block, args):
        for p in block.parameters():
            p.data = hosts[id(p)].clone()
            count[0] += 1

    def post(block, args, out):
        for p in block.parameters():
            p.data = hosts[id(p)]

    for b in model.blocks:
        b.register_forward_pre_hook(pre)
        b.register_forward_hook(post)
    return count


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run(n_blocks: int, width: int, tokens: int, repeats: int, threads: int = 1) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    ref = Model(n_blocks, width).eval()
    x = torch.randn(tokens, width)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        manifest, paths = write_artifact(tmp, build_plan(IDENTITY, sd), sd)
        lease = local_lease(manifest, paths)
        block_bytes = lease.block_bytes(0)
        n_tensors = len(manifest.blocks[0].tensors)
        buf = torch.empty_like(block_bytes)
        copy_layout = _time(lambda: buf.copy_(block_bytes), repeats)
        views = list(lease.block_tensors(0).values())
        copy_tensor = _time(lambda: [v.clone() for v in views], repeats)
        compute = _time(lambda: ref.blocks[0](x), repeats)
        expected = ref(x)

        skel = Model(n_blocks, width).to("meta")
        restore_model(skel, lease)
        handle = enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=lease,
                                          registrar=_MappedCpuRegistrar())
        private = Model(n_blocks, width).eval()
        private.load_state_dict(ref.state_dict())
        count = _per_tensor_offload(private)
        # Round-robin passes, so load from other processes hits all three alike.
        passes = {"resident": ref, "dlo_layout": skel, "per_tensor": private}
        samples: dict[str, list[float]] = {k: [] for k in passes}
        parity = {k: bool(torch.equal(m(x), expected)) for k, m in passes.items() if k != "resident"}
        for _ in range(repeats):
            for k, m in passes.items():
                t0 = time.perf_counter()
                m(x)
                samples[k].append(time.perf_counter() - t0)
        resident, layout_pass, tensor_pass = (statistics.median(samples[k]) for k in passes)
        parity_layout, parity_tensor = parity["dlo_layout"], parity["per_tensor"]
        stats = handle.stats
        copies_layout = sum(b.copies for b in stats.blocks) / max(1, (repeats + 1) * n_blocks)
        copies_tensor = count[0] / ((repeats + 1) * n_blocks)
        handle.close()
    return {
        "config": {"blocks": n_blocks, "width": width, "tokens": tokens, "repeats": repeats,
                   "block_bytes": int(block_bytes.numel()), "tensors_per_block": n_tensors,
                   "threads": torch.get_num_threads()},
        "per_block": {
            "compute_ms": compute * 1e3,
            "copy_ms_layout_one_copy": copy_layout * 1e3,
            "copy_ms_per_tensor": copy_tensor * 1e3,
            "copies_layout": copies_layout,
            "copies_per_tensor": copies_tensor,
        },
        "pass_ms": {"resident": resident * 1e3, "dlo_layout": layout_pass * 1e3, "per_tensor": tensor_pass * 1e3},
        "ratios": {
            "per_tensor_copy_over_layout_copy": copy_tensor / copy_layout if copy_layout else None,
            "per_tensor_pass_over_layout_pass": tensor_pass / layout_pass if layout_pass else None,
            "layout_pass_over_resident": layout_pass / resident if resident else None,
            "layout_copy_over_compute": copy_layout / compute if compute else None,
        },
        "parity": {"dlo_layout": parity_layout, "per_tensor": parity_tensor},
        "transport": stats.transport,
    }


def _table(r: dict) -> str:
    c, b, p, q = r["config"], r["per_block"], r["pass_ms"], r["ratios"]
    rows = [
        f"blocks={c['blocks']} width={c['width']} tokens={c['tokens']} block={c['block_bytes'] / 2**20:.1f} MiB "
        f"({c['tensors_per_block']} tensors) threads={c['threads']}",
        f"{'':28}{'layout (1 copy)':>18}{'per-tensor':>14}",
        f"{'copies per block':28}{b['copies_layout']:>18.2f}{b['copies_per_tensor']:>14.2f}",
        f"{'copy ms per block':28}{b['copy_ms_layout_one_copy']:>18.3f}{b['copy_ms_per_tensor']:>14.3f}",
        f"{'compute ms per block':28}{b['compute_ms']:>18.3f}",
        f"{'pass ms (resident {:.1f})'.format(p['resident']):28}{p['dlo_layout']:>18.2f}{p['per_tensor']:>14.2f}",
        f"per-tensor/layout copy {q['per_tensor_copy_over_layout_copy']:.2f}x, pass {q['per_tensor_pass_over_layout_pass']:.2f}x; "
        f"layout copy/compute {q['layout_copy_over_compute']:.2f}; parity {r['parity']}",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: least sensitive to other load)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    ap.add_argument("--out", default=result_path("dlo_cpu.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.width, args.tokens, args.repeats = 4, 128, 32, 2
    result = run(args.blocks, args.width, args.tokens, args.repeats, args.threads)
    print(_table(result))
    save_result(result, args.out, indent=1)
    return 0 if all(result["parity"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
