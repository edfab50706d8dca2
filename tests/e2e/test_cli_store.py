"""`hwr import | ls | inspect | verify | rm | stats` against the REAL daemon."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import identity, sample_tensors


@pytest.fixture
def checkpoint(tmp_path):
    tensors = sample_tensors(blocks=2)
    a, b = dict(list(tensors.items())[:4]), dict(list(tensors.items())[4:])
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    ident = tmp_path / "id.json"
    ident.write_text(json.dumps(identity(t="cli")))
    return tmp_path, tensors, str(ident)


def test_import_then_ls_inspect_verify_stats_rm(daemon, checkpoint):
    tmp, tensors, ident = checkpoint
    files = [str(tmp / "a.safetensors"), str(tmp / "b.safetensors")]
    out = daemon.cli("import", "--identity", ident, *files, "--json")
    assert out.returncode == 0, out.stderr
    key = json.loads(out.stdout)["key"]
    from hwr_client.core.identity import Identity

    assert key == Identity.from_dict(identity(t="cli")).key
    plain = daemon.cli("import", "--identity", ident, *files)
    assert plain.returncode == 0 and plain.stdout.strip() == key  # already published: same key
    with daemon.client() as client:
        with client.acquire(key) as lease:
            got = lease.tensors()
            assert set(got) == set(tensors) and all(torch.equal(got[n], tensors[n]) for n in tensors)
    rows = json.loads(daemon.cli("ls", "--json").stdout)
    assert [(r["key"], r["state"]) for r in rows] == [(key, "published")]
    assert key[:16] in daemon.cli("ls").stdout
    info = json.loads(daemon.cli("inspect", key, "--json").stdout)
    assert info["manifest"]["key"] == key and info["summary"]["block_count"] == 2
    assert "blocks.1." in daemon.cli("inspect", key).stdout
    ver = daemon.cli("verify", key, "--json")
    assert ver.returncode == 0 and json.loads(ver.stdout)["ok"]
    assert daemon.cli("verify", "--all").returncode == 0
    stats = json.loads(daemon.cli("stats", "--json").stdout)
    assert stats['hwr_artifacts{state="published"}'] == 1
    assert "hwr_publications_total" in daemon.cli("stats").stdout
    rm = daemon.cli("rm", key, "--json")
    assert rm.returncode == 0 and json.loads(rm.stdout)["bytes_freed"] > 0
    assert json.loads(daemon.cli("ls", "--json").stdout) == []
    missing = daemon.cli("inspect", key)
    assert missing.returncode == 3 and "NotFound" in missing.stderr


def test_verify_exits_1_on_corruption(daemon, checkpoint):
    tmp, _, ident = checkpoint
    key = json.loads(daemon.cli("import", "--identity", ident, str(tmp / "a.safetensors"), "--json").stdout)["key"]
    manifest = json.loads(daemon.cli("inspect", key, "--json").stdout)["manifest"]
    t = manifest["tensors"][0]
    path = os.path.join(daemon.root, "blobs", "sha256", manifest["files"][t["file"]]["blob"])
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(t["offset"])
        f.write(b"\x55\xaa")
    out = daemon.cli("verify", "--all")
    assert out.returncode == 1 and "CORRUPT" in out.stdout and repr(t["name"]) in out.stdout
    rows = json.loads(daemon.cli("ls", "--json").stdout)
    assert [r["state"] for r in rows] == ["quarantined"]


def _bad_files(tmp) -> dict[str, tuple[str, str]]:
    """name -> (path, expected message fragment)."""
    good = tmp / "good.safetensors"
    save_file({"w": torch.zeros(64)}, str(good))
    data = good.read_bytes()
    truncated = tmp / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 10])
    garbage = tmp / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 16) + b"this is not json" + b"\0" * 64)
    huge = tmp / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 200 * 1000 * 1000) + b"{}")
    tiny = tmp / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    wrong = tmp / "wrong-size.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    wrong.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 12)
    return {
        "truncated": (str(truncated), "data region ends"),
        "garbage": (str(garbage), "not valid JSON"),
        "huge": (str(huge), "exceeds the 100000000-byte limit"),
        "tiny": (str(tiny), "truncated"),
        "wrong-size": (str(wrong), "expected 16"),
    }


def test_import_of_bad_files_is_a_clear_error_naming_each(daemon, tmp_path, checkpoint):
    ident = tmp_path / "id-bad.json"
    ident.write_text(json.dumps(identity(t="bad-import")))
    for case, (path, fragment) in _bad_files(tmp_path).items():
        out = daemon.cli("import", "--identity", str(ident), path)
        assert out.returncode == 2, (case, out.stderr)
        assert path in out.stderr and fragment in out.stderr and "InvalidArgument" in out.stderr, (case, out.stderr)
    tmp, _, good_ident = checkpoint
    out = daemon.cli("import", "--identity", good_ident, str(tmp / "a.safetensors"), str(tmp / "a.safetensors"))
    assert out.returncode == 2 and "also in" in out.stderr
    assert json.loads(daemon.cli("ls", "--json").stdout) == []
    assert os.listdir(os.path.join(daemon.root, "staging")) == []
