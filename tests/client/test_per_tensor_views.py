"""Per-tensor storages: ``tensors(storage="per-tensor")`` gives each tensor a
storage of exactly its bytes over the same mapped pages (no copy), for
consumers that treat a shared storage as aliasing (vLLM-Omni's restorer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hwr_client.core.errors import InvalidArgument
from hwr_client.lease import local_lease
from hwr_client.local import write_artifact
from hwr_client.tensors import build_plan
from tests.conftest import identity, sample_tensors
from tests.support.paths import REPO_DIR


@pytest.fixture
def artifact(tmp_path):
    tensors = sample_tensors(blocks=4, width=32)
    tensors["empty"] = torch.empty(0, 3)
    tensors["scalar"] = torch.tensor(1.5, dtype=torch.float64)
    plan = build_plan(identity(test="per-tensor"), tensors, file_target_bytes=4096)
    manifest, paths = write_artifact(str(tmp_path / "art"), plan, tensors)
    return tensors, manifest, paths


def test_each_view_owns_exactly_its_bytes_of_the_same_mapping(artifact):
    tensors, manifest, paths = artifact
    with local_lease(manifest, paths) as lease:
        shared = lease.tensors()
        own = lease.tensors(storage="per-tensor")
        assert list(own) == list(shared) == [t.name for t in manifest.tensors]
        storages = set()
        for t in manifest.tensors:
            view = own[t.name]
            assert torch.equal(view, tensors[t.name]) and view.dtype == tensors[t.name].dtype
            assert view.is_contiguous() and tuple(view.shape) == tuple(tensors[t.name].shape)
            if t.nbytes == 0:
                continue
            # Zero-copy: the same address as the shared view, inside its file's mapping.
            assert view.data_ptr() == shared[t.name].data_ptr()
            region = lease.regions()[t.file]
            assert region.address <= view.data_ptr() and view.data_ptr() + t.nbytes <= region.address + region.length
            storage = view.untyped_storage()
            assert storage.data_ptr() == view.data_ptr() and storage.nbytes() == t.nbytes
            storages.add((storage.data_ptr(), storage.nbytes()))
        assert len(storages) == sum(1 for t in manifest.tensors if t.nbytes)
        # The shared mode keeps one storage per file (what the option exists to avoid).
        assert len({v.untyped_storage().data_ptr() for v in shared.values() if v.numel()}) == len(manifest.files)
        assert lease.tensors(storage="per-tensor") is own  # built once
        with pytest.raises(InvalidArgument, match="storage='copy'"):
            lease.tensors(storage="copy")
    # Views outlive the lease: they keep the mapping alive.
    assert torch.equal(own["embed.weight"], tensors["embed.weight"])


def test_a_write_through_a_per_tensor_view_faults(artifact):
    _, manifest, paths = artifact
    before = [open(p, "rb").read() for p in paths]
    code = textwrap.dedent(f"""
        from hwr_client.core.manifest import Manifest
        from hwr_client.lease import local_lease
        m = Manifest.from_json(open({os.path.join(os.path.dirname(paths[0]), 'manifest.json')!r}).read())
        v = local_lease(m, {list(paths)!r}).tensors(storage="per-tensor")["blocks.1.norm.weight"]
        print("writing", flush=True)
        v.fill_(7.0)
        print("WROTE", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO_DIR))
    assert "writing" in proc.stdout and "WROTE" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    assert [open(p, "rb").read() for p in paths] == before


def test_per_tensor_views_through_the_daemon(daemon):
    tensors = sample_tensors(blocks=2)
    client = daemon.client()
    key = client.publish(identity(t="per-tensor-daemon"), tensors).key
    with client.acquire(key) as lease:
        own = lease.tensors(storage="per-tensor")
        assert all(torch.equal(own[n], tensors[n]) for n in tensors)
        assert len({v.untyped_storage().data_ptr() for v in own.values()}) == len(tensors)
