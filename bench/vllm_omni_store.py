"""vLLM-Omni's Host Weight Runtime on its own filesystem store versus on the
HWR store (dlo_runtime.integrations.vllm_omni), in one run, same producer,
same bytes, page cache hot for both:

- ``build``: ``get_or_build`` of a missing artifact (the producer writes
  every tensor into the store's writer; the store publishes it and returns
  a lease). The HWR store stages the producer's files in its scratch
  directory first (vLLM-Omni declares files one at a time; an HWR plan
  names them all before the first byte), then streams them to the daemon:
  the bytes are written twice, which this row prices.
- ``lookup``: a warm ``lookup`` → HIT with a ``HostWeightLease`` whose
  every tensor vLLM-Omni's own constructor has checked, then ``close``;
  median of ``--repeat`` in one process (as a worker resolves once).

    python bench/vllm_omni_store.py                # 1 GiB, 400 tensors
    python bench/vllm_omni_store.py --quick        # 64 MiB, 40 tensors

Prints a table and writes JSON (default bench/results/vllm_omni_store.json).
Needs the vllm-omni wheel (``pip install --no-deps vllm-omni==0.30.0``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench.common import add_daemon_args, bench_dir, result_command, save_result  # noqa: E402
from hwr_client.cli.workers import daemon_for  # noqa: E402
from hwr_client.core.defaults import human, parse_size  # noqa: E402
from tests.support import vllm_omni as vo  # noqa: E402


def tensors_of(size: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` bf16 tensors of about ``size`` bytes in all, in blocks of 10."""
    per = max(1, size // count // 2)
    g = torch.Generator().manual_seed(0)
    return {f"blocks.{i // 10}.t{i % 10}": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(count)}


def stores(api: Any, socket: str, workdir: str) -> dict[str, Any]:
    """A fresh filesystem store and a fresh HWR store, each on its own root."""
    from vllm_omni.host_weight_runtime.filesystem import FilesystemHostWeightStore, detect_storage_class

    from dlo_runtime.integrations.vllm_omni.store import HwrHostWeightStore, StoreSettings

    bound = type("Bound", (HwrHostWeightStore,), {"settings": StoreSettings(socket=socket)})
    out = {}
    for name, cls in (("vLLM-Omni filesystem store", FilesystemHostWeightStore), ("HWR store", bound)):
        root = Path(workdir) / name.split()[0].lower()
        domain = api.StorageDomainPolicy(root=root, storage_class=detect_storage_class(Path(workdir)))
        out[name] = cls(domain, api.CapacityPolicy(), api.IntegrityPolicy(), wait=api.WaitPolicy())
    return out


def measure(api: Any, store: Any, ident: Any, tensors: dict[str, torch.Tensor], repeat: int) -> dict[str, float]:
    meta = api.ValidationLevel.MANIFEST_AND_METADATA
    producer = vo.Producer(api, ident, tensors, per_file=max(1, len(tensors) // 4))
    t0 = time.perf_counter()
    built = store.get_or_build(api.BuildRequest(ident), producer, validation=meta, deadline=time.monotonic() + 600)
    build_s = time.perf_counter() - t0
    assert built.status is api.StoreStatus.BUILT, built.failure
    built.lease.close()
    laps = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        hit = store.lookup(ident, validation=meta)
        assert hit.status is api.StoreStatus.HIT, hit.failure
        assert len(hit.lease.tensors) == len(tensors)
        hit.lease.close()
        laps.append(time.perf_counter() - t0)
    return {"build_s": build_s, "lookup_ms": 1000 * statistics.median(laps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="64 MiB, 40 tensors, 3 lookups")
    add_daemon_args(parser, "vllm_omni_store", "where the roots go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.tensors, args.repeat = "64MiB", 40, 3
    api = vo.load()
    size = parse_size(args.size)
    tensors = tensors_of(size, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    rows = {}
    with bench_dir("vllm-omni", args.dir) as workdir, daemon_for(args, workdir) as socket:
        for name, store in stores(api, socket, workdir).items():
            rows[name] = measure(api, store, vo.identity(api, name=f"bench-{args.tensors}"), tensors, args.repeat)
    fs, hwr = rows["vLLM-Omni filesystem store"], rows["HWR store"]
    print(f"\nvLLM-Omni get_or_build / lookup, {human(nbytes)} in {args.tensors} tensors (page cache hot)\n")
    print(f"{'store':<28} {'build s':>9} {'build MB/s':>11} {'warm lookup ms':>15}")
    for name, r in rows.items():
        print(f"{name:<28} {r['build_s']:>9.3f} {nbytes / r['build_s'] / 1e6:>11.0f} {r['lookup_ms']:>15.2f}")
    ratios = {"build_hwr_over_fs": hwr["build_s"] / fs["build_s"], "lookup_hwr_over_fs": hwr["lookup_ms"] / fs["lookup_ms"]}
    print(f"\nHWR / filesystem: build {ratios['build_hwr_over_fs']:.2f}x the time, "
          f"warm lookup {ratios['lookup_hwr_over_fs']:.2f}x the time")
    save_result({"command": result_command("bench/vllm_omni_store.py", argv), "bytes": nbytes, "tensors": args.tensors,
                 "quick": args.quick, "rows": rows, "ratios": ratios}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
