"""Hardening, the store's names: a layout directory under the store root
(``artifacts/``, ``blobs/``, ``blobs/sha256/``, ``staging/``,
``quarantine/``) replaced by a symbolic link makes the REAL daemon refuse to
start, naming the path, and nothing is written through the link; deep
verify reads a blob only through the descriptor it checked."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest
import torch

from hwr_client.tensors import build_plan
from tests.conftest import identity
from tests.support.daemon import make_daemon
from tests.support.store import make_store, publish_inproc


@pytest.mark.parametrize("layout_dir", ["artifacts", "blobs", "blobs/sha256", "staging", "quarantine"])
def test_a_layout_directory_linked_elsewhere_is_refused_at_start(tmp_path, layout_dir):
    d = make_daemon(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("precious\n")
    link = os.path.join(d.root, layout_dir)
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(elsewhere, link)
    d.start(wait=False)
    assert d.proc is not None
    try:
        rc = d.proc.wait(60)
    except subprocess.TimeoutExpired:
        d.kill()
        pytest.fail(f"daemon did not refuse to start; log:\n{d.log()[-2000:]}")
    log = d.log()
    assert rc != 0, log
    assert f"store layout directory {link} is a symbolic link" in log, log[-2000:]
    # Recovery would have emptied staging/ and removed orphans: nothing
    # behind the link was touched.
    assert sorted(os.listdir(elsewhere)) == ["precious.txt"]
    assert os.path.islink(link)


def test_deep_verify_reads_only_the_blob_it_checked(tmp_path):
    """A writer flips a blob's name between the blob and a link to a file of
    the same size with other bytes while deep verify (what VerifyArtifact,
    the scrubber and ReportCorruption run: ``Store.verify``) re-hashes it.
    Every verify must either see the link (refused, never followed) or read
    the blob it checked; none may hash the link's target: a "sha256
    mismatch" without a link in the problems means it read another file."""
    store = make_store(tmp_path)
    tensors = {"w": torch.arange(16384, dtype=torch.float32)}
    key = publish_inproc(store, build_plan(identity(t="swap"), tensors), tensors).key
    manifest, [path] = store.get(key)
    size = manifest.files[0].size
    other = tmp_path / "other.bin"
    other.write_bytes(b"\x5a" * size)
    keep = str(tmp_path / "keep.bin")
    os.link(path, keep)  # the blob's inode, to put back under its name
    stop = threading.Event()

    def flip() -> None:
        tmp_link, tmp_blob = path + ".link", path + ".back"
        while not stop.is_set():
            # rename(2) replaces the name atomically: at every instant the
            # name is either the blob or the link.
            os.symlink(other, tmp_link)
            os.rename(tmp_link, path)
            os.link(keep, tmp_blob)
            os.rename(tmp_blob, path)

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    seen = {"link": 0, "ok": 0, "read another file": 0}
    try:
        for _ in range(400):
            r = store.verify(key)
            if r.ok:
                seen["ok"] += 1
            elif any("symbolic link" in p for p in r.problems):
                seen["link"] += 1
            else:
                seen["read another file"] += 1
    finally:
        stop.set()
        flipper.join(10)
    assert seen["read another file"] == 0, seen
    assert seen["link"] > 0, seen  # the flips did race the verifies
