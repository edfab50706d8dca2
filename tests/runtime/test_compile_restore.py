"""The worker's own cache folder, capture and restore against hostile input,
without compiling: which folder a worker uses and which it refuses, what a
capture takes, that a restore writes only below the folder (a planted link
redirects nothing, an entry in place stays), and that an artifact whose
entries no HWR producer writes is refused before any byte is written."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from dlo_runtime.compile import folder as cache_folder
from dlo_runtime.compile.payload import MEGA, check_manifest, load_mega, restore_lease, to_tensors
from hwr_client.core.errors import FailedPrecondition
from tests.conftest import identity

NOBODY = 65534


@pytest.fixture
def fresh_choice(monkeypatch):
    """worker_folder() decides again; the process's environment is restored after."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_folder._reset_for_tests()
    yield monkeypatch
    cache_folder._reset_for_tests()


def write(path: str, data: bytes = b"x") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


# -- which folder --------------------------------------------------------------------


def test_unset_or_torch_default_gets_a_private_folder(fresh_choice, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    for value in (None, default_cache_dir()):
        if value is not None:
            fresh_choice.setenv("TORCHINDUCTOR_CACHE_DIR", value)
        cache_folder._reset_for_tests()
        chosen = cache_folder.worker_folder()
        assert chosen.private and os.environ["TORCHINDUCTOR_CACHE_DIR"] == chosen.path != value
        st = os.lstat(chosen.path)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert os.path.basename(chosen.path).startswith(cache_folder.PRIVATE_PREFIX)
        assert cache_folder.worker_folder() == chosen  # once per process
        os.rmdir(chosen.path)


def test_a_users_own_folder_is_used(fresh_choice, tmp_path):
    own = tmp_path / "mine"
    own.mkdir(mode=0o700)
    fresh_choice.setenv("TORCHINDUCTOR_CACHE_DIR", str(own))
    assert cache_folder.worker_folder() == cache_folder.CacheFolder(str(own), private=False)


@pytest.mark.parametrize("how, words", [("mode", "writable by group or others"), ("link", "symbolic link"),
                                        ("owner", "owned by uid"), ("file", "not a directory")])
def test_a_folder_others_can_write_is_refused(fresh_choice, tmp_path, how, words):
    path = tmp_path / "cache"
    if how == "link":
        (tmp_path / "real").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "real")
    elif how == "file":
        path.write_bytes(b"")
    else:
        path.mkdir(mode=0o700)
        if how == "mode":
            os.chmod(path, 0o777)
        else:
            if os.geteuid() != 0:
                pytest.skip("chown to another uid needs root")
            os.chown(path, NOBODY, NOBODY)
    fresh_choice.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    with pytest.raises(FailedPrecondition, match=words):
        cache_folder.worker_folder()


# -- capture and restore -------------------------------------------------------------


def cache_tree(root) -> None:
    write(f"{root}/fxgraph/ab/fabcdef/entry0", b"graph")
    write(f"{root}/aotautograd/aqq/entry1", b"aot")
    write(f"{root}/3z/c3z3wp.main.so", b"\x7fELF")
    write(f"{root}/3z/c3z3wp.main.cpp", b"int main;")
    write(f"{root}/4u/c4udns.py", b"")  # an empty entry is an entry
    write(f"{root}/locks/c3z3wp.lock")  # never captured
    write(f"{root}/gcc/bin/g++")  # a conda toolchain: never captured
    write(f"{root}/fxgraph/.12.34.tmp")  # torch's in-flight temporary
    write(f"{root}/bad name/x")  # not a cache name: skipped
    os.symlink("/etc/passwd", f"{root}/3z/link.so")  # links: skipped


def test_capture_takes_the_cache_entries_only(tmp_path):
    cache_tree(tmp_path)
    got = cache_folder.capture(str(tmp_path))
    assert sorted("/".join(p) for p, _ in got.files) == [
        "3z/c3z3wp.main.cpp", "3z/c3z3wp.main.so", "4u/c4udns.py", "aotautograd/aqq/entry1",
        "fxgraph/ab/fabcdef/entry0"]
    assert got.skipped == 2 and got.nbytes == len(b"graphaot\x7fELFint main;")


def test_restore_round_trip_keeps_bytes_and_modes_and_entries_in_place(tmp_path):
    cache_tree(tmp_path / "a")
    got = cache_folder.capture(str(tmp_path / "a"))
    dest = tmp_path / "b"
    dest.mkdir(mode=0o700)
    write(f"{dest}/3z/c3z3wp.main.cpp", b"already here")
    written, nbytes, present = cache_folder.restore(str(dest), got.files)
    assert (written, present) == (4, 1) and nbytes == got.nbytes - len(b"int main;")
    assert (dest / "fxgraph/ab/fabcdef/entry0").read_bytes() == b"graph"
    assert (dest / "3z/c3z3wp.main.cpp").read_bytes() == b"already here"  # never overwritten
    assert stat.S_IMODE(os.stat(dest / "3z/c3z3wp.main.so").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(dest / "fxgraph/ab/fabcdef/entry0").st_mode) == 0o644
    assert not [n for n in os.listdir(dest / "3z") if n.startswith(".")]  # no temporary left


def test_a_planted_link_redirects_no_write(tmp_path):
    dest, outside = tmp_path / "cache", tmp_path / "outside"
    dest.mkdir(mode=0o700)
    outside.mkdir()
    os.symlink(outside, dest / "fxgraph")
    with pytest.raises(FailedPrecondition, match="is a link or a file"):
        cache_folder.restore(str(dest), [(("fxgraph", "ab", "entry"), b"evil")])
    assert os.listdir(outside) == []


# -- hostile artifacts ---------------------------------------------------------------

HOSTILE = {
    "hidden": {"f:.ssh:authorized_keys": 4},
    "locks": {"f:locks:x.lock": 4},
    "not_an_entry": {"weights.0": 4},
    "too_deep": {"f:" + ":".join("abcdefghijk"): 4},
    "file_and_folder": {"f:a": 1, "f:a:b": 1},
    "space": {"f:a b": 1},
}


def _publish(daemon, name: str, tensors: dict[str, torch.Tensor]) -> str:
    doc = identity(case=name)
    doc["contract"] = {"name": "torch-compile", "version": 1}
    with daemon.client() as c:
        return c.publish(doc, tensors, blocks=[]).key


def test_entries_no_producer_writes_are_refused_before_any_write(daemon, tmp_path):
    cases = {name: {k: torch.full((n,), 7, dtype=torch.uint8) for k, n in spec.items()}
             for name, spec in HOSTILE.items()}
    cases["float_entry"] = {"f:a": torch.zeros(2)}
    cases["2d_entry"] = {"f:a": torch.zeros(2, 2, dtype=torch.uint8)}
    dest = tmp_path / "cache"
    dest.mkdir(mode=0o700)
    with daemon.client() as c:
        for name, tensors in cases.items():
            key = _publish(daemon, name, tensors)
            with c.acquire(key, verify="full") as lease:
                with pytest.raises(FailedPrecondition):
                    check_manifest(lease.manifest)
                with pytest.raises(FailedPrecondition):
                    restore_lease(lease, str(dest))
            assert os.listdir(dest) == [], name


def test_a_published_capture_restores_byte_for_byte(daemon, tmp_path):
    cache_tree(tmp_path / "a")
    tensors = to_tensors(cache_folder.capture(str(tmp_path / "a")), None)
    key = _publish(daemon, "good", tensors)
    dest = tmp_path / "b"
    dest.mkdir(mode=0o700)
    with daemon.client() as c, c.acquire(key, verify="full") as lease:
        restored = restore_lease(lease, str(dest))
    assert (restored.files, restored.present, restored.mega_entries) == (5, 0, 0)
    assert cache_folder.capture(str(dest)).files == cache_folder.capture(str(tmp_path / "a")).files


def test_a_mega_cache_entry_key_that_leaves_the_folder_is_refused(tmp_path, monkeypatch):
    from torch.compiler._cache import CacheArtifactManager

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    CacheArtifactManager._ensure_cache_artifacts_registered()  # what a fresh process's deserialize does
    with CacheArtifactManager.with_fresh_cache():
        CacheArtifactManager.record_artifact("inductor", "../../escape", b"payload")
        data, _ = CacheArtifactManager.serialize()  # type: ignore[misc]
    with pytest.raises(FailedPrecondition, match="not a plain cache name"):
        load_mega(data, what="test")
    assert os.listdir(tmp_path) == [] and not (tmp_path.parent / "escape").exists()
    assert MEGA not in to_tensors(cache_folder.Capture((), 0), b"")
