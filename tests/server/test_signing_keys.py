"""Signing keys (docs/trust.md): `hwr keys generate | show | rotate`, and
the checks a private key file must pass before the daemon signs with it
(as for a credentials file: no link followed, no FIFO waited on, owner,
mode, size)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_server.remote.signing import (
    MAX_KEY_FILE_BYTES, load_private_key, parse_public_key, parse_trusted_keys, public_of,
)
from tests.support.paths import REPO_DIR
from tests.support.trust import NOBODY, new_key


def _hwr(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "hwr_client.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_generate_show_and_rotate(tmp_path):
    path = str(tmp_path / "signing.key")
    made = _hwr("keys", "generate", path, "--json")
    assert made.returncode == 0, made.stderr
    first = json.loads(made.stdout)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    assert first["public_key"].startswith("ssh-ed25519 ") and first["id"].startswith("SHA256:")
    # The line is what trusted_keys takes; the id is its OpenSSH fingerprint.
    assert parse_public_key(first["public_key"], what="t").id == first["id"]
    again = _hwr("keys", "generate", path)
    assert again.returncode == 4 and "exists" in again.stderr  # never overwrites a key
    shown = json.loads(_hwr("keys", "show", path, "--json").stdout)
    assert shown == first
    rotated = _hwr("keys", "rotate", path, "--json")
    assert rotated.returncode == 0, rotated.stderr
    new = json.loads(rotated.stdout)
    assert new["id"] != first["id"] and new["previous_id"] == first["id"]
    assert json.loads(_hwr("keys", "show", path, "--json").stdout)["id"] == new["id"]
    kept = new["previous_key_file"]
    assert public_of(load_private_key(kept).public_key()).id == first["id"]
    assert stat.S_IMODE(os.lstat(kept).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == sorted(["signing.key", os.path.basename(kept)])  # no temp file left
    plain = _hwr("keys", "rotate", path)
    assert plain.returncode == 0, plain.stderr
    assert "trusted_keys" in plain.stdout and plain.stdout.startswith("ssh-ed25519 ")
    # Two rotations within one second keep both previous keys under distinct names.
    again = _hwr("keys", "rotate", path, "--json")
    assert again.returncode == 0, again.stderr
    kept_names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".old"))
    assert len(kept_names) == 3 and os.path.basename(kept) in kept_names
    assert public_of(load_private_key(kept).public_key()).id == first["id"]


def test_a_key_file_is_trusted_only_as_a_credentials_file(tmp_path):
    path = str(tmp_path / "k.key")
    private, public = new_key(path)
    assert public_of(load_private_key(path).public_key()).id == public.id
    os.chmod(path, 0o640)
    with pytest.raises(FailedPrecondition, match="mode 0640 lets others read or change it"):
        load_private_key(path)
    os.chmod(path, 0o600)
    link = str(tmp_path / "link.key")
    os.symlink(path, link)
    with pytest.raises(FailedPrecondition, match="symbolic link"):
        load_private_key(link)
    os.chown(path, NOBODY.pw_uid, -1)
    with pytest.raises(FailedPrecondition, match=f"owned by uid {NOBODY.pw_uid}"):
        load_private_key(path)
    fifo = str(tmp_path / "fifo.key")
    os.mkfifo(fifo, 0o600)
    done = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            load_private_key(fifo)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)
        done.set()

    threading.Thread(target=load, daemon=True).start()
    assert done.wait(30), "opening a FIFO key file blocked"  # O_NONBLOCK: refused at once, no writer needed
    assert isinstance(errors[0], FailedPrecondition) and "expected a regular file" in str(errors[0])
    big = tmp_path / "big.key"
    big.write_bytes(b"x" * (MAX_KEY_FILE_BYTES + 1))
    big.chmod(0o600)
    with pytest.raises(FailedPrecondition, match="over the"):
        load_private_key(str(big))
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    junk.chmod(0o600)
    with pytest.raises(FailedPrecondition, match="not an unencrypted PKCS#8 PEM"):
        load_private_key(str(junk))
    with pytest.raises(FailedPrecondition, match="hwr keys generate"):
        load_private_key(str(tmp_path / "absent.key"))


def test_trusted_keys_are_checked_entry_by_entry(tmp_path):
    _, public = new_key(str(tmp_path / "a.key"))
    assert list(parse_trusted_keys([public.line])) == [public.id]
    for bad in ("", "ssh-ed25519", "ssh-ed25519 !!!", "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ== x"):
        with pytest.raises(InvalidArgument, match=r"trusted_keys\[1\]"):
            parse_trusted_keys([public.line, bad])
