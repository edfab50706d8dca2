"""Many nodes: ``hwr pull`` against the raw limit and against loading
canonically, measured in ONE run on a loopback registry.

Artifact: SIZE bytes in BLOCKS blocks (bench/publish.py's tensors, random
bits), one payload file per block (file_target_bytes=1, as the tiny-dit
contract lays blocks out). A real ``docker-registry`` (CNCF distribution)
on 127.0.0.1 and real daemons on separate roots (node A publishes, node B
pulls):

- ``canonical_load_publish``: what a node without a registry pays: read
  the canonical safetensors checkpoint cold (its pages dropped with
  posix_fadvise; safetensors.torch.load_file, one file of the same
  tensors) and publish it to its daemon;
- ``push``: ``Push`` of A's artifact to the empty registry;
- ``raw_get_fsync``: plain HTTP GETs of the same layers from the same
  registry into files, each fsynced, as many at once as the pull runs
  (``parallel_layers``): the raw limit here;
- ``pull``: ``Pull`` on node B (manifest, config, layers hashed while
  written, fsync, the durable commit);
- ``first_worker_after_pull``: pull + resolve (LOCAL_HIT) + lease on B,
  against ``canonical_load_publish`` (the first worker of a node that
  loads canonically).

Target: pull >= 0.8 x raw_get_fsync; a pulling node's first worker starts
sooner than a canonical load.

    python bench/pull.py             # 2 GiB, 40 blocks
    python bench/pull.py --quick     # 64 MiB, seconds; what the test runs

Prints a table and writes JSON (default bench/results/pull.json).
"""

from __future__ import annotations

import argparse
import http.client
import os
import pathlib
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from publish import identity, make_tensors  # noqa: E402  (bench/publish.py)

from hwr_client.core._proto import hwr_pb2 as pb  # noqa: E402
from hwr_client.core.defaults import parse_size  # noqa: E402
from bench.common import add_artifact_args, bench_dir, result_command, save_result  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.oci_registry import make_registry, remote_config  # noqa: E402

MB = 1e6
PARALLEL = 4  # RemoteConfig.parallel_layers' default


def raw_get_fsync(host: str, repo: str, layers: list[tuple[str, int]], directory: str) -> tuple[float, int]:
    """GETs every layer into a file (1 MiB reads), fsyncs each; PARALLEL at once."""
    os.makedirs(directory, exist_ok=True)

    def one(item: tuple[str, int]) -> int:
        digest, size = item
        conn = http.client.HTTPConnection(host, timeout=60)
        conn.request("GET", f"/v2/{repo}/blobs/{digest}")
        resp = conn.getresponse()
        assert resp.status == 200, resp.status
        n = 0
        with open(os.path.join(directory, digest[7:]), "wb", buffering=0) as f:
            while chunk := resp.read(1 << 20):
                f.write(chunk)
                n += len(chunk)
            os.fsync(f.fileno())
        conn.close()
        assert n == size
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(PARALLEL) as pool:
        total = sum(pool.map(one, layers))
    return time.perf_counter() - t0, total


def transfer(node, method: str, request) -> tuple[pb.TransferDone, float]:
    with node.client() as c:
        t0 = time.perf_counter()
        done = c.transfer(getattr(c.admin, method), request)
        return done, time.perf_counter() - t0


def run(size: int, blocks: int, directory: str) -> dict:
    """Runs every measurement; returns the JSON document."""
    import torch
    from safetensors.torch import load_file, save_file

    tmp = pathlib.Path(directory)
    tensors = make_tensors(size, blocks)
    ident = identity("pull")
    checkpoint = str(tmp / "model.safetensors")
    save_file(tensors, checkpoint)
    del tensors
    # A cold read of the checkpoint: made durable, then only ITS pages are
    # dropped from the page cache (posix_fadvise), nothing else on the machine.
    fd = os.open(checkpoint, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    reg = make_registry(str(tmp / "registry"))
    cfg = remote_config(str(tmp / "node.toml"))
    a = make_daemon(tmp, "--config", cfg, root=str(tmp / "a")).start()
    b = make_daemon(tmp, "--config", cfg, root=str(tmp / "b")).start()
    try:
        # The node without a registry: canonical read, then publication.
        t0 = time.perf_counter()
        loaded = load_file(checkpoint)
        with a.client() as c:
            report = c.publish(ident, loaded, file_target_bytes=1)
        canonical_s = time.perf_counter() - t0
        key, nbytes = report.key, report.manifest.size_bytes
        layers = [("sha256:" + f.blob, f.size) for f in report.manifest.files]
        repo = f"{reg.host}/hwr/bench"
        pushed, push_s = transfer(a, "Push", pb.PushRequest(key=key, reference=repo))
        raw_s, raw_bytes = raw_get_fsync(reg.host, "hwr/bench", layers, str(tmp / "raw"))
        shutil.rmtree(tmp / "raw")
        pulled, pull_s = transfer(b, "Pull", pb.PullRequest(reference=f"{repo}:{key}"))
        t0 = time.perf_counter()
        with b.client() as c:
            res = c.resolve(ident, mode="required")
            assert res.outcome == "LOCAL_HIT", res.reason
            with res.lease as lease:
                mapped = lease.tensors()
                # Compared as bits: random bf16 bit patterns include NaNs.
                assert torch.equal(mapped["blocks.0.weight"].view(torch.int16), loaded["blocks.0.weight"].view(torch.int16))
        lease_s = time.perf_counter() - t0
    finally:
        cleanup(a)
        cleanup(b)
        reg.stop()
    raw = raw_bytes / raw_s / MB
    pull = pulled.bytes_transferred / pull_s / MB
    return {
        "size_bytes": nbytes, "blocks": blocks, "layers": len(layers), "cores": os.cpu_count(),
        "parallel_layers": PARALLEL,
        "canonical_load_publish_s": canonical_s, "canonical_load_publish_MBps": nbytes / canonical_s / MB,
        "push_s": push_s, "push_MBps": pushed.bytes_transferred / push_s / MB,
        "push_layers": pushed.layers_transferred,
        "raw_get_fsync_s": raw_s, "raw_get_fsync_MBps": raw,
        "pull_s": pull_s, "pull_MBps": pull, "pull_bytes": pulled.bytes_transferred,
        "pull_vs_raw": pull / raw,
        "first_lease_after_pull_s": lease_s, "first_worker_after_pull_s": pull_s + lease_s,
        "pull_start_vs_canonical": (pull_s + lease_s) / canonical_s,
        "target_met": pull >= 0.8 * raw and pull_s + lease_s < canonical_s,
    }


def print_table(r: dict) -> None:
    rows = [
        ("canonical load+publish", r["canonical_load_publish_s"], r["canonical_load_publish_MBps"], ""),
        ("push", r["push_s"], r["push_MBps"], ""),
        ("raw GET+fsync", r["raw_get_fsync_s"], r["raw_get_fsync_MBps"], "1.00"),
        ("hwr pull", r["pull_s"], r["pull_MBps"], f"{r['pull_vs_raw']:.2f}"),
        ("pull + first lease", r["first_worker_after_pull_s"], r["size_bytes"] / r["first_worker_after_pull_s"] / MB,
         ""),
    ]
    print(f"artifact: {r['size_bytes'] / 2**20:.0f} MiB, {r['blocks']} blocks, {r['layers']} layers, "
          f"{r['cores']} cores, {r['parallel_layers']} layers at once, loopback registry")
    print(f"{'path':24} {'seconds':>8} {'MB/s':>8} {'x raw':>6}")
    for name, secs, mbps, ratio in rows:
        print(f"{name:24} {secs:8.2f} {mbps:8.0f} {ratio:>6}")
    print(f"first worker after pull / canonical load+publish = {r['pull_start_vs_canonical']:.2f}; "
          f"target (pull >= 0.8 x raw, pulled start faster than canonical) met: {r['target_met']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_artifact_args(parser, "pull", quick="64 MiB: a smoke run", where="the registry, stores and files")
    args = parser.parse_args(argv)
    size = parse_size("64MiB" if args.quick else args.size)
    with bench_dir("pull", args.dir or "/var/tmp") as directory:
        result = run(size, args.blocks, directory)
    result["command"] = result_command("bench/pull.py", argv)
    print_table(result)
    save_result(result, args.out, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
