"""Build a complete artifact (payload files + manifest) in a plain directory,
without a daemon.

This is the reference implementation of what the daemon's publication must
produce (a conformance test compares the two byte for byte), and the seam
that lets runtime tests and benchmarks work on real mapped files without a
running daemon. It never writes under a store root.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Mapping

import torch
import xxhash

from hwr_client.core.manifest import Manifest
from hwr_client.core.plan import PlanSpec, build_manifest, check_plan
from hwr_client.tensors import iter_payload, tensor_bytes

CHUNK = 4 * 1024 * 1024


def write_artifact(directory: str, plan: PlanSpec, tensors: Mapping[str, torch.Tensor]) -> tuple[Manifest, list[str]]:
    """Writes ``plan``'s payload files into ``directory`` (named by their
    SHA-256) plus ``manifest.json``; returns the manifest and blob paths."""
    checked = check_plan(plan)
    os.makedirs(directory, exist_ok=True)
    file_digests, paths = [], []
    tensor_digests = {n: xxhash.xxh3_128(tensor_bytes(t)).hexdigest() for n, t in tensors.items()}
    for lay in checked.layouts:
        # A temp name per attempt (not per process): two writers in one
        # process, or a thread and a forked child, never share a file.
        tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
        sha, xxh = hashlib.sha256(lay.header), xxhash.xxh3_128(lay.header)
        try:
            with open(tmp, "xb") as f:
                f.write(lay.header)
                for _, data in iter_payload(lay, tensors, CHUNK):
                    f.write(data)
                    sha.update(data)
                    xxh.update(data)
            path = os.path.join(directory, sha.hexdigest())
            # The file is named by its content only once it is whole.
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        file_digests.append((sha.hexdigest(), xxh.hexdigest()))
        paths.append(path)
    block_xxh = []
    for b in checked.blocks:
        with open(paths[b.file], "rb") as f:
            f.seek(b.begin)
            block_xxh.append(xxhash.xxh3_128(f.read(b.end - b.begin)).hexdigest())
    manifest = build_manifest(checked, file_digests, tensor_digests, block_xxh)
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        f.write(manifest.to_json())
    return manifest, paths
