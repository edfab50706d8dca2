"""CUDA-only DLO tests (skipped without a CUDA device).

NOT RUN while written: the development machine had no GPU. They follow the
CUDA runtime API reference and torch's stream/event semantics.
"""

from __future__ import annotations

import os

import pytest
import torch

from dlo_runtime import REGISTERED, STAGING, enable_layerwise_offload, restore_model
from dlo_runtime.cuda_host import NullRegistrar
from dlo_runtime.transports import register_regions
from tests.support.dlo import TestLease, cuda_capability, make_artifact, reference, skeleton

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _warm(tmp_path, n=4):
    ref = reference(n)
    lease = TestLease(make_artifact(tmp_path, ref))
    skel = skeleton(n)
    restore_model(skel, lease)
    return ref, lease, skel


def test_registration_round_trip_and_error_cleared(tmp_path):
    reg, cap = cuda_capability()
    lease = TestLease(make_artifact(tmp_path, reference(3)))
    choice = register_regions(reg, cap, lease.regions(), keepalive=lease)
    assert choice.kind == REGISTERED, choice.reason
    # Registering the same ranges again fails (already registered); the
    # failure is rolled back cleanly and the runtime error is cleared.
    again = register_regions(reg, cap, lease.regions(), keepalive=lease)
    assert again.kind == STAGING and "rolled back" in again.reason
    assert reg.clear_error() == 0
    torch.ones(4, device="cuda").add_(1)
    torch.cuda.synchronize()  # would raise a leftover error
    src = lease.block_bytes(0)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()  # the async copy out of registered memory must land before comparing
    assert torch.equal(dst.cpu(), src)
    choice.ranges.unregister()
    assert not choice.ranges.active and reg.clear_error() == 0


def test_offload_parity_on_cuda_registered_and_staging(tmp_path):
    cuda_capability()
    x = torch.randn(8, 8)
    outs, payload = {}, {}
    for kind, registrar in (("registered", None), ("staging", NullRegistrar("test: staging"))):
        ref, lease, skel = _warm(tmp_path / kind)
        resident = ref.to("cuda")(x.cuda())
        handle = enable_layerwise_offload(skel, list(skel.blocks), device="cuda", source=lease, registrar=registrar)
        assert handle.stats.transport == kind
        with torch.no_grad():
            outs[kind] = skel(x.cuda())
        # Bitwise on CPU; on CUDA a library may pick another kernel for a
        # differently aligned pointer, so compare tightly, not bitwise.
        torch.testing.assert_close(outs[kind], resident, rtol=1e-5, atol=1e-5)
        for p in skel.blocks.parameters():
            assert p.device.type == "cpu"  # between uses: host views only
        payload[kind] = [(b.nbytes, b.copies, b.h2d_bytes) for b in handle.stats.blocks]
        handle.close()
        assert lease.closed == 1
    assert payload["registered"] == payload["staging"]
    assert torch.equal(outs["registered"], outs["staging"])


class _Big(torch.nn.Module):
    """Blocks heavy enough that a copy and a kernel can overlap visibly."""

    def __init__(self, n: int, width: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))
            for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_copy_overlaps_compute_on_streams(tmp_path):
    """The next block's H2D copy runs on the copy stream while a block's
    kernels run: some copy interval intersects some kernel interval."""
    cuda_capability()
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    n, width = 6, 2048
    ref = _Big(n, width).eval()
    lease = TestLease(make_artifact(tmp_path, ref))
    with torch.device("meta"):
        skel = _Big(n, width)
    restore_model(skel, lease)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cuda", source=lease)
    x = torch.randn(8192, width, device="cuda")
    with torch.no_grad():
        expected = ref.to("cuda")(x)
        torch.testing.assert_close(skel(x), expected, rtol=1e-4, atol=1e-4)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                skel(x)
            torch.cuda.synchronize()  # all traced work must finish inside the profile
    assert all(b.copies >= 3 for b in handle.stats.blocks)
    handle.close()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    copies = [e for e in events if "Memcpy HtoD" in e.name]
    kernels = [e for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    assert copies and kernels
    overlap = any(c.time_range.start < k.time_range.end and k.time_range.start < c.time_range.end
                  for c in copies for k in kernels)
    assert overlap, "no H2D copy overlapped a compute kernel"


def test_registrar_binds_torchs_cudart_and_registers_in_its_device(tmp_path):
    """The bound runtime is the one torch loaded (its error state
    is torch's), and a registration made with another device current still
    lands in the registrar's device context."""
    from dlo_runtime import cuda_host

    reg, cap = cuda_capability()
    with open("/proc/self/maps") as f:
        maps = f.read()
    candidates = cuda_host.cudart_candidates(maps)
    assert candidates, "torch loaded no shared libcudart"
    chosen = cuda_host._loaded_cudart_path(maps)
    dirs = [os.path.join(os.path.realpath(d), "") for d in cuda_host._torch_lib_dirs()]
    torchs = [c for c in candidates if any(os.path.realpath(c).startswith(d) for d in dirs)]
    assert chosen == (torchs[0] if torchs else candidates[0]), (chosen, candidates)
    lease = TestLease(make_artifact(tmp_path, reference(2)))
    choice = register_regions(reg, cap, lease.regions(), keepalive=lease)
    assert choice.kind == REGISTERED, choice.reason
    assert all(how in ("populate_read", "willneed") for _, how, _ in choice.ranges.prefaults)
    src = lease.block_bytes(0)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()  # the DMA must land before comparing
    assert torch.equal(dst.cpu(), src)
    choice.ranges.unregister()
    assert reg.clear_error() == 0


def test_staging_slots_and_copy_stream_on_cuda(tmp_path):
    """The staging transport's pinned slots and copy stream/events move the
    same bytes the registered path does (every CUDA-only path has a test)."""
    cuda_capability()
    ref, lease, skel = _warm(tmp_path)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cuda", source=lease,
                                      registrar=NullRegistrar("test: staging"))
    assert handle.stats.transport == STAGING and handle.stats.staging_bytes > 0
    x = torch.randn(8, 8)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(skel(x.cuda()), ref.to("cuda")(x.cuda()), rtol=1e-5, atol=1e-5)
    assert all(b.copies >= 2 and b.host_copies == b.copies for b in handle.stats.blocks)
    handle.close()
