"""DLO AllGather on CUDA with NCCL (2 GPUs; skipped otherwise).

NOT RUN while written: the development machine had no GPU (and NCCL needs
one device per rank). They follow the PyTorch docs for ProcessGroupNCCL
(``work.wait()`` orders the current stream; the collective runs on NCCL's
own stream, which waits for the stream current at issue).
"""

from __future__ import annotations

import pytest
import torch

import tests.support.allgather as ag_tests
from dlo_runtime.worker import output_digest

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA devices (one per NCCL rank)"),
]


@torch.no_grad()
def sc_cuda_parity(rank, size, pg, env):
    """Offloaded over NCCL on cuda:rank vs the resident model on the same GPU."""
    from dlo_runtime import enable_layerwise_offload
    from dlo_runtime.models.tiny_dit import sample_inputs

    device = torch.device("cuda", rank)
    resident = ag_tests.canonical_model(env["small"]).to(device)
    inputs = [t.to(device) for t in sample_inputs(ag_tests.SMALL, seed=0)]
    expected = output_digest(resident(*inputs))
    del resident
    model = ag_tests.canonical_model(env["small"])
    handle = enable_layerwise_offload(model, list(model.blocks), device=str(device), process_group=pg)
    try:
        got = [output_digest(model(*inputs)) for _ in range(2)]
        pinned = handle._shard_store is not None and handle._shard_store.is_pinned()
        return {"expected": expected, "got": got, "transport": handle.stats.transport, "pinned": pinned}
    finally:
        handle.close()


ag_tests.SCENARIOS["cuda_parity"] = sc_cuda_parity


def test_two_gpus_allgather_parity(setup, tmp_path):
    res = ag_tests.launch(2, ["cuda_parity"], dict(setup, base=None, backend="nccl",
                                                               imports=["tests.runtime.test_allgather_cuda"]), str(tmp_path))
    ag_tests.assert_ok(res["cuda_parity"], "cuda_parity")
    for row in res["cuda_parity"]:
        assert row["transport"] == "allgather" and row["pinned"]
        assert row["got"] == [row["expected"]] * 2


setup = ag_tests.setup  # the module fixture (checkpoints, daemon)
