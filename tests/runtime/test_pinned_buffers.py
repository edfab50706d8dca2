"""The backend's own pinned host buffers (issue 23, finding 6): exact sizes
in one anonymous mapping, registered writable (default + portable flags,
also where read-only registration is unsupported), under the daemon's
admission, unregistered at close. The registrar is the fake seam; the
mapping, the daemon and the backend are real."""

from __future__ import annotations

import ctypes

import pytest
import torch

from dlo_runtime import STAGING, restore_model
from dlo_runtime.backend import OffloadBackend
from dlo_runtime.cuda_host import HOST_REGISTER_PORTABLE
from dlo_runtime.options import OffloadOptions
from dlo_runtime.pin_plan import copy_cuts
from dlo_runtime.pinned import PinnedBuffers
from hwr_client.mapping import PAGE_SIZE
from hwr_client.registration import RegistrationBroker
from tests.support.daemon import cleanup
from tests.support.dlo import FakeRegistrar, TestLease, make_artifact, reference, skeleton
from tests.support.registration import start as _start, stats as _stats


def _resident_pages(address: int, nbytes: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // PAGE_SIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(address), nbytes, vec) == 0
    return sum(v & 1 for v in vec)


def test_exact_sizes_one_mapping_registered_writable_between_buffers():
    reg = FakeRegistrar(read_only=False)  # an x86 discrete GPU: no read-only registration
    sizes = [5000, 5000, 1]
    pins = PinnedBuffers(reg, reg.cap, sizes, pin=True, label="staging slots", chunk_bytes=PAGE_SIZE)
    assert pins.pinned, pins.choice.reason
    assert [b.numel() for b in pins.buffers] == sizes  # not rounded to a power of two
    assert pins.nbytes == 2 * 2 * PAGE_SIZE + PAGE_SIZE  # page-rounded, nothing more
    assert all(b.data_ptr() % PAGE_SIZE == 0 for b in pins.buffers)
    registers = [c for c in reg.calls if c[0] == "register"]
    assert {c[3] for c in registers} == {HOST_REGISTER_PORTABLE}  # default flag: the CPU writes them
    assert sum(c[2] for c in registers) == pins.nbytes
    # Each buffer inside one registration, though larger than a chunk.
    assert all(copy_cuts(b.data_ptr(), b.numel(), pins.ranges.chunks) == () for b in pins.buffers)
    how = {h for _, h, _ in pins.ranges.prefaults}
    if how == {"populate_write"}:
        assert _resident_pages(pins.address, pins.nbytes) == pins.nbytes // PAGE_SIZE
    pins.buffers[1].fill_(7)
    assert int(pins.buffers[1].sum()) == 7 * 5000 and int(pins.buffers[0].sum()) == 0
    pins.unregister()
    assert reg.registered == {} and not pins.ranges.active


@pytest.mark.parametrize("case", ["policy", "unsupported"])
def test_declined_buffers_stay_pageable_and_usable(case):
    reg = FakeRegistrar(supported=case != "unsupported")
    pins = PinnedBuffers(reg, reg.cap, [100], pin=case != "policy")
    assert not pins.pinned and reg.calls == []
    assert ("pin policy" if case == "policy" else "unsupported") in pins.choice.reason
    pins.buffers[0].fill_(1)
    assert pins.buffers[0].numel() == 100
    pins.unregister()  # nothing to do: never raises


def test_admission_counts_anonymous_buffers_and_gets_them_back(tmp_path):
    d = _start(tmp_path, registration_budget_bytes=64 * PAGE_SIZE, registration_chunk_bytes=PAGE_SIZE)
    client = d.client()
    try:
        reg = FakeRegistrar()
        pins = PinnedBuffers(reg, reg.cap, [3 * PAGE_SIZE, 10], pin=True,
                             broker=RegistrationBroker(client.session()), label="staging slots")
        assert pins.pinned and "admitted by the node daemon" in pins.choice.reason
        s = _stats(d)
        assert s["hwr_registration_admitted_bytes"] == pins.nbytes == 4 * PAGE_SIZE
        # Reported in pieces of the daemon's chunk: one per page.
        assert s["hwr_registration_chunks_total"] == 4
        pins.unregister()
        assert _stats(d)["hwr_registration_admitted_bytes"] == 0
        # Over the budget: refused, pageable, no registrar call.
        reg2 = FakeRegistrar()
        big = PinnedBuffers(reg2, reg2.cap, [65 * PAGE_SIZE], pin=True, broker=RegistrationBroker(client.session()))
        assert not big.pinned and "(budget)" in big.choice.reason and reg2.calls == []
    finally:
        client.close()
        cleanup(d)


def _backend(skel, reg, *, source=None, **kw):
    b = OffloadBackend(skel, list(skel.blocks), OffloadOptions(device="cpu", registrar=reg, **kw), source=source)
    b._pin_host = True  # the seam: what a CUDA device does, against the fake registrar
    return b.start()


def test_backend_staging_slots_are_pinned_exactly_and_unregistered_at_close(tmp_path):
    ref = reference(3)
    lease = TestLease(make_artifact(tmp_path, ref))
    skel = skeleton(3)
    restore_model(skel, lease)
    reg = FakeRegistrar(read_only=False)  # the lease is declined (staging); the slots still pin
    handle = _backend(skel, reg, source=lease)
    stats = handle.stats
    assert stats.transport == STAGING and "read-only" in stats.reason
    largest = max(b.nbytes for b in lease.blocks)
    assert stats.staging_bytes == largest  # exact, not a power of two
    assert stats.pinned_host_bytes == 2 * (-(-largest // PAGE_SIZE) * PAGE_SIZE)
    assert "pinned:staging slots" in handle.trail
    x = torch.randn(3, 8)
    assert torch.equal(skel(x), ref(x))
    assert all(b.host_copies == b.copies for b in handle.stats.blocks)
    assert reg.registered  # still pinned while the backend lives
    handle.close()
    assert reg.registered == {} and lease.closed == 1


def test_backend_ordinary_blocks_pack_into_one_pinned_mapping(tmp_path):
    ref = reference(3)
    model = reference(3)
    reg = FakeRegistrar()
    handle = _backend(model, reg)
    registers = [c for c in reg.calls if c[0] == "register"]
    assert registers and {c[3] for c in registers} == {HOST_REGISTER_PORTABLE}
    assert handle.stats.pinned_host_bytes == sum(c[2] for c in registers)
    # Every block's packed bytes lie in that one mapping.
    lo = min(c[1] for c in registers)
    hi = max(c[1] + c[2] for c in registers)
    assert all(lo <= p.data_ptr() < hi for b in model.blocks for p in b.parameters())
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))
    handle.close()
    assert reg.registered == {}
