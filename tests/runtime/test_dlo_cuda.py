"""CUDA-only DLO tests (skipped without a CUDA device).

Only the tests of the registered transport skip where the code declines
registration (an x86 discrete GPU: no read-only registration); staging,
the pinned buffers, the copy stream, the runtime binding and the decline
rule itself run on every GPU (issue 23, findings 1 and 10).

NOT RUN while written: no GPU was lent (docs/gpu.md names the
command that runs them). They follow the CUDA runtime API reference, the
NVIDIA open kernel module (os-mlock.c) and torch's stream/event semantics.
"""

from __future__ import annotations

import mmap
import os
import warnings

import pytest
import torch

from dlo_runtime import REGISTERED, STAGING, enable_layerwise_offload, restore_model
from dlo_runtime.cuda_host import HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY, CudaRegistrar
from dlo_runtime.transports import register_regions, registration_decline_reason
from hwr_client.mapping import PAGE_SIZE
from tests.support.dlo import StagingRegistrar, TestLease, cuda_capability, make_artifact, reference, skeleton

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


def _registrar() -> tuple[CudaRegistrar, object]:
    reg = CudaRegistrar(torch.device("cuda", torch.cuda.current_device()))
    return reg, reg.capability(torch.device("cuda", torch.cuda.current_device()))


def test_registration_round_trip_and_error_cleared(tmp_path):
    reg, cap = cuda_capability()  # skips where the code declines registration
    lease = TestLease(make_artifact(tmp_path, reference(3)))
    choice = register_regions(reg, cap, lease.regions(), keepalive=lease)
    assert choice.kind == REGISTERED, choice.reason
    assert lease.block_bytes(0).is_pinned()  # the runtime sees the mapping as pinned
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
    assert not choice.ranges.active and reg.clear_error() == 0 and not lease.block_bytes(0).is_pinned()


def test_the_decline_rule_matches_what_the_driver_does(tmp_path):
    """A PROT_READ file mapping, as a lease maps its blobs: where the code
    declines (no read-only support), both flags must really fail (else the
    rule throws away a working transport); where it registers, its flags
    must work. The error is cleared either way."""
    reg, cap = _registrar()
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(16 * PAGE_SIZE))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we only take its address
            address = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
        codes = {}
        for name, flags in (("read_only", HOST_REGISTER_READ_ONLY | HOST_REGISTER_PORTABLE),
                            ("default", HOST_REGISTER_PORTABLE)):
            codes[name] = reg.register(address, 16 * PAGE_SIZE, flags)
            if codes[name] == 0:
                assert reg.unregister(address) == 0
            else:
                reg.clear_error()
        assert reg.clear_error() == 0
        if registration_decline_reason(cap):
            assert codes["read_only"] != 0 and codes["default"] != 0, (cap, codes)
        else:
            assert codes["read_only" if cap.read_only_supported else "default"] == 0, (cap, codes)
    finally:
        mm.close()


@pytest.mark.parametrize("kind", [REGISTERED, STAGING])
def test_offload_parity_against_the_resident_model(tmp_path, kind):
    if kind == REGISTERED:
        cuda_capability()  # skips where the code declines registration
    registrar = None if kind == REGISTERED else StagingRegistrar(torch.device("cuda", torch.cuda.current_device()))
    ref, lease, skel = _warm(tmp_path)
    x = torch.randn(8, 8)
    with torch.no_grad():
        resident = ref.to("cuda")(x.cuda())
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cuda", source=lease, registrar=registrar)
    assert handle.stats.transport == kind, handle.stats.reason
    with torch.no_grad():
        for _ in range(2):
            # Not bitwise: a library may pick another kernel for a differently
            # aligned pointer; tightly.
            torch.testing.assert_close(skel(x.cuda()), resident, rtol=1e-5, atol=1e-5)
    for p in skel.blocks.parameters():
        assert p.device.type == "cpu"  # between uses: host views only
    assert all(b.copies >= 2 for b in handle.stats.blocks)
    handle.close()
    assert lease.closed == 1


def test_staging_slots_are_pinned_exactly_and_released(tmp_path):
    """The staging transport's slots: the backend's own exact-size pinned
    buffers (not pin_memory=True's power-of-two blocks), unpinned at close."""
    reg = StagingRegistrar(torch.device("cuda", torch.cuda.current_device()))
    cap = reg.capability(torch.device("cuda", torch.cuda.current_device()))
    ref, lease, skel = _warm(tmp_path)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cuda", source=lease, registrar=reg)
    stats = handle.stats
    largest = max(b.nbytes for b in lease.blocks)
    assert stats.transport == STAGING and stats.staging_bytes == largest
    slots = list(handle._staging)
    if registration_decline_reason(cap, writable=True):
        pytest.skip(f"this device pins no host memory: {registration_decline_reason(cap, writable=True)}")
    assert all(s.is_pinned() for s in slots)
    assert stats.pinned_host_bytes == 2 * (-(-largest // PAGE_SIZE) * PAGE_SIZE)
    x = torch.randn(8, 8)
    with torch.no_grad():
        torch.testing.assert_close(skel(x.cuda()), ref.to("cuda")(x.cuda()), rtol=1e-5, atol=1e-5)
    assert all(b.host_copies == b.copies for b in handle.stats.blocks)
    assert handle.stats.staging_seconds > 0  # the hook thread's memcpys, timed
    handle.close()
    assert not any(s.is_pinned() for s in slots)


def test_ordinary_blocks_pack_into_pinned_memory(tmp_path):
    reg, cap = _registrar()
    if registration_decline_reason(cap, writable=True):
        pytest.skip(f"this device pins no host memory: {registration_decline_reason(cap, writable=True)}")
    ref = reference(3)
    model = reference(3)
    handle = enable_layerwise_offload(model, list(model.blocks), device="cuda")
    host = [p for b in model.blocks for p in b.parameters()]
    assert host and all(p.device.type == "cpu" and p.is_pinned() for p in host)
    assert handle.stats.pinned_host_bytes > 0
    x = torch.randn(8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x.cuda()), ref.to("cuda")(x.cuda()), rtol=1e-5, atol=1e-5)
    handle.close()


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


def _overlapped(copy, kernels) -> float:
    """Microseconds of ``copy`` during which some kernel ran."""
    spans = sorted((max(copy.time_range.start, k.time_range.start), min(copy.time_range.end, k.time_range.end))
                   for k in kernels)
    total, end = 0.0, copy.time_range.start
    for lo, hi in spans:
        lo = max(lo, end)
        if hi > lo:
            total += hi - lo
            end = hi
    return total


def test_copies_overlap_compute_on_streams(tmp_path):
    """Most of the H2D copy time runs while kernels run (the copy of block
    j+2 on the copy stream during block j+1), whatever transport this GPU
    gets: at least half of it, summed over the traced copies."""
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
    transport = handle.stats.transport
    handle.close()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    copies = [e for e in events if "Memcpy HtoD" in e.name]
    kernels = [e for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    assert copies and kernels
    copied = sum(c.time_range.end - c.time_range.start for c in copies)
    hidden = sum(_overlapped(c, kernels) for c in copies)
    assert hidden >= 0.5 * copied, f"{transport}: {hidden:.0f} of {copied:.0f} us of H2D copy overlapped kernels"


def test_registrar_binds_the_runtime_torch_uses(tmp_path):
    """The bound libcudart is torch's own copy (found under torch's dirs,
    cu13 wheels included) and the SAME runtime instance: an error torch's
    binding leaves is the one our binding reads and clears."""
    from dlo_runtime import cuda_host

    reg, _ = _registrar()
    with open("/proc/self/maps") as f:
        maps = f.read()
    candidates = cuda_host.cudart_candidates(maps)
    assert candidates, "torch loaded no shared libcudart"
    dirs = [os.path.join(os.path.realpath(d), "") for d in cuda_host._torch_lib_dirs()]
    assert any(os.path.realpath(reg.runtime_path or "").startswith(d) for d in dirs), (reg.runtime_path, candidates)
    buf = torch.empty(PAGE_SIZE, dtype=torch.uint8)  # never registered: unregistering it fails
    assert reg.clear_error() == 0
    code = int(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))
    assert code != 0
    assert reg.clear_error() == code  # torch's error, seen (and cleared) through our handle
    assert reg.clear_error() == 0
