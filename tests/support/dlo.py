"""Shared pieces of the DLO tests: a toy DiT-like model, real artifacts on
disk, and the two explicit seams (a lease-like wrapper, a fake registrar).

``TestLease`` is the documented test seam for a lease: a real
``MappedArtifact`` (real files, real read-only mmap) plus ``close()``; the
real daemon lease is exercised in test_dlo_transaction.py when
``hwr_client.lease`` exists.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dlo_runtime.cuda_host import CudaRegistrar, HostCapability
from dlo_runtime.transports import registration_decline_reason
from hwr_client.local import write_artifact
from hwr_client.mapping import MappedArtifact
from hwr_client.tensors import build_plan
from tests.conftest import identity


class ToyBlock(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width, bias=False)
        self.gate = nn.Parameter(torch.randn(width).to(torch.bfloat16))
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("cache", torch.arange(width, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x))))
        return x + h * self.scale * self.gate.float() + self.cache * 1e-3


class ToyModel(nn.Module):
    """Embedding, ``blocks.N`` (hidden width grows with N: heterogeneous
    block sizes), final norm."""

    def __init__(self, n_blocks: int, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(ToyBlock(width, 8 * (i + 1)) for i in range(n_blocks))
        self.final_norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.final_norm(x)

    def init_runtime_buffers(self) -> "ToyModel":
        """Non-persistent state a skeleton computes itself (not in artifacts)."""
        for b in self.blocks:
            b.cache = torch.arange(b.cache.shape[0], dtype=torch.float32)
        return self


def reference(n_blocks: int, seed: int = 0) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel(n_blocks).eval()


def skeleton(n_blocks: int) -> ToyModel:
    with torch.device("meta"):
        model = ToyModel(n_blocks)
    return model.init_runtime_buffers().eval()


def make_artifact(directory, model: nn.Module, **extra) -> MappedArtifact:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    manifest, paths = write_artifact(str(directory), build_plan(identity(**extra), sd), sd)
    return MappedArtifact(manifest, paths)


class TestLease:
    """Lease test seam: MappedArtifact API + close(); refuses pickling.

    ``fail_block_bytes`` is a failpoint: block_bytes() raises, which makes
    backend setup fail after the backend took ownership.
    """

    __test__ = False  # not a pytest class

    def __init__(self, artifact: MappedArtifact, *, fail_block_bytes: bool = False):
        self.artifact = artifact
        self.closed = 0
        self.fail_block_bytes = fail_block_bytes

    manifest = property(lambda self: self.artifact.manifest)
    blocks = property(lambda self: self.artifact.blocks)

    def tensors(self):
        return self.artifact.tensors()

    def block_bytes(self, i):
        if self.fail_block_bytes:
            raise RuntimeError(f"failpoint: block_bytes({i})")
        return self.artifact.block_bytes(i)

    def block_tensors(self, i):
        return self.artifact.block_tensors(i)

    def regions(self):
        return self.artifact.regions()

    def file_bytes(self, i):
        return self.artifact.file_bytes(i)

    def check_unchanged(self):
        self.artifact.check_unchanged()

    def close(self):
        self.closed += 1

    def __reduce__(self):
        raise TypeError("TestLease is process-local")


class FakeRegistrar:
    """Registrar seam: records calls; fails register at call ``fail_at``;
    fails unregister ``unregister_failures`` times (-1: always). A failed
    call sets ``pending_error`` until ``clear_error()``."""

    def __init__(self, *, supported=True, read_only=True, unified=False, fail_at=None, unregister_failures=0):
        self.cap = HostCapability("cuda", supported, read_only, False, unified, "" if supported else "fake: no")
        self.fail_at = fail_at
        self.unregister_failures = unregister_failures
        self.registered: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.pending_error = 0
        self.clears = 0

    def capability(self, device):
        return self.cap

    def register(self, address, nbytes, flags):
        k = sum(1 for c in self.calls if c[0] == "register")
        self.calls.append(("register", address, nbytes, flags))
        if self.fail_at is not None and k == self.fail_at:
            self.pending_error = 2  # cudaErrorMemoryAllocation
            return 2
        self.registered[address] = nbytes
        return 0

    def unregister(self, address):
        self.calls.append(("unregister", address))
        if self.unregister_failures:
            self.unregister_failures -= 1 if self.unregister_failures > 0 else 0
            self.pending_error = 1
            return 1
        del self.registered[address]
        return 0

    def clear_error(self):
        self.clears += 1
        code, self.pending_error = self.pending_error, 0
        return code


# -- tests of the helpers themselves ------------------------------------------


def cuda_capability():
    reg = CudaRegistrar()
    cap = reg.capability(torch.device("cuda", torch.cuda.current_device()))
    reason = skip_reason(cap)
    if reason:
        pytest.skip(f"host registration not usable here: {reason} ({cap})")
    return reg, cap


class StagingRegistrar(CudaRegistrar):
    """The real CUDA registrar answering as an x86 discrete GPU does (no
    read-only registration): a lease stages, the backend's own buffers
    still pin. On such a GPU it changes nothing; elsewhere it forces the
    staging transport with pinned slots."""

    def capability(self, device):
        return dataclasses.replace(super().capability(device), read_only_supported=False,
                                   uses_host_page_tables=False)


def skip_reason(cap: HostCapability) -> str:
    """Why these tests skip on ``cap``: exactly the code's decline rule
    (tests/runtime/test_dlo_transports.py checks the two agree on every capability)."""
    return registration_decline_reason(cap)
