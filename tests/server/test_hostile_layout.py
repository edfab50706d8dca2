"""Hardening, the store's names: a layout directory under the store root
(``artifacts/``, ``blobs/``, ``blobs/sha256/``, ``staging/``,
``quarantine/``) replaced by a symbolic link makes the REAL daemon refuse to
start, naming the path, and nothing is written through the link; deep
verify reads a blob only through the descriptor it checked."""

from __future__ import annotations

import os
import subprocess

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


def test_deep_verify_reads_only_the_blob_it_checked(tmp_path, monkeypatch):
    """The blob's name is flipped to a link to a file of the same size with
    other bytes, at the two moments that matter, while deep verify (what
    VerifyArtifact, the scrubber and ReportCorruption run: ``Store.verify``)
    re-hashes it:

    - just BEFORE verify opens the name: it must see the link (refused,
      never followed);
    - just AFTER it opened and checked the name: every read must still come
      from the blob it checked; hashing the link's target shows as a
      "sha256 mismatch" without a link among the problems.

    The flips happen at those points through the open seam (the store's
    ``open_stored``), every time: no racing thread whose scheduling decides
    whether the race was run (the earlier version asserted that its flipper
    had run at least once, which a loaded machine sometimes did not do)."""
    from hwr_server.store import recovery

    store = make_store(tmp_path)
    tensors = {"w": torch.arange(16384, dtype=torch.float32)}
    key = publish_inproc(store, build_plan(identity(t="swap"), tensors), tensors).key
    manifest, [path] = store.get(key)
    size = manifest.files[0].size
    other = tmp_path / "other.bin"
    other.write_bytes(b"\x5a" * size)
    keep = str(tmp_path / "keep.bin")
    os.link(path, keep)  # the blob's inode, to put back under its name

    def to_link() -> None:
        # rename(2) replaces the name atomically: it is the blob or the link.
        os.symlink(other, path + ".link")
        os.rename(path + ".link", path)

    def to_blob() -> None:
        os.link(keep, path + ".back")
        os.rename(path + ".back", path)

    real_open = recovery.open_stored
    when = {"flip": ""}

    def open_with_flip(p, **kw):
        if when["flip"] == "before":
            to_link()
        try:
            return real_open(p, **kw)
        finally:
            if when["flip"] == "after":
                to_link()

    monkeypatch.setattr(recovery, "open_stored", open_with_flip)
    seen = {}
    for flip in ("before", "after", "before", "after"):
        when["flip"] = flip
        try:
            r = store.verify(key)
        finally:
            to_blob()
        outcome = "ok" if r.ok else ("link" if any("symbolic link" in p for p in r.problems) else "read another file")
        seen.setdefault(flip, []).append(outcome)
    assert seen == {"before": ["link", "link"], "after": ["ok", "ok"]}, seen
