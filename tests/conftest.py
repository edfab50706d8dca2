"""Shared fixtures. The daemon fixtures start the REAL daemon on temp sockets."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from tests.support.daemon import Daemon, cleanup, make_daemon

SAMPLE_IDENTITY = {
    "contract": {"name": "tiny-dit", "version": 1},
    "sources": [{"name": "model.safetensors", "content_id": "sha256:" + "ab" * 32}],
    "representation": {"dtype": "bfloat16"},
    "layout": {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"},
    "producer": {"id": "example", "version": "1"},
    "extra": {},
}


def identity(**extra) -> dict:
    """SAMPLE_IDENTITY with ``extra`` set, so each test gets its own key."""
    doc = {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in SAMPLE_IDENTITY.items()}
    doc["extra"] = dict(extra)
    return doc


def sample_tensors(blocks: int = 3, width: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small mixed-dtype model: embedding, ``blocks.N.*`` blocks, final norm."""
    g = torch.Generator().manual_seed(seed)
    out = {"embed.weight": torch.randn(32, width, generator=g)}
    for i in range(blocks):
        out[f"blocks.{i}.attn.qkv.weight"] = torch.randn(3 * width, width, generator=g).to(torch.bfloat16)
        out[f"blocks.{i}.attn.qkv.bias"] = torch.randn(3 * width, generator=g).to(torch.bfloat16)
        out[f"blocks.{i}.norm.weight"] = torch.randn(width, generator=g)
        out[f"blocks.{i}.mlp.weight"] = torch.randn(width, width + i, generator=g).to(torch.bfloat16)
    out["final_norm.weight"] = torch.randn(width, generator=g)
    return out


@pytest.fixture
def make_daemon_fixture(tmp_path):
    """Factory: ``make(*extra_args, root=None)`` -> started Daemon; all are
    killed at teardown."""
    started: list[Daemon] = []

    def make(*extra_args: str, root: str | None = None, start: bool = True, env: dict | None = None) -> Daemon:
        d = make_daemon(tmp_path, *extra_args, root=root, env=env)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        cleanup(d)


@pytest.fixture
def daemon(make_daemon_fixture) -> Daemon:
    """One running daemon on a fresh root."""
    return make_daemon_fixture()


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs (a real size-limited filesystem); skipped where mounting is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)
