"""Publication throughput: ordered vs unordered against the raw limits of the
same machine, measured in ONE run.

Artifact: SIZE bytes in BLOCKS blocks (two bf16 tensors each) plus a small
base file, published through the real daemon (``hwr serve`` on temp sockets,
started the way tests/daemon.py does) with the default 512 MiB file target.

- ``raw_write_fsync``: the same bytes written to files of the same sizes on
  the same filesystem, each fsynced (what `cp` + `sync` would cost);
- ``sha256_1core``: hashlib SHA-256 over the same bytes on one core;
- ``ordered``: ``client.publish(..., ordered=True)``: hash while writing,
  background fsync, zero read-back;
- ``unordered``: ``client.publish(..., ordered=False)``: shuffled chunks,
  pwrite, read-back hashing at commit.

Also reported, from /proc/<pid>/io during each publication: the daemon's
``read_bytes`` (reads that reached the block device; the read-back of a
just-written file mostly hits the page cache, so this is ~0 for both modes)
and ``rchar`` (bytes through every read syscall: ~0 for ordered, the whole
payload for unordered's read-back); and the daemon's peak RSS (VmHWM).
Target: ordered >= 0.8 x min(raw_write_fsync, sha256_1core).

    python bench/publish.py            # 2 GiB, 40 blocks
    python bench/publish.py --quick    # 128 MiB, seconds; what the test runs

Prints a table and writes JSON (default bench/results/publish.json).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from hwr_client.core.plan import check_plan  # noqa: E402
from hwr_client.tensors import build_plan, iter_payload
from hwr_client.core.defaults import parse_size  # noqa: E402
from bench.common import add_artifact_args, bench_dir, result_command, save_result  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402

MB = 1e6


def make_tensors(size: int, blocks: int) -> dict[str, torch.Tensor]:
    """``blocks`` blocks of ~size/blocks bytes (weight + bias, bf16, random
    bits so nothing compresses), plus a small embedding."""
    per = size // blocks // 2  # bytes per block, bf16
    gen = torch.Generator().manual_seed(0)
    out = {"embed.weight": torch.randint(-(2**15), 2**15, (4096,), dtype=torch.int16, generator=gen).view(torch.bfloat16)}
    for i in range(blocks):
        w = torch.randint(-(2**15), 2**15, (per - 1024,), dtype=torch.int16, generator=gen)
        out[f"blocks.{i}.weight"] = w.view(torch.bfloat16)
        out[f"blocks.{i}.bias"] = torch.randint(-(2**15), 2**15, (1024,), dtype=torch.int16, generator=gen).view(
            torch.bfloat16)
    return out


def identity(tag: str) -> dict:
    """The identity document of a benchmark artifact tagged ``tag``."""
    return {
        "contract": {"name": "bench", "version": 1},
        "sources": [{"name": "model.safetensors", "content_id": "sha256:" + "cd" * 32}],
        "representation": {"dtype": "bfloat16"},
        "layout": {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
        "producer": {"id": "bench", "version": "1"},
        "extra": {"run": tag, "t": time.time_ns()},
    }


def raw_write_fsync(directory: str, tensors: dict[str, torch.Tensor]) -> tuple[float, int]:
    """Writes the plan's files (header + payload) with plain write + fsync."""
    checked = check_plan(build_plan(identity("raw"), tensors))
    total = 0
    t0 = time.perf_counter()
    for i, lay in enumerate(checked.layouts):
        path = os.path.join(directory, f"raw-{i}.safetensors")
        with open(path, "wb", buffering=0) as f:
            f.write(lay.header)
            for _, data in iter_payload(lay, tensors, 4 << 20):
                f.write(data)
            os.fsync(f.fileno())
        total += lay.file_size
    seconds = time.perf_counter() - t0
    for i in range(len(checked.layouts)):
        os.unlink(os.path.join(directory, f"raw-{i}.safetensors"))
    return seconds, total


def sha_1core(tensors: dict[str, torch.Tensor]) -> tuple[float, int]:
    """SHA-256 of the tensors' bytes on one core: (seconds, bytes), the hashing bound."""
    from hwr_client.tensors import tensor_bytes

    h, total = hashlib.sha256(), 0
    t0 = time.perf_counter()
    for t in tensors.values():
        data = tensor_bytes(t)
        h.update(data)
        total += len(data)
    return time.perf_counter() - t0, total


def proc_io(pid: int) -> dict[str, int]:
    """The counters of ``/proc/PID/io`` (bytes read and written by the process)."""
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def vm_hwm_bytes(pid: int) -> int:
    """Peak resident set size of ``pid`` in bytes (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def publish_once(daemon, tensors: dict[str, torch.Tensor], ordered: bool) -> dict:
    """Publishes ``tensors`` once through the daemon; returns MB/s, CPU s/GB (daemon and client) and daemon reads."""
    pid = daemon.proc.pid
    with daemon.client() as client:
        before, cpu0, me0 = proc_io(pid), cpu_seconds(pid), time.process_time()
        t0 = time.perf_counter()
        report = client.publish(identity("ordered" if ordered else "unordered"), tensors, ordered=ordered)
        seconds = time.perf_counter() - t0
        after, cpu1, me1 = proc_io(pid), cpu_seconds(pid), time.process_time()
    gb = report.manifest.size_bytes / 1e9
    return {
        # CPU per GB does not depend on what else the machine runs: it says how many
        # cores a given rate needs (wall-clock MB/s on a shared box does not).
        "daemon_cpu_s_per_GB": (cpu1 - cpu0) / gb, "client_cpu_s_per_GB": (me1 - me0) / gb,
        "seconds": seconds, "bytes": report.manifest.size_bytes, "MBps": report.manifest.size_bytes / seconds / MB,
        "daemon_read_bytes": after["read_bytes"] - before["read_bytes"],
        "daemon_rchar": after["rchar"] - before["rchar"], "key": report.key, "files": len(report.manifest.files),
    }


def run(size: int, blocks: int, directory: str) -> dict:
    """Runs every measurement for one artifact size; returns the JSON document."""
    tensors = make_tensors(size, blocks)
    cpu0 = time.process_time()
    raw_s, raw_bytes = raw_write_fsync(directory, tensors)
    raw_cpu_per_gb = (time.process_time() - cpu0) / (raw_bytes / 1e9)
    cpu0 = time.process_time()
    sha_s, sha_bytes = sha_1core(tensors)
    sha_cpu_per_gb = (time.process_time() - cpu0) / (sha_bytes / 1e9)
    daemon = make_daemon(pathlib.Path(directory), root=os.path.join(directory, "root")).start()
    try:
        ordered = publish_once(daemon, tensors, True)
        unordered = publish_once(daemon, tensors, False)
        peak = vm_hwm_bytes(daemon.proc.pid)
    finally:
        cleanup(daemon)
    raw = raw_bytes / raw_s / MB
    sha = sha_bytes / sha_s / MB
    limit = min(raw, sha)
    return {
        "size_bytes": ordered["bytes"], "blocks": blocks, "files": ordered["files"], "cores": os.cpu_count(),
        "raw_write_fsync_MBps": raw, "sha256_1core_MBps": sha, "limit_MBps": limit,
        "sha256_cpu_s_per_GB": sha_cpu_per_gb, "raw_write_fsync_cpu_s_per_GB": raw_cpu_per_gb,
        "ordered": ordered, "unordered": unordered,
        "ordered_vs_limit": ordered["MBps"] / limit, "unordered_vs_limit": unordered["MBps"] / limit,
        "ordered_vs_unordered": ordered["MBps"] / unordered["MBps"],
        "ordered_read_fraction": ordered["daemon_read_bytes"] / ordered["bytes"],
        "ordered_rchar_fraction": ordered["daemon_rchar"] / ordered["bytes"],
        "daemon_peak_rss_bytes": peak, "target_met": ordered["MBps"] >= 0.8 * limit,
    }


def print_table(r: dict) -> None:
    """Prints MB/s and daemon reads per path, then the limits and CPU seconds per GB."""
    o, u = r["ordered"], r["unordered"]
    rows = [
        ("raw write+fsync", r["raw_write_fsync_MBps"], "", "", ""),
        ("sha256 1 core", r["sha256_1core_MBps"], "", "", ""),
        ("publish ordered", o["MBps"], f"{r['ordered_vs_limit']:.2f}", o["daemon_read_bytes"], o["daemon_rchar"]),
        ("publish unordered", u["MBps"], f"{r['unordered_vs_limit']:.2f}", u["daemon_read_bytes"], u["daemon_rchar"]),
    ]
    print(f"artifact: {r['size_bytes'] / 2**20:.0f} MiB, {r['blocks']} blocks, {r['files']} files, {r['cores']} cores")
    print(f"{'path':20} {'MB/s':>9} {'x limit':>8} {'daemon read_bytes':>18} {'daemon rchar':>14}")
    for name, mbps, ratio, read, rchar in rows:
        print(f"{name:20} {mbps:9.0f} {ratio:>8} {read!s:>18} {rchar!s:>14}")
    print(f"limit = min(raw, sha) = {r['limit_MBps']:.0f} MB/s; ordered/unordered = {r['ordered_vs_unordered']:.2f}; "
          f"daemon peak RSS {r['daemon_peak_rss_bytes'] / 2**20:.0f} MiB; "
          f"CPU s/GB: daemon ordered {r['ordered']['daemon_cpu_s_per_GB']:.2f}, unordered "
          f"{r['unordered']['daemon_cpu_s_per_GB']:.2f}, client {r['ordered']['client_cpu_s_per_GB']:.2f}, "
          f"one SHA-256 pass {r['sha256_cpu_s_per_GB']:.2f}, raw write+fsync {r['raw_write_fsync_cpu_s_per_GB']:.2f}; "
          f"ordered read fraction {r['ordered_read_fraction']:.4f} (rchar {r['ordered_rchar_fraction']:.4f}); target (>= 0.8 x limit) met: {r['target_met']}")


def main(argv: list[str] | None = None) -> int:
    """Parses the options, runs the benchmark, prints and saves the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_artifact_args(parser, "publish", quick="128 MiB: a smoke run", where="the store and raw files")
    args = parser.parse_args(argv)
    size = parse_size("128MiB" if args.quick else args.size)
    with bench_dir("publish", args.dir or "/var/tmp") as directory:
        result = run(size, args.blocks, directory)
    result["command"] = result_command("bench/publish.py", argv)
    print_table(result)
    save_result(result, args.out, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
