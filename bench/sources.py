"""Source digests: cold ResolveSources throughput against the machine's
hashing and reading limits, and warm (cached) per-file latency.

Files: N files of SIZE random bytes under a temp source root. Measured in ONE
run, so every ratio compares numbers taken on the same machine state:

- ``sha_1core``: single-core hashlib SHA-256 on an in-memory buffer (MB/s);
  ``ideal_hash = sha_1core x min(cores, files)`` (SHA-256 is sequential within
  a file, so files are the unit of parallelism);
- ``cold_read``: the files read in parallel, nothing hashed, after dropping
  the page cache (MB/s);
- ``cold_resolve``: ResolveSources on a fresh root after dropping the page
  cache, through the real daemon (``hwr serve --source-root``) (MB/s);
  target: ``cold_resolve >= 0.8 x min(ideal_hash, cold_read)``;
- ``warm``: repeated ResolveSources of cached files: per-file latency with all
  files in one call, and one file per call (target <= 1 ms per file).

The page cache is dropped with ``echo 3 > /proc/sys/vm/drop_caches`` when
permitted, and always also per file with ``posix_fadvise(DONTNEED)``; the
JSON says which worked.

    python bench/sources.py                 # 4 files x 1 GiB
    python bench/sources.py --quick         # 4 x 32 MiB, seconds; what the test runs

Prints a table and writes JSON (default bench/results/sources.json).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import result_path, save_result  # noqa: E402
import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

import hwr_client  # noqa: E402
from hwr_client.core.defaults import parse_size  # noqa: E402
from hwr_server.sources.cache import RACY_WINDOW_NS  # noqa: E402

MB = 1e6


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def make_files(directory: str, count: int, size: int) -> list[str]:
    """``count`` files of ``size`` random bytes (random: no compression or
    dedup can flatter the read rate)."""
    paths = []
    chunk = os.urandom(8 << 20)
    for i in range(count):
        path = os.path.join(directory, f"model-{i:05d}-of-{count:05d}.safetensors")
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(left, len(chunk))
                f.write(chunk[:n] if i == 0 else bytes([i]) + chunk[1:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())  # durable, so the page cache can actually be dropped
        paths.append(path)
    return paths


def drop_page_cache(paths: list[str], *, system_wide: bool = True) -> str:
    """Evicts the files from the page cache; returns how."""
    os.sync()
    how = []
    try:
        if system_wide:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            how.append("drop_caches")
    except OSError:
        pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how.append("fadvise_dontneed")
    return "+".join(how)


def sha_single_core(nbytes: int) -> float:
    """MB/s of one thread hashing an in-memory buffer (best of 3)."""
    buf = os.urandom(nbytes)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        hashlib.sha256(buf).digest()
        best = max(best, nbytes / (time.perf_counter() - t) / MB)
    return best


def read_all(paths: list[str]) -> float:
    """MB/s reading the files in parallel (one thread each, capped at cores)."""
    def read(p: str) -> int:
        buf = bytearray(8 << 20)
        n = 0
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
        return n

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(len(paths), cores())) as pool:
        total = sum(pool.map(read, paths))
    return total / (time.perf_counter() - t) / MB


class ServedDaemon:
    """``hwr serve`` as a subprocess on a temp root with one source root."""

    def __init__(self, workdir: str, source_root: str):
        self.root = os.path.join(workdir, "root")
        self.sockdir = tempfile.mkdtemp(prefix="hwr-bench-", dir="/tmp")
        self.socket = os.path.join(self.sockdir, "hwr.sock")
        cmd = [sys.executable, "-m", "hwr_client.cli", "serve", "--root", self.root, "--socket", self.socket,
               "--admin-socket", os.path.join(self.sockdir, "admin.sock"), "--source-root", source_root]
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = open(os.path.join(workdir, "daemon.log"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_serving(60.0)

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with grpc.insecure_channel(f"unix:{self.socket}") as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        raise TimeoutError("daemon not serving")

    def close(self) -> None:
        """Stops the daemon and removes its sockets' directory."""
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.sockdir, ignore_errors=True)


def warm_latency(client: hwr_client.Client, paths: list[str], rounds: int) -> tuple[float, float]:
    """(ms per file with all files in one call, ms per single-file call)."""
    assert all(d.origin == "cache" for d in client.resolve_sources(paths)), "files were not cached"
    t = time.perf_counter()
    for _ in range(rounds):
        client.resolve_sources(paths)
    batched = (time.perf_counter() - t) / (rounds * len(paths)) * 1e3
    t = time.perf_counter()
    for _ in range(rounds):
        for p in paths:
            client.resolve_sources([p])
    single = (time.perf_counter() - t) / (rounds * len(paths)) * 1e3
    return batched, single


def run(args: argparse.Namespace) -> dict:
    """Measures raw reads and hashing, then cold and warm ResolveSources through a daemon; returns the JSON document."""
    size = parse_size(args.size)
    work = tempfile.mkdtemp(prefix="hwr-bench-sources-", dir=args.dir)
    src = os.path.join(work, "src")
    os.makedirs(src)
    daemon = None
    try:
        paths = make_files(src, args.files, size)
        total = args.files * size
        sha1 = sha_single_core(min(size, 256 << 20))
        how = drop_page_cache(paths, system_wide=not args.fadvise_only)
        cold_read = read_all(paths)
        # Files younger than the racy window are hashed but not recorded:
        # wait it out so the warm phase finds records.
        time.sleep(RACY_WINDOW_NS / 1e9)
        daemon = ServedDaemon(work, src)
        with hwr_client.connect(daemon.socket) as client:
            drop_page_cache(paths, system_wide=not args.fadvise_only)
            t = time.perf_counter()
            digests = client.resolve_sources(paths)
            cold_s = time.perf_counter() - t
            assert all(d.origin == "hashed" for d in digests), [d.origin for d in digests]
            batched_ms, single_ms = warm_latency(client, paths, args.rounds)
        parallel = min(cores(), args.files)
        ideal_hash = sha1 * parallel
        cap = min(ideal_hash, cold_read)
        cold = total / cold_s / MB
        return {
            "files": args.files, "file_bytes": size, "cores": cores(), "page_cache_drop": how,
            "sha256_single_core_MBps": round(sha1, 1), "ideal_hash_MBps": round(ideal_hash, 1),
            "cold_read_MBps": round(cold_read, 1), "cold_resolve_MBps": round(cold, 1),
            "cold_resolve_s": round(cold_s, 3), "cold_vs_cap": round(cold / cap, 3),
            "cold_target_met": cold >= 0.8 * cap,
            "warm_ms_per_file_batched": round(batched_ms, 4), "warm_ms_per_file_single_call": round(single_ms, 4),
            "warm_target_met": batched_ms <= 1.0, "warm_rounds": args.rounds,
        }
    finally:
        if daemon is not None:
            daemon.close()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Parses the options, runs the benchmark, prints and saves the numbers."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--size", default="1GiB", help="bytes per file (e.g. 1GiB, 32MiB)")
    parser.add_argument("--rounds", type=int, default=200, help="warm resolve rounds")
    parser.add_argument("--dir", default=None, help="where the files are written (default: system temp)")
    parser.add_argument("--quick", action="store_true", help="4 x 32 MiB, 50 warm rounds")
    parser.add_argument("--fadvise-only", action="store_true",
                        help="evict only the bench files (posix_fadvise), never the whole page cache")
    parser.add_argument("--out", default=result_path("sources.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.rounds = "32MiB", 50
    result = run(args)
    print(f"{'metric':34} value")
    for k, v in result.items():
        print(f"{k:34} {v}")
    save_result(result, args.out, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
