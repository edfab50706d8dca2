"""Bytes changed under a worker's mapping are an error, not wrong output or
a SIGBUS: a real diffusers FluxTransformer2DModel served by DLO (CPU device)
from its checkpoint's own mapping (``host_plan="checkpoint-mmap"``) or from
an HWR lease (a real daemon), while the file under it is

- overwritten in place with another checkpoint of the same size (``cp``:
  the landed code's output changed with no error),
- truncated (the landed worker died of SIGBUS),
- a blob rewritten in place by root under a lease (the landed worker
  computed NaNs, even after a lease with ``verify="full"``: that hashes the
  bytes once, at acquire).

Each case runs in a child process (a SIGBUS must fail the test, not kill
pytest): one forward, the change, a second forward; the child reports the
outcome. The check is :class:`hwr_client.mapping.MappedFileGuard`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("diffusers")

import dlo_runtime  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.paths import REPO_DIR  # noqa: E402
from tests.support.real_models import MODELS  # noqa: E402

WEIGHTS = "diffusion_pytorch_model.safetensors"

CHILD = textwrap.dedent("""
    import json, os, shutil, sys
    import dlo_runtime
    from hwr_client.core.errors import DataLoss
    from tests.support.real_models import output_of
    case, directory, other, sock = sys.argv[1:5]
    kw = dict(host_plan="hwr", socket=sock) if case == "blob-rewrite" else dict(host_plan="checkpoint-mmap")
    with dlo_runtime.from_pretrained(directory, device="cpu", progress=False, **kw) as loaded:
        first = output_of(loaded.model, "flux")
        if case == "blob-rewrite":
            assert loaded.outcome == "LOCAL_HIT", loaded.outcome
            target = max(loaded.lease.paths, key=os.path.getsize)  # a blob of blocks
            with open(target, "r+b") as f:  # root ignores the blob's 0444
                f.seek(os.path.getsize(target) // 2)
                f.write(b"\\xff" * 65536)
        else:
            target = os.path.join(directory, "diffusion_pytorch_model.safetensors")
            if case == "ckpt-cp":
                shutil.copyfile(os.path.join(other, "diffusion_pytorch_model.safetensors"), target)  # in place
            else:
                os.truncate(target, os.path.getsize(target) // 2)
        try:
            second = output_of(loaded.model, "flux")
            out = {"outcome": "served", "same": bool((first == second).all()), "target": target}
        except DataLoss as exc:
            out = {"outcome": "DataLoss", "message": str(exc), "target": target}
    print(json.dumps(out), flush=True)
""")


def _save(directory: str, seed: int) -> str:
    torch.manual_seed(seed)
    MODELS["flux"][0]().to(torch.bfloat16).save_pretrained(directory)
    return directory


@pytest.fixture
def checkpoints(tmp_path):
    return _save(str(tmp_path / "a"), 0), _save(str(tmp_path / "b"), 1)


def _run(case: str, directory: str, other: str = "", sock: str = "") -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-c", CHILD, case, directory, other, sock], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=REPO_DIR))
    lines = p.stdout.strip().splitlines()
    return p.returncode, (json.loads(lines[-1]) if lines else {"stderr": p.stderr[-3000:]})


@pytest.mark.parametrize("case", ["ckpt-cp", "ckpt-truncate"])
def test_a_checkpoint_changed_under_checkpoint_mmap_is_an_error(case, checkpoints):
    a, b = checkpoints
    assert os.path.getsize(os.path.join(a, WEIGHTS)) == os.path.getsize(os.path.join(b, WEIGHTS))
    rc, out = _run(case, a, b)
    assert rc == 0, (rc, out)  # not SIGBUS (-7)
    assert out["outcome"] == "DataLoss", out
    assert f"mapped file {out['target']} changed under its mapping" in out["message"]


def test_a_blob_rewritten_in_place_under_a_lease_is_an_error(checkpoints, tmp_path):
    a, _ = checkpoints
    (tmp_path / "daemon").mkdir()
    d = make_daemon(tmp_path / "daemon").start()
    try:
        with dlo_runtime.from_pretrained(a, host_plan="hwr", socket=d.socket, device="cpu", progress=False) as cold:
            assert cold.outcome == "CANONICAL_FALLBACK"
            cold.wait_published(60)  # published in the background: the child's load is a LOCAL_HIT
        assert cold.report.publish["ok"], cold.report.publish
        rc, out = _run("blob-rewrite", a, "", d.socket)
        assert rc == 0, (rc, out)
        assert out["outcome"] == "DataLoss", out
        assert "/blobs/sha256/" in out["target"] and "changed under its mapping" in out["message"]
    finally:
        cleanup(d)


def test_the_guard_ignores_links_renames_and_modes_and_catches_writes(tmp_path):
    """What the daemon does to blobs legitimately (hard links, renames over
    the name, chmod, all of which change the ctime) is no alarm; a write in
    place is, even of the same size."""
    from hwr_client.core.errors import DataLoss
    from hwr_client.mapping import MappedFileGuard

    path = tmp_path / "blob"
    path.write_bytes(b"a" * 8192)
    # An hour old, as a mapped checkpoint is: the write below gets a newer
    # mtime whatever the clock's granularity.
    os.utime(path, (os.path.getmtime(path) - 3600,) * 2)
    guard = MappedFileGuard.open([str(path)])
    os.link(path, tmp_path / "linked")
    os.chmod(path, 0o444)
    (tmp_path / "fresh").write_bytes(b"b" * 8192)
    os.rename(tmp_path / "fresh", path)  # the name moves on; the guarded inode is untouched
    guard.check()
    with open(tmp_path / "linked", "r+b") as f:  # the guarded inode itself
        f.write(b"c")
    with pytest.raises(DataLoss, match="changed under its mapping"):
        guard.check()
    guard.close()
    guard.check()  # closed: nothing is mapped through it any more
