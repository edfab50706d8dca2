"""Host transports and the registration policy, through the registrar seam."""

from __future__ import annotations

import logging

import pytest
import torch

from hwr_client.mapping import PAGE_SIZE, Region
from dlo_runtime import (
    REGISTERED, STAGING, UNIFIED, RegistrationAborted, UnregisterFailed, enable_layerwise_offload, restore_model, retained,
)
from dlo_runtime.cuda_host import HOST_REGISTER_READ_ONLY, NullRegistrar
from dlo_runtime.transports import plan_chunks
from tests.test_dlo_common import FakeRegistrar, TestLease, make_artifact, reference, skeleton

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


def test_plan_chunks_page_aligned_and_bounded():
    regions = [Region("a", 16 * PAGE_SIZE, 5 * PAGE_SIZE + 7), Region("b", 64 * PAGE_SIZE, PAGE_SIZE)]
    chunks = plan_chunks(regions, CHUNK)
    assert [(c.address // PAGE_SIZE, c.nbytes // PAGE_SIZE, c.path) for c in chunks] == [
        (16, 2, "a"), (18, 2, "a"), (20, 2, "a"), (64, 1, "b")]
    assert all(c.address % PAGE_SIZE == 0 and c.nbytes % PAGE_SIZE == 0 for c in chunks)
    with pytest.raises(Exception, match="not page-aligned"):
        plan_chunks([Region("c", 3, 10)], CHUNK)


def test_registered_transport_copies_from_the_mapping_without_staging(tmp_path, caplog):
    ref, lease, skel = _warm(tmp_path)
    reg = FakeRegistrar()
    with caplog.at_level(logging.INFO, logger="dlo_runtime.transports"):
        handle = _offload(skel, lease, reg)
    stats = handle.stats
    assert stats.transport == REGISTERED and stats.staging_bytes == 0
    expected = plan_chunks(lease.regions(), CHUNK)
    assert len(expected) > len(lease.regions())  # really chunked
    assert [(c[1], c[2], c[3]) for c in reg.calls] == [(c.address, c.nbytes, HOST_REGISTER_READ_ONLY) for c in expected]
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
    ref, lease, skel = _warm(tmp_path)
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
    ref, lease, skel = _warm(tmp_path)
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
