"""Client Lease over real mapped files written by hwr_client.local (no daemon):
views, verification, close, pickling, read-only enforcement."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_client.lease import Lease, local_lease, verify_mapped
from hwr_client.local import write_artifact
from hwr_client.mapping import MappedArtifact
from hwr_client.tensors import build_plan
from tests.conftest import identity, sample_tensors
from tests.support.paths import REPO_DIR


@pytest.fixture
def artifact(tmp_path):
    tensors = sample_tensors(blocks=4, width=32)
    plan = build_plan(identity(test="lease-client"), tensors, file_target_bytes=4096)
    manifest, paths = write_artifact(str(tmp_path / "art"), plan, tensors)
    return tensors, manifest, paths


def test_views_equal_written_tensors(artifact):
    tensors, manifest, paths = artifact
    with local_lease(manifest, paths) as lease:
        views = lease.tensors()
        assert list(views) == [t.name for t in manifest.tensors]
        for name, t in tensors.items():
            assert views[name].dtype == t.dtype and views[name].shape == t.shape
            assert torch.equal(views[name], t)
        for b in lease.blocks:
            bt = lease.block_tensors(b.index)
            assert list(bt) == list(b.tensors)
            assert lease.block_bytes(b.index).numel() == b.nbytes
        regions = lease.regions()
        assert [r.length for r in regions] == [f.size for f in manifest.files]
        assert all(r.address % os.sysconf("SC_PAGE_SIZE") == 0 for r in regions)
        # Zero copy: every view points into a mapped region.
        for name, v in views.items():
            r = regions[manifest.tensor(name).file]
            assert r.address <= v.data_ptr() < r.address + r.length


def test_close_is_idempotent_and_releases_once(artifact):
    _, manifest, paths = artifact
    released = []
    lease = Lease(manifest.key, "id-1", MappedArtifact(manifest, paths), release=released.append)
    view = lease.tensors()["embed.weight"]
    lease.close()
    lease.close()
    assert released == ["id-1"] and lease.closed
    assert view.sum() == view.sum()  # views handed out stay valid after close
    with pytest.raises(FailedPrecondition, match="released"):
        lease.tensors()


def test_refuses_pickling(artifact):
    _, manifest, paths = artifact
    with local_lease(manifest, paths) as lease:
        with pytest.raises(TypeError, match="process-local"):
            pickle.dumps(lease)


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_verify_clean_hashes_each_byte_once(artifact, mode):
    _, manifest, paths = artifact
    mapped = MappedArtifact(manifest, paths)
    report = verify_mapped(mapped, mode)
    assert report.ok, report.problems
    assert report.bytes_hashed == sum(f.size for f in manifest.files)  # every byte, once
    extra = 0 if mode == "fast" else len(manifest.tensors)  # fast: the file digests cover the blocks
    assert report.digests == len(manifest.files) + extra


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_verify_finds_a_flipped_byte(artifact, mode):
    _, manifest, paths = artifact
    block = manifest.blocks[2]
    with open(paths[block.file], "r+b") as f:  # MAP_SHARED: the mapping sees it
        f.seek(block.begin + 5)
        byte = f.read(1)
        f.seek(block.begin + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = verify_mapped(MappedArtifact(manifest, paths), mode)
    assert not report.ok
    assert any(p.startswith(f"file {block.file}") for p in report.problems)
    if mode == "fast":
        assert any(p.startswith("block 2") for p in report.problems)
        damaged = [b for b in manifest.blocks if b.file == block.file]
        assert report.bytes_hashed == sum(f.size for f in manifest.files) + sum(b.nbytes for b in damaged)
    else:
        assert any("tensor 'blocks.2." in p for p in report.problems)
    assert len(report.problems) == 2


def test_verify_rejects_unknown_mode(artifact):
    _, manifest, paths = artifact
    with pytest.raises(InvalidArgument):
        verify_mapped(MappedArtifact(manifest, paths), "sha1")


def test_write_through_a_view_faults_and_leaves_file_unchanged(artifact):
    _, manifest, paths = artifact
    before = [open(p, "rb").read() for p in paths]
    code = textwrap.dedent(f"""
        import json, sys
        from hwr_client.core.manifest import Manifest
        from hwr_client.lease import local_lease
        m = Manifest.from_json(open({os.path.join(os.path.dirname(paths[0]), 'manifest.json')!r}).read())
        lease = local_lease(m, {list(paths)!r})
        v = lease.tensors()["embed.weight"]
        print("writing", flush=True)
        v.fill_(7.0)
        print("WROTE", flush=True)
    """)
    repo = REPO_DIR
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=repo))
    assert "writing" in proc.stdout and "WROTE" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    assert [open(p, "rb").read() for p in paths] == before


def test_carrier_single_take_and_close_of_untaken(artifact):
    from hwr_client import LeaseCarrier

    _, manifest, paths = artifact
    released = []
    lease = Lease(manifest.key, "id-2", MappedArtifact(manifest, paths), release=released.append)
    carrier = LeaseCarrier(lease)
    with pytest.raises(TypeError):
        pickle.dumps(carrier)
    assert carrier.take() is lease and not carrier.owns
    with pytest.raises(FailedPrecondition, match="already taken"):
        carrier.take()
    carrier.close()  # taken: closing the carrier leaves the lease to its owner
    assert not lease.closed and released == []
    lease.close()
    other = Lease(manifest.key, "id-3", MappedArtifact(manifest, paths), release=released.append)
    with LeaseCarrier(other):
        pass  # never taken: closing the carrier closes the lease
    assert other.closed and released == ["id-2", "id-3"]
