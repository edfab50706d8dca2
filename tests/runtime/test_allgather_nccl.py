"""The AllGather gather engine and block-sequence check over REAL NCCL with
one rank (issue 23, finding 10): the 2-GPU test (test_allgather_cuda.py)
skips on a one-GPU machine, so this is what runs NCCL there. One rank
exercises the same calls: the pinned shard's H2D on the communication
stream, the in-place gather (``all_gather_single`` or, before torch 2.13,
``all_gather_into_tensor``), ``work.wait()`` ordering the compute stream,
the event that guards slot reuse, and the 32-byte sequence exchange.

NOT RUN while written: no GPU was lent (docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dlo_runtime.allgather as ag
from dlo_runtime.cuda_host import CudaRegistrar
from dlo_runtime.pinned import PinnedBuffers

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()), reason="torch built without NCCL"),
]


@pytest.fixture
def nccl_group(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD, device
    finally:
        dist.destroy_process_group()


def test_gather_engine_over_nccl_with_one_rank(nccl_group):
    group, device = nccl_group
    assert group.size() == 1 and ag.group_size(group) == 1
    reg = CudaRegistrar(device)
    cap = reg.capability(device)
    plans = [ag.ShardPlan.of(n, 1, 0) for n in (100_000, 70_001)]
    pins = PinnedBuffers(reg, cap, [p.shard for p in plans], pin=True, label="test shards")
    shards = pins.buffers
    for s in shards:
        s.copy_(torch.randint(0, 256, (s.numel(),), dtype=torch.uint8))
    if pins.pinned:
        assert all(s.is_pinned() for s in shards)
    engine = ag.make_gather_engine(device, group, cu=torch.cuda, timeout_s=60, asynchronous=True)
    seq = ag.SequenceCheck(group, device, 60, ["b0", "b1"], [p.nbytes for p in plans],
                           stream=torch.cuda.Stream(device))
    slots = [torch.empty(max(p.padded for p in plans), dtype=torch.uint8, device=device) for _ in range(2)]
    got = []
    for rounds in range(2):
        for j, plan in enumerate(plans):
            assert seq.agree(j, (j + 1) % len(plans)) == j
            engine.load(j, slots[j][: plan.padded], shards[j], None)
            engine.before_compute(j)
            # "Compute": reads the slot on the current stream, ordered after the gather.
            got.append(slots[j][: plan.padded].clone())
            engine.after_compute(j)
    engine.drain()
    assert seq.drain()
    for k, out in enumerate(got):
        assert torch.equal(out.cpu(), shards[k % 2]), f"load {k}"
    pins.unregister()
