"""Hardening, the store layout: a layout directory under the store root
(``artifacts/``, ``blobs/``, ``blobs/sha256/``, ``staging/``,
``quarantine/``) replaced by a symbolic link makes the REAL daemon refuse to
start, naming the path, and nothing is written through the link."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.daemon import make_daemon


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
