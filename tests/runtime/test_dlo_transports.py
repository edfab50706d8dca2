"""Host transports and the registration policy, through the registrar seam."""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import mmap
import os
import warnings
import weakref

import pytest
import torch

from hwr_client.mapping import PAGE_SIZE, Region
from dlo_runtime import (
    REGISTERED, STAGING, UNIFIED, RegistrationAborted, UnregisterFailed, enable_layerwise_offload, restore_model, retained,
)
from dlo_runtime import cuda_host, transports
from dlo_runtime.cuda_host import (
    HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY, MADV_POPULATE_READ, MADV_WILLNEED, HostCapability, NullRegistrar,
    choose_cudart, cudart_candidates, prefault,
)
from dlo_runtime.copy_engine import pieces
from dlo_runtime.pin_plan import copy_cuts
from dlo_runtime.transports import plan_chunks, register_regions, registration_decline_reason
from tests.support.dlo import FakeRegistrar, TestLease, ToyModel, make_artifact, reference, skeleton
from tests.support.dlo import skip_reason

CHUNK = 2 * PAGE_SIZE  # small chunks, so a toy artifact spans several ranges


def _warm(tmp_path, n_blocks: int = 3, **lease_kw):
    ref = reference(n_blocks)
    lease = TestLease(make_artifact(tmp_path, ref), **lease_kw)
    skel = skeleton(n_blocks)
    restore_model(skel, lease)
    return ref, lease, skel


def _offload(skel, lease, registrar, **kw):
    return enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=lease, registrar=registrar,
                                    chunk_bytes=CHUNK, **kw)


def _spans(lease):
    """(address, nbytes) of every block of the lease: what the backend
    passes so that no chunk boundary falls inside a block."""
    return [(int(lease.block_bytes(b.index).data_ptr()), b.end - b.begin) for b in lease.blocks]


def _warm_wide(tmp_path, n_blocks: int = 3):
    """Blocks of several pages each (width 128), so chunks of CHUNK bytes
    really cut between blocks and the largest block exceeds a chunk."""
    torch.manual_seed(0)
    ref = ToyModel(n_blocks, width=128).eval()
    lease = TestLease(make_artifact(tmp_path, ref))
    with torch.device("meta"):
        skel = ToyModel(n_blocks, width=128)
    skel.init_runtime_buffers().eval()
    restore_model(skel, lease)
    return ref, lease, skel


def test_plan_chunks_page_aligned_and_bounded():
    regions = [Region("a", 16 * PAGE_SIZE, 5 * PAGE_SIZE + 7), Region("b", 64 * PAGE_SIZE, PAGE_SIZE)]
    chunks = plan_chunks(regions, CHUNK)
    assert [(c.address // PAGE_SIZE, c.nbytes // PAGE_SIZE, c.path) for c in chunks] == [
        (16, 2, "a"), (18, 2, "a"), (20, 2, "a"), (64, 1, "b")]
    assert all(c.address % PAGE_SIZE == 0 and c.nbytes % PAGE_SIZE == 0 for c in chunks)
    with pytest.raises(Exception, match="not page-aligned"):
        plan_chunks([Region("c", 3, 10)], CHUNK)


def test_registered_transport_copies_from_the_mapping_without_staging(tmp_path, caplog):
    ref, lease, skel = _warm_wide(tmp_path)
    reg = FakeRegistrar()
    with caplog.at_level(logging.INFO, logger="dlo_runtime.transports"):
        handle = _offload(skel, lease, reg)
    stats = handle.stats
    assert stats.transport == REGISTERED and stats.staging_bytes == 0
    expected = plan_chunks(lease.regions(), CHUNK, _spans(lease))
    assert len(expected) > len(lease.regions())  # really chunked
    flags = HOST_REGISTER_READ_ONLY | HOST_REGISTER_PORTABLE
    assert [(c[1], c[2], c[3]) for c in reg.calls] == [(c.address, c.nbytes, flags) for c in expected]
    # Every piece of every block's copy comes out of ONE registered range; a
    # block is cut only where blocks share a page, by less than a page.
    cut_blocks = 0
    for address, nbytes in _spans(lease):
        cuts = copy_cuts(address, nbytes, expected)
        cut_blocks += bool(cuts)
        assert all(c < PAGE_SIZE for c in cuts)
        for lo, hi in pieces(nbytes, cuts):
            assert sum(1 for c in expected if c.address <= address + lo and address + hi <= c.address + c.nbytes) == 1
    assert cut_blocks >= 1  # the artifact packs blocks back to back: some share a page
    assert max(c.nbytes for c in expected) > CHUNK  # the largest block is one chunk of its own
    assert stats.registered_bytes == sum(c.nbytes for c in expected)
    assert stats.registration_calls == len(expected)
    logged = [r.getMessage() for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(logged) == len(expected) and all(f"{c.nbytes} bytes" in m for c, m in zip(expected, logged))
    x = torch.randn(3, 8)
    assert torch.equal(skel(x), ref(x))
    assert all(b.host_copies == 0 for b in handle.stats.blocks)
    handle.close()
    assert reg.registered == {} and lease.closed == 1
    assert handle.trail[-2:] == ["unregister", "close_lease"]  # unregister strictly before close


@pytest.mark.parametrize("k", [0, 2])
def test_register_fails_at_range_k_rolls_back_to_staging(tmp_path, k):
    ref, lease, skel = _warm_wide(tmp_path)
    reg = FakeRegistrar(fail_at=k)
    handle = _offload(skel, lease, reg)
    stats = handle.stats
    assert stats.transport == STAGING and f"range {k}" in stats.reason and "rolled back" in stats.reason
    assert reg.registered == {}  # all-or-nothing
    assert reg.pending_error == 0 and reg.clears >= 1  # sticky error cleared
    assert [c[0] for c in reg.calls] == ["register"] * (k + 1) + ["unregister"] * k
    assert stats.staging_bytes == stats.buffer_bytes
    x = torch.randn(3, 8)
    assert torch.equal(skel(x), ref(x))
    assert all(b.host_copies == b.copies for b in handle.stats.blocks)
    handle.close()
    assert lease.closed == 1


def test_rollback_failure_aborts_startup_keeping_the_lease(tmp_path):
    ref, lease, skel = _warm_wide(tmp_path)
    reg = FakeRegistrar(fail_at=2, unregister_failures=-1)
    with pytest.raises(RegistrationAborted, match="lease stays open"):
        _offload(skel, lease, reg)
    assert lease.closed == 0  # memory still registered: never unmapped
    assert reg.registered and reg.pending_error == 0
    stuck = [b for b in retained() if b.lease is lease]
    assert len(stuck) == 1 and stuck[0].trail[-1] == "retain_lease"
    # Process teardown / operator retry once the platform lets go:
    reg.unregister_failures = 0
    stuck[0].close()
    assert reg.registered == {} and lease.closed == 1
    assert stuck[0] not in retained()


def test_unregister_fails_once_then_succeeds_on_retry(tmp_path):
    ref, lease, skel = _warm(tmp_path)
    reg = FakeRegistrar()
    handle = _offload(skel, lease, reg)
    n = len(reg.registered)
    reg.unregister_failures = 1
    with pytest.raises(UnregisterFailed, match="stay registered"):
        handle.close()
    assert lease.closed == 0 and len(reg.registered) == n  # registration and lease kept
    assert reg.pending_error == 0
    assert handle in retained()
    handle.close()
    assert reg.registered == {} and lease.closed == 1 and handle not in retained()


@pytest.mark.parametrize("case", ["pin_disabled", "unsupported", "read_only_unsupported", "over_limit"])
def test_fallbacks_to_staging_make_no_registration_call(tmp_path, case):
    ref, lease, skel = _warm(tmp_path)
    reg = FakeRegistrar(supported=case != "unsupported", read_only=case != "read_only_unsupported")
    kw = {"pin_memory": False} if case == "pin_disabled" else {}
    if case == "over_limit":
        kw["registration_limit_gib"] = 1e-9
    handle = _offload(skel, lease, reg, **kw)
    assert handle.stats.transport == STAGING
    assert reg.calls == []
    words = {"pin_disabled": "pin policy", "unsupported": "unsupported", "read_only_unsupported": "read-only",
             "over_limit": "registration limit"}[case]
    assert words in handle.stats.reason
    x = torch.randn(3, 8)
    assert torch.equal(skel(x), ref(x))
    handle.close()


def test_cpu_default_registrar_is_unsupported_platform(tmp_path):
    ref, lease, skel = _warm(tmp_path, 2)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=lease)
    assert handle.stats.transport == STAGING and "no CUDA device" in handle.stats.reason
    handle.close()
    assert NullRegistrar().capability(torch.device("cpu")).host_register_supported is False


def test_unified_memory_skips_staging_and_registration(tmp_path):
    ref, lease, skel = _warm(tmp_path)
    reg = FakeRegistrar(unified=True)
    handle = _offload(skel, lease, reg)
    stats = handle.stats
    assert stats.transport == UNIFIED and stats.unified_memory and stats.staging_bytes == 0
    assert reg.calls == []
    x = torch.randn(3, 8)
    assert torch.equal(skel(x), ref(x))
    handle.close()


def test_registered_and_staging_move_identical_payload(tmp_path):
    x = torch.randn(3, 8)
    payload = {}
    for kind, reg in (("registered", FakeRegistrar()), ("staging", FakeRegistrar(supported=False))):
        ref, lease, skel = _warm(tmp_path / kind)
        handle = _offload(skel, lease, reg)
        assert handle.stats.transport == kind
        out = skel(x)
        payload[kind] = ([(b.nbytes, b.copies, b.h2d_bytes) for b in handle.stats.blocks], out)
        handle.close()
    assert payload["registered"][0] == payload["staging"][0]
    assert torch.equal(payload["registered"][1], payload["staging"][1])


# --- prefault, keep-alive, libcudart choice, the shared decline rule ----------------------

def test_prefault_runs_before_any_register_call(tmp_path):
    ref, lease, skel = _warm(tmp_path)
    order = []
    reg = FakeRegistrar()
    real_register = reg.register

    def register(address, nbytes, flags):
        order.append(("register", address, nbytes))
        return real_register(address, nbytes, flags)

    reg.register = register
    choice = register_regions(reg, reg.cap, lease.regions(), keepalive=lease, chunk_bytes=CHUNK,
                              prefault_fn=lambda a, n: order.append(("prefault", a, n)) or "fake")
    assert choice.kind == REGISTERED
    chunks = plan_chunks(lease.regions(), CHUNK)
    # Every chunk is faulted in before the first pin (and, with a daemon,
    # before the admission request: tests/runtime/test_registration_wiring.py).
    expected = [("prefault", c.address, c.nbytes) for c in chunks] + [("register", c.address, c.nbytes) for c in chunks]
    assert order == expected
    assert [how for _, how, _ in choice.ranges.prefaults] == ["fake"] * len(chunks)
    choice.ranges.unregister()


def test_backend_prefaults_by_default(tmp_path, monkeypatch):
    ref, lease, skel = _warm(tmp_path)
    seen = []
    monkeypatch.setattr(transports, "prefault", lambda a, n: seen.append((a, n)) or "fake")
    handle = _offload(skel, lease, FakeRegistrar())
    assert handle.stats.transport == REGISTERED
    assert seen == [(c.address, c.nbytes) for c in plan_chunks(lease.regions(), CHUNK, _spans(lease))]
    handle.close()


def _resident_pages(address, nbytes):
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (nbytes + PAGE_SIZE - 1) // PAGE_SIZE
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(address), nbytes, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def test_prefault_populates_a_real_file_mapping(tmp_path):
    path = tmp_path / "blob"
    nbytes = 64 * PAGE_SIZE + 123
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())  # clean pages: the kernel may drop them for the cold start below
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: torch warns, we only read its address
            address = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
        how = prefault(address, nbytes, threads=3)
        assert how in ("populate_read", "willneed"), how
        if how == "populate_read":
            assert _resident_pages(address, nbytes) == (nbytes + PAGE_SIZE - 1) // PAGE_SIZE
    finally:
        mm.close()


def test_prefault_falls_back_to_willneed_and_never_raises():
    calls = []

    def old_kernel(address, nbytes, advice):
        calls.append((address, nbytes, advice))
        return errno.EINVAL if advice == MADV_POPULATE_READ else 0

    base = 1024 * PAGE_SIZE
    assert prefault(base, 10 * PAGE_SIZE, threads=4, madvise=old_kernel) == "willneed"
    populate = sorted(c for c in calls if c[2] == MADV_POPULATE_READ)
    # page-aligned slices that tile the range exactly, one per thread
    assert len(populate) == 4 and populate[0][0] == base
    assert all(a % PAGE_SIZE == 0 for a, _, _ in populate)
    assert sum(n for _, n, _ in populate) == 10 * PAGE_SIZE
    assert all(a + n == b for (a, n, _), (b, _, _) in zip(populate, populate[1:]))
    assert calls[-1] == (base, 10 * PAGE_SIZE, MADV_WILLNEED)
    assert prefault(base, PAGE_SIZE, madvise=lambda a, n, adv: errno.ENOMEM).startswith("none:")


def test_registration_keepalive_holds_the_mappings_until_unregister(tmp_path):
    artifact = make_artifact(tmp_path, reference(2))
    lease = TestLease(artifact)
    maps = [weakref.ref(m) for m in artifact._maps]
    reg = FakeRegistrar()
    choice = register_regions(reg, reg.cap, lease.regions(), keepalive=lease, chunk_bytes=CHUNK, prefault_fn=None)
    assert choice.kind == REGISTERED
    # The lease drops its own references (what a teardown in the wrong order
    # would do): the registered ranges must still keep every mmap alive.
    artifact.release()
    del artifact, lease
    gc.collect()
    assert all(m() is not None for m in maps)
    choice.ranges.unregister()
    assert choice.ranges.holds is None
    gc.collect()
    assert all(m() is None for m in maps)  # after unregister, nothing of ours pins the mapping


TORCH_SITE = "/venv/lib/python3.12/site-packages"
MAPS = "\n".join([
    "7f00-7f01 r-xp 00000000 08:01 11 /opt/other/lib/libcudart.so.12.4.127",
    "7f01-7f02 r--p 00000000 08:01 12",
    f"7f02-7f03 r-xp 00000000 08:01 13 {TORCH_SITE}/torch/lib/libcudart-9335f6a2.so.12",
    f"7f03-7f04 r--p 00001000 08:01 13 {TORCH_SITE}/torch/lib/libcudart-9335f6a2.so.12",
    "7f04-7f05 r-xp 00000000 08:01 14 /usr/lib/libcudart_static_helper.so",
    "7f05-7f06 r-xp 00000000 08:01 15 /usr/lib/libcudnn.so.9",
])


def test_cudart_found_by_pattern_preferring_torchs_copy():
    assert cudart_candidates(MAPS) == ["/opt/other/lib/libcudart.so.12.4.127",
                                       f"{TORCH_SITE}/torch/lib/libcudart-9335f6a2.so.12"]
    torch_dirs = [f"{TORCH_SITE}/torch/lib", f"{TORCH_SITE}/nvidia/cuda_runtime"]
    assert choose_cudart(cudart_candidates(MAPS), torch_dirs) == f"{TORCH_SITE}/torch/lib/libcudart-9335f6a2.so.12"
    wheel = f"{TORCH_SITE}/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert choose_cudart(["/opt/other/libcudart.so", wheel], torch_dirs) == wheel
    assert choose_cudart(["/opt/other/libcudart.so"], torch_dirs) == "/opt/other/libcudart.so"
    assert choose_cudart([], torch_dirs) is None


def test_chosen_cudart_path_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="dlo_runtime.cuda_host"):
        assert cuda_host._loaded_cudart_path(MAPS) == "/opt/other/lib/libcudart.so.12.4.127"  # torch's dirs differ here
    assert any("/opt/other/lib/libcudart.so.12.4.127" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bits", range(16))
def test_cuda_tests_skip_exactly_where_the_code_declines(bits):
    supported, read_only, page_tables, unified = (bool(bits >> i & 1) for i in range(4))
    cap = HostCapability("cuda", supported, read_only, page_tables, unified, "")
    code_declines = register_regions(FakeRegistrar(), cap, [], keepalive=None).kind == STAGING
    assert bool(skip_reason(cap)) == code_declines
    assert bool(registration_decline_reason(cap)) == code_declines


def test_cuda_registrar_calls_run_in_its_device_with_the_context_created(monkeypatch):
    """Through a fake libcudart: every register/unregister enters
    torch.cuda.device(index) and forces the primary context (cudaFree(0))
    before the runtime call."""
    order = []

    class FakeLib:
        def cudaFree(self, ptr):
            order.append("cudaFree")
            return 0

        def cudaHostRegister(self, ptr, n, flags):
            order.append("cudaHostRegister")
            return 0

        def cudaHostUnregister(self, ptr):
            order.append("cudaHostUnregister")
            return 0

    class FakeDevice:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            order.append(("enter", self.index))

        def __exit__(self, *exc):
            order.append(("exit", self.index))

    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    reg = cuda_host.CudaRegistrar(torch.device("cuda", 3), maps_text="")
    assert reg._lib is None  # no runtime in the fake maps
    reg._lib = FakeLib()
    assert reg.register(0x10000, PAGE_SIZE, HOST_REGISTER_READ_ONLY) == 0
    assert reg.unregister(0x10000) == 0
    assert order == [("enter", 3), "cudaFree", "cudaHostRegister", ("exit", 3),
                     ("enter", 3), "cudaFree", "cudaHostUnregister", ("exit", 3)]
