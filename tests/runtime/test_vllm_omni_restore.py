"""vLLM-Omni's own final-layout path on HWR: its BF16 producer publishes
through the HWR store, its runtime resolves a LOCAL_HIT from the daemon, and
its real restorer (``plan_restore`` / ``commit``) accepts our lease and
binds every parameter and buffer to a view inside the lease's
``mapped_regions``. Real classes from the installed ``vllm-omni`` wheel; a
tiny DiT of our own with the model contract they require."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support import vllm_omni as vo
from tests.support.daemon import cleanup, make_daemon

api = vo.load()

from dlo_runtime.integrations import vllm_omni as adapter  # noqa: E402
from vllm_omni.diffusion.model_loader.host_weights import (  # noqa: E402
    FINAL_LAYOUT_BF16_POLICY,
    FinalLayoutBF16Producer,
    FinalLayoutLoaderIdentity,
    FinalLayoutRequest,
    FinalLayoutTensorRestorer,
    ImplementationIdentity,
    PreparedWeightSource,
    build_final_layout_identity,
)
from vllm_omni.diffusion.models.host_weight_contract import FinalLayoutModelContract  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int, device: str) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width, dtype=torch.bfloat16, device=device)
        self.norm = nn.Parameter(torch.empty(width, dtype=torch.float32, device=device))


class TinyDiT(nn.Module):
    """Two blocks, an fp32 gain, a persistent fp8-fnuz buffer and a
    non-persistent one (not part of the artifact)."""

    host_weight_restore_contract = FinalLayoutModelContract(implementation_id="hwr-test-tiny-dit", version="1")

    def __init__(self, device: str = "cpu", width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, device) for _ in range(2))
        self.gain = nn.Parameter(torch.empty(1, dtype=torch.float32, device=device))
        self.register_buffer("codes", torch.empty(4, dtype=torch.float8_e4m3fnuz, device=device))
        self.register_buffer("derived", torch.tensor([3.0]), persistent=False)
        self.validated = 0

    def validate_restored_host_weights(self) -> None:
        self.validated += 1


class TinyPipeline(nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.transformer = TinyDiT(device)
        self.text_encoder = nn.Linear(2, 2)


def fill(pipe: TinyPipeline, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(pipe.transformer.named_parameters()) + [("codes", pipe.transformer.codes)]:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return {f"transformer.{n}": t.detach().clone() for n, t in pipe.transformer.state_dict().items()}


def context_for(pipe: TinyPipeline, tmp_path: Path):
    root = tmp_path / "canonical"
    root.mkdir(exist_ok=True)
    weights = root / "model.safetensors"
    if not weights.exists():
        weights.write_bytes(b"the canonical checkpoint's bytes")
    source = PreparedWeightSource(model_or_path="hwr-test/tiny", subfolder=None, requested_revision=None,
                                  prefix="transformer.", resolved_root=root, weight_files=(weights,),
                                  use_safetensors=True)
    request = FinalLayoutRequest(model_id="hwr-test/tiny", loader=FinalLayoutLoaderIdentity(
        implementation=ImplementationIdentity(implementation_id="hwr-test-loader", version="1", fingerprint="l1"),
        model_config_fingerprint="c1", weight_transform_fingerprint="w1"))
    return build_final_layout_identity(pipe, dit_modules=(("transformer", pipe.transformer),),
                                       prepared_sources=(source,), request=request, policy=FINAL_LAYOUT_BF16_POLICY)


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()
    adapter.install(socket=d.socket, admin_socket=d.admin_socket)
    yield d
    adapter.uninstall()
    cleanup(d)


def runtime(root: Path):
    return api.HostWeightRuntime.from_config(api.HostWeightRuntimeConfig(
        mode=api.RuntimeMode.PREFERRED, domain=api.StorageDomainPolicy(root=root),
        production=api.ProductionPolicy(allow_local_build=False, allow_post_load_publish=True)))


def test_real_producer_runtime_and_restorer_bind_views_inside_mapped_regions(hwrd, tmp_path):
    cold = TinyPipeline()
    expected = fill(cold)
    context = context_for(cold, tmp_path)
    rt = runtime(tmp_path / "root")
    assert type(rt.store).__name__ == "HwrHostWeightStore"
    producer = FinalLayoutBF16Producer(context, cold, (("transformer", cold.transformer),), max_shard_bytes=200)

    # A cold start: the runtime misses and, after the canonical load, publishes.
    assert rt.resolve(context.identity).report.outcome is api.ResolutionOutcome.CANONICAL_FALLBACK
    published = rt.publish_after_load(context.identity, producer=producer)
    assert published.outcome is api.PostLoadPublicationOutcome.PUBLISHED, published.failure
    assert rt.publish_after_load(context.identity, producer=producer).outcome \
        is api.PostLoadPublicationOutcome.ALREADY_PRESENT

    # A warm start: a skeleton on meta, restored from the daemon's lease.
    warm = TinyPipeline(device="meta")
    warm_context = context_for(warm, tmp_path)
    assert warm_context.identity == context.identity
    hit = rt.resolve(warm_context.identity)
    assert hit.report.outcome is api.ResolutionOutcome.LOCAL_HIT
    lease = hit.lease
    assert isinstance(lease, api.HostWeightLease)
    assert len(lease.mapped_regions) >= 2  # the 200-byte shards made several payload files
    assert {r.file_name for r in lease.mapped_regions} == {f.file_name for f in lease.manifest.files}
    plan = FinalLayoutTensorRestorer(warm_context).plan_restore(warm, lease)
    assert warm.transformer.validated == 0 and warm.transformer.blocks[0].proj.weight.is_meta  # nothing yet
    plan.commit()
    assert warm.transformer.validated == 1

    restored = dict(warm.named_parameters()) | dict(warm.named_buffers())
    for name, value in expected.items():
        t = restored[name]
        assert t.dtype is value.dtype and torch.equal(t.view(torch.uint8), value.view(torch.uint8)), name
        # Bound to the lease's own tensor: the same storage, inside one of its regions.
        assert t.untyped_storage().data_ptr() == lease.tensors[name].untyped_storage().data_ptr()
        begin, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert any(r.address <= begin and end <= r.address + r.length for r in lease.mapped_regions), name
    assert restored["transformer.codes"].dtype is torch.float8_e4m3fnuz
    assert warm.transformer.derived.item() == 3.0 and not warm.text_encoder.weight.is_meta

    # The HWR lease is pinned until vLLM-Omni's lease closes; then released.
    client = hwrd.client()
    from hwr_client.core._proto import hwr_pb2 as pb

    def leases() -> int:
        return len(client.call(client.reader.ListLeases, pb.ListLeasesRequest()).leases)

    assert leases() == 1
    del restored, plan, warm
    gc.collect()
    lease.close()
    assert leases() == 0


def test_the_restorer_refuses_views_that_share_one_storage(hwrd, tmp_path):
    """Why the lease takes per-tensor storages: the same views sharing their
    file's storage are refused by vLLM-Omni's restorer as aliases."""
    cold = TinyPipeline()
    fill(cold, seed=1)
    context = context_for(cold, tmp_path)
    rt = runtime(tmp_path / "root")
    producer = FinalLayoutBF16Producer(context, cold, (("transformer", cold.transformer),))
    assert rt.publish_after_load(context.identity, producer=producer).outcome \
        is api.PostLoadPublicationOutcome.PUBLISHED
    lease = rt.resolve(context.identity).lease
    warm = TinyPipeline(device="meta")
    # The same lease, but its tensors replaced by the shared-storage views of the same mapping.
    key = rt.store.key(context.identity)
    with hwrd.client().acquire(key) as hwr_lease:
        shared = hwr_lease.tensors()
        aliased = api.HostWeightLease(identity=lease.identity, manifest=lease.manifest, tensors=shared,
                                      mapped_regions=lease.mapped_regions, provenance=lease.provenance,
                                      resource_closers=(), release_artifact_lock=lambda: None)
        with pytest.raises(ValueError, match="aliases"):
            FinalLayoutTensorRestorer(context_for(warm, tmp_path)).plan_restore(warm, aliased)
        aliased.close()
    # Ours passes the same check.
    FinalLayoutTensorRestorer(context_for(warm, tmp_path)).plan_restore(warm, lease)
    lease.close()


def test_vllm_omnis_registration_spans_cover_every_tensor(hwrd, tmp_path):
    """What vLLM-Omni's CUDA host registration would register for our lease
    (its own span computation, run here without CUDA): page-aligned spans,
    one per payload file, inside the page-rounded mapping, holding every
    tensor. The cudaHostRegister calls themselves are not run (no GPU here)."""
    registration = vo.load_offloader_module("cuda_host_registration")
    import mmap

    cold = TinyPipeline()
    fill(cold, seed=2)
    context = context_for(cold, tmp_path)
    rt = runtime(tmp_path / "root")
    producer = FinalLayoutBF16Producer(context, cold, (("transformer", cold.transformer),), max_shard_bytes=200)
    assert rt.publish_after_load(context.identity, producer=producer).outcome \
        is api.PostLoadPublicationOutcome.PUBLISHED
    lease = rt.resolve(context.identity).lease
    spans = registration._mapped_regions(lease.mapped_regions)
    assert len(spans) == len(lease.mapped_regions)
    page = mmap.PAGESIZE
    for span in spans:
        assert span.start % page == 0 and span.end % page == 0
        assert any(r.address <= span.start and span.end <= r.address + -(-r.length // page) * page
                   for r in lease.mapped_regions)
    for name, t in lease.tensors.items():
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert sum(s.start <= lo and hi <= s.end for s in spans) == 1, name
    lease.close()
