"""DLO backend on CPU: parity with the resident model, one copy per block,
two buffers sized to the largest block, no device memory between uses."""

from __future__ import annotations

import pickle

import pytest
import torch

from hwr_client.carrier import LeaseCarrier
from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from dlo_runtime import ORDINARY, STAGING, OffloadOptions, enable_layerwise_offload, restore_model
from tests.support.dlo import TestLease, make_artifact, reference, skeleton


def _warm(tmp_path, n_blocks: int):
    ref = reference(n_blocks)
    lease = TestLease(make_artifact(tmp_path, ref))
    skel = skeleton(n_blocks)
    restore_model(skel, lease)
    return ref, lease, skel


def _assert_no_device_memory(handle, model) -> None:
    ranges = handle.buffer_ranges()
    for name, p in model.named_parameters():
        ptr = p.data_ptr()
        assert not any(a <= ptr < b for a, b in ranges), f"{name} still points into a device buffer"


@pytest.mark.parametrize("n_blocks,resident", [(1, 0), (2, 0), (3, 0), (7, 0), (7, 2), (3, 3)])
def test_parity_with_resident_model_from_lease(tmp_path, n_blocks, resident):
    ref, lease, skel = _warm(tmp_path, n_blocks)
    x = torch.randn(5, 8)
    expected = ref(x)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=LeaseCarrier(lease),
                                      resident_blocks=resident)
    try:
        for _ in range(3):  # later passes exercise the wrap-around prefetch
            assert torch.equal(skel(x), expected)
            _assert_no_device_memory(handle, skel)
        stats = handle.stats
        streamed = n_blocks - resident
        assert len(stats.blocks) == streamed
        sizes = [b.nbytes for b in lease.blocks][resident:]
        assert stats.buffer_bytes == max(sizes, default=0)
        assert [b.nbytes for b in stats.blocks] == sizes
        for b in stats.blocks:
            assert b.h2d_bytes == b.copies * b.nbytes  # every copy is the whole block, once
        copies = [b.copies for b in stats.blocks]
        if streamed <= 2:
            assert copies == [1] * streamed  # both fit: loaded once, never again
        else:
            # Initial prefetch + one per pass, and the wrap-around prefetch
            # of the first two blocks for the next pass.
            assert copies == [4, 4] + [3] * (streamed - 2)
    finally:
        handle.close()
    assert lease.closed == 1


def test_heterogeneous_blocks_share_buffers_sized_to_largest(tmp_path):
    ref, lease, skel = _warm(tmp_path, 4)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=lease)
    sizes = [b.nbytes for b in lease.blocks]
    assert len(set(sizes)) == 4
    assert handle.stats.buffer_bytes == max(sizes)
    assert len(handle.buffer_ranges()) == 2
    x = torch.randn(2, 8)
    assert torch.equal(skel(x), ref(x))
    handle.close()


def test_block_params_are_views_into_one_buffer_during_forward(tmp_path):
    ref, lease, skel = _warm(tmp_path, 3)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=lease)
    seen = []

    def probe(module, args):
        ranges = handle.buffer_ranges()
        ptrs = [p.data_ptr() for p in module.parameters()]
        slots = {i for p in ptrs for i, (a, b) in enumerate(ranges) if a <= p < b}
        seen.append((len(ptrs), slots))

    for b in skel.blocks:  # registered after the backend's hook, so it runs after binding
        b.register_forward_pre_hook(probe)
    skel(torch.randn(2, 8))
    assert [len(s) for _, s in seen] == [1, 1, 1]  # each block lives in exactly one buffer
    assert seen[0][1] != seen[1][1]  # consecutive blocks alternate
    handle.close()


def test_ordinary_transport_packs_once_and_matches(tmp_path):
    ref = reference(3)
    model = reference(3)  # same seed: same weights, private tensors
    x = torch.randn(4, 8)
    handle = enable_layerwise_offload(model, list(model.blocks), device="cpu", source=None)
    assert handle.stats.transport == ORDINARY
    for _ in range(2):
        assert torch.equal(model(x), ref(x))
        _assert_no_device_memory(handle, model)
    assert all(b.host_copies == 0 for b in handle.stats.blocks)
    handle.close()


def test_block_not_bound_to_lease_is_refused(tmp_path):
    ref = reference(2)
    lease = TestLease(make_artifact(tmp_path, ref))
    with pytest.raises(FailedPrecondition, match="not bound to the lease; call restore"):
        enable_layerwise_offload(ref, list(ref.blocks), device="cpu", source=lease)
    assert lease.closed == 1  # setup failed after the take: the backend closed it


def test_bad_arguments_take_nothing(tmp_path):
    ref, lease, skel = _warm(tmp_path, 2)
    carrier = LeaseCarrier(lease)
    with pytest.raises(InvalidArgument):
        enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=carrier, resident_blocks=3)
    with pytest.raises(InvalidArgument):
        enable_layerwise_offload(skel, [], device="cpu", source=carrier)
    with pytest.raises(InvalidArgument):
        enable_layerwise_offload(skel, [reference(1).blocks[0]], device="cpu", source=carrier)
    assert carrier.owns and lease.closed == 0
    carrier.close()


def test_one_options_record_with_keyword_overrides(tmp_path):
    ref, lease, skel = _warm(tmp_path, 3)
    carrier = LeaseCarrier(lease)
    with pytest.raises(TypeError, match="resident_block"):  # a misspelt option is not silently dropped
        enable_layerwise_offload(skel, list(skel.blocks), OffloadOptions(), source=carrier, resident_block=1)
    assert carrier.owns and lease.closed == 0
    base = OffloadOptions(device="cpu", resident_blocks=2)
    handle = enable_layerwise_offload(skel, list(skel.blocks), base, source=carrier, resident_blocks=1)
    try:
        assert handle.options == OffloadOptions(device="cpu", resident_blocks=1) and base.resident_blocks == 2
        assert handle.stats.resident_blocks == 1
        x = torch.randn(2, 8)
        assert torch.equal(skel(x), ref(x))
    finally:
        handle.close()


def test_second_take_and_pickling_raise(tmp_path):
    ref, lease, skel = _warm(tmp_path, 2)
    carrier = LeaseCarrier(lease)
    with pytest.raises(TypeError):
        pickle.dumps(carrier)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=carrier)
    with pytest.raises(FailedPrecondition, match="already taken"):
        carrier.take()
    with pytest.raises(FailedPrecondition, match="already taken"):
        enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=carrier)
    with pytest.raises(TypeError):
        pickle.dumps(handle)
    handle.close()
    handle.close()  # idempotent
    assert lease.closed == 1


def test_teardown_order(tmp_path):
    ref, lease, skel = _warm(tmp_path, 3)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=lease)
    handle.close()
    assert handle.trail == ["owned", f"transport:{STAGING}", "prefetched", "ready", "drain", "release", "close_lease"]
    assert handle.lease is None
    x = torch.randn(2, 8)
    assert torch.equal(skel(x), ref(x))  # hooks gone; params back on their host views


def test_stats_survive_close(tmp_path):
    ref, lease, skel = _warm(tmp_path, 3)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=lease)
    skel(torch.randn(2, 8))
    before = handle.stats.blocks
    handle.close()
    assert handle.stats.blocks == before and sum(b.copies for b in before) == 5


def test_cpu_copies_run_on_the_copy_thread_and_overlap_nothing_they_must_not(tmp_path, monkeypatch):
    """Off CUDA one thread plays the copy stream. Every copy runs there;
    a block's pre-hook waits for its own copy (parity over several passes
    with a slowed copy proves nothing reads a buffer early)."""
    import threading
    import time as _time

    from dlo_runtime import copy_engine as B

    ref, lease, skel = _warm(tmp_path, 5)
    x = torch.randn(3, 8)
    expected = ref(x)
    copy_threads = []
    real_copy = torch.Tensor.copy_

    class SlowCopy(B._CopyThread):
        def submit(self, dst, src, parts=None):
            def slow(*_a):
                copy_threads.append(threading.get_ident())
                _time.sleep(0.002)  # widen the window a missing wait would fall into
                return real_copy(dst, src)
            return super().submit(_Deferred(slow), src)  # one whole copy: the staging path has no cuts

    class _Deferred:
        def __init__(self, fn):
            self.copy_ = fn

    monkeypatch.setattr(B, "_CopyThread", SlowCopy)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=LeaseCarrier(lease))
    try:
        for _ in range(3):
            assert torch.equal(skel(x), expected)
        total = sum(b.copies for b in handle.stats.blocks)
    finally:
        handle.close()
    assert len(copy_threads) == total > 0
    assert threading.get_ident() not in copy_threads and len(set(copy_threads)) == 1
    assert lease.closed == 1


def test_cpu_copy_error_surfaces_at_the_block_and_teardown_still_closes(tmp_path, monkeypatch):
    from dlo_runtime import copy_engine as B

    ref, lease, skel = _warm(tmp_path, 4)
    calls = []

    class FailingThird(B._CopyThread):
        def submit(self, dst, src):
            calls.append(1)
            if len(calls) == 3:  # block 2's copy, issued after block 0 ran
                bad = torch.empty(1, dtype=torch.uint8)
                return super().submit(bad, src)  # size mismatch: copy_ raises on the copy thread
            return super().submit(dst, src)

    monkeypatch.setattr(B, "_CopyThread", FailingThird)
    handle = enable_layerwise_offload(skel, list(skel.blocks), device="cpu", source=LeaseCarrier(lease))
    with pytest.raises(RuntimeError):
        skel(torch.randn(2, 8))
    handle.close()
    assert lease.closed == 1
