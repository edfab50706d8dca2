"""Real diffusers / transformers classes through :func:`dlo_runtime.from_pretrained`
against a real daemon: cold start publishes, warm start restores with zero
materialization from the lease's mapping, and the DLO forward on the CPU
equals the library's own ``from_pretrained`` model bit for bit.

The library reference for diffusers needs accelerate: without it diffusers'
``from_pretrained`` takes a fallback path (and refuses classes with
``_keep_in_fp32_modules`` such as Wan); ``hwr[diffusers]`` installs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import dlo_runtime  # noqa: E402
from dlo_runtime.pretrained import PretrainedContract, model_files, resolve_class  # noqa: E402
from dlo_runtime.restore import tensor_slots  # noqa: E402
from hwr_client.core.errors import FailedPrecondition  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.real_models import MODELS, output_of, save_model, shard_count  # noqa: E402

HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> directory of each tiny model (saved once for the module)."""
    base = tmp_path_factory.mktemp("models")
    return {name: save_model(name, str(base / name)) for name in MODELS}


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    """One real daemon for the module (each model has its own key)."""
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()
    yield d
    cleanup(d)


def library_reference(name: str, directory: str, *, fuse: bool = False) -> torch.Tensor:
    """The library's own ``from_pretrained(dir, bf16)`` model, resident."""
    files = model_files(directory)
    cls = resolve_class(files)
    if files.library == "diffusers" and not HAVE_ACCELERATE:
        pytest.skip("diffusers' own from_pretrained reference needs accelerate (pip install 'hwr[diffusers]')")
    key = "torch_dtype" if files.library == "diffusers" else "dtype"
    model = cls.from_pretrained(directory, **{key: torch.bfloat16}).eval()
    if fuse:
        model.fuse_qkv_projections()
    return output_of(model, name)


def in_regions(t: torch.Tensor, regions) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(r.address <= ptr and ptr + t.untyped_storage().nbytes() <= r.address + r.length for r in regions)


def staging_left(d) -> list[str]:
    path = os.path.join(d.root, "staging")
    return os.listdir(path) if os.path.isdir(path) else []


@pytest.mark.parametrize("name", list(MODELS))
def test_cold_publishes_warm_restores_and_equals_the_library(name, saved, hwrd):
    directory = saved[name]
    assert shard_count(directory) >= 3 and any(n.endswith(".index.json") for n in os.listdir(directory))
    with dlo_runtime.from_pretrained(directory, socket=hwrd.socket, device="cpu", progress=False) as cold:
        assert cold.outcome == "CANONICAL_FALLBACK"
        assert cold.wait_published(60)["ok"], cold.report.publish
        assert cold.report.producer_calls == 1 and cold.report.bytes_materialized > 0
        cold_out = output_of(cold.model, name)
    with dlo_runtime.from_pretrained(directory, socket=hwrd.socket, device="cpu", progress=False) as warm:
        assert warm.outcome == "LOCAL_HIT" and warm.key == cold.key, warm.report.trail[5:]
        assert warm.report.bytes_materialized == 0 and warm.report.producer_calls == 0
        regions = warm.lease.regions()
        slots = tensor_slots(warm.model).slots
        assert slots and all(in_regions(s.tensor, regions) for s in slots)
        assert warm.report.blocks and warm.report.streamed_fraction >= 0.5, warm.report
        warm_out = output_of(warm.model, name)
        # Streaming order = execution order: one forward in that order copies
        # each block once and prefetches blocks 0 and 1 again for the next
        # one; a block run out of order is loaded on demand (extra copies).
        copies = [b.copies for b in warm.backend.stats.blocks]
        assert len(copies) >= 3 and copies == [2, 2] + [1] * (len(copies) - 2), copies
    assert torch.equal(warm_out, cold_out)
    assert torch.equal(warm_out, library_reference(name, directory))


def test_blocks_are_found_in_execution_order(saved):
    three = lambda stem: [f"{stem}.{i}" for i in range(3)]  # noqa: E731
    expected = {"flux": ["transformer_blocks.0", "transformer_blocks.1", "single_transformer_blocks.0",
                         "single_transformer_blocks.1"],
                "wan": three("blocks"), "sd3": three("transformer_blocks"), "llama": three("model.layers"),
                "bert": three("encoder.layer"), "t5": three("encoder.block")}
    for name, want in expected.items():
        files = model_files(saved[name])
        contract = PretrainedContract(files, resolve_class(files))
        model = contract.build_skeleton()
        names = {id(m): n for n, m in model.named_modules()}
        assert [names[id(b)] for b in contract.blocks(model)] == want, name
    files = model_files(saved["flux"])
    override = PretrainedContract(files, resolve_class(files), blocks=["single_transformer_blocks"])
    skel = override.build_skeleton()
    assert len(override.blocks(skel)) == 2


def test_skeleton_params_on_meta_buffers_real_and_tied_weights_one_tensor(saved):
    files = model_files(saved["llama"])
    contract = PretrainedContract(files, resolve_class(files))
    skel = contract.build_skeleton()
    assert all(p.is_meta for p in skel.parameters())
    inv_freq = skel.model.rotary_emb.inv_freq  # non-persistent: built by the constructor, real
    assert not inv_freq.is_meta and inv_freq.dtype == torch.float32
    assert skel.lm_head.weight is skel.model.embed_tokens.weight
    model = contract.canonical_load(skel)
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta
    files = model_files(saved["wan"])
    wan = PretrainedContract(files, resolve_class(files))
    state = wan.build_skeleton().state_dict(keep_vars=True)
    # The library's fp32-kept modules (Wan: norms, time embedder, scale_shift_table).
    assert state["scale_shift_table"].dtype == torch.float32
    assert state["condition_embedder.time_embedder.linear_1.weight"].dtype == torch.float32
    assert state["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16
    assert "scale_shift_table" in wan.representation["policy"]


def test_identity_follows_shards_config_dtype_and_fusion(saved, tmp_path):
    def key(directory, **kw):
        files = model_files(directory)
        return PretrainedContract(files, resolve_class(files), **kw).identity(directory).key

    base_dir = saved["flux"]
    base = key(base_dir)
    files = model_files(base_dir)
    doc = PretrainedContract(files, resolve_class(files)).identity(base_dir).document
    assert doc["contract"] == {"name": "diffusers:FluxTransformer2DModel", "version": 1}
    assert sorted(s["name"] for s in doc["sources"]) == sorted(
        [os.path.basename(p) for p in files.weights] + ["config.json"])
    assert "diffusers" in doc["producer"]["version"] and "hwr" in doc["producer"]["version"]
    assert key(base_dir) == base
    assert key(base_dir, dtype="float16") != base
    assert key(base_dir, fuse_qkv=True) != base
    # Explicit blocks lay the artifact out differently: a worker and a prewarm
    # that disagree on them must not share an artifact.
    assert key(base_dir, blocks=["transformer_blocks"]) != base
    assert key(base_dir, blocks="auto") == base
    shard = tmp_path / "shard"
    shutil.copytree(base_dir, shard)
    from safetensors.torch import load_file, save_file

    first = sorted(files.weights)[0]
    tensors = load_file(first)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(shard / os.path.basename(first)), metadata={"format": "pt"})
    assert key(str(shard)) != base
    config = tmp_path / "config"
    shutil.copytree(base_dir, config)
    doc = json.loads((config / "config.json").read_text())
    doc["guidance_embeds"] = not doc.get("guidance_embeds", False)
    (config / "config.json").write_text(json.dumps(doc))
    # A config that changes the architecture changes the key (the shards are equal).
    assert key(str(config)) != base


def test_disabled_mode_never_touches_hwr(saved, monkeypatch):
    import hwr_client
    import hwr_client.sources

    def refuse(*a, **k):
        raise AssertionError("disabled mode touched HWR")

    monkeypatch.setattr(hwr_client, "connect", refuse)
    monkeypatch.setattr(hwr_client.sources, "hash_locally", refuse)
    monkeypatch.setattr(hwr_client.sources, "resolve_sources", refuse)
    with dlo_runtime.from_pretrained(saved["bert"], mode="disabled", socket="/nonexistent/hwr.sock",
                                     device="cpu") as loaded:
        assert loaded.outcome == "DISABLED" and loaded.key == ""
        out = output_of(loaded.model, "bert")
    assert torch.equal(out, library_reference("bert", saved["bert"]))


def test_fused_qkv_is_its_own_final_layout(saved, hwrd):
    directory = saved["flux"]
    with dlo_runtime.from_pretrained(directory, socket=hwrd.socket, device="cpu", fuse_qkv=True,
                                     progress=False) as cold:
        assert cold.outcome == "CANONICAL_FALLBACK" and cold.wait_published(60)["ok"]
        assert any(n.endswith("attn.to_qkv.weight") for n in cold.model.state_dict())
    with dlo_runtime.from_pretrained(directory, socket=hwrd.socket, device="cpu", fuse_qkv=True,
                                     progress=False) as warm:
        assert warm.outcome == "LOCAL_HIT" and warm.key == cold.key
        assert warm.report.bytes_materialized == 0 and warm.report.producer_calls == 0
        assert "transformer_blocks.0.attn.to_qkv.weight" in warm.lease.tensors()
        out = output_of(warm.model, "flux")
    unfused = model_files(directory)
    assert warm.key != PretrainedContract(unfused, resolve_class(unfused)).identity(directory).key
    assert torch.equal(out, library_reference("flux", directory, fuse=True))


def test_required_fails_before_prewarm_and_starts_warm_after(saved, hwrd, tmp_path):
    directory = str(tmp_path / "t5")
    save_model("t5", directory, seed=5)  # a key nobody published
    with pytest.raises(FailedPrecondition, match="prewarm"):
        dlo_runtime.from_pretrained(directory, socket=hwrd.socket, mode="required")
    assert staging_left(hwrd) == []
    proc = hwrd.cli("prewarm", "--model", directory, "--json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["outcome"] == "committed" and row["contract"] == "transformers:T5EncoderModel"
    with dlo_runtime.from_pretrained(directory, socket=hwrd.socket, mode="required", device="cpu") as warm:
        assert warm.outcome == "LOCAL_HIT" and warm.key == row["key"]
        assert warm.report.bytes_materialized == 0 and warm.report.producer_calls == 0
        out = output_of(warm.model, "t5")
    assert torch.equal(out, library_reference("t5", directory))
    shown = hwrd.cli("inspect", row["key"])
    assert shown.returncode == 0, shown.stderr
    import transformers

    assert "transformers:T5EncoderModel" in shown.stdout and f"transformers {transformers.__version__}" in shown.stdout
    from hwr_client.cli import main

    assert main(["prewarm", "--model", directory, "--contract", "tiny-dit", "--socket", hwrd.socket]) == 2


def test_flux_pipeline_with_the_hwr_transformer_gives_the_same_image(hwrd, tmp_path):
    from diffusers import FluxPipeline

    from tests.support.real_models import run_flux_pipeline, save_flux_pipeline

    pipe_dir = save_flux_pipeline(str(tmp_path / "pipe"))
    reference = run_flux_pipeline(FluxPipeline.from_pretrained(pipe_dir, dtype=torch.bfloat16))
    images, outcomes = [], []
    for _ in range(2):  # cold (publishes), then warm
        with dlo_runtime.from_pretrained(pipe_dir, subfolder="transformer", socket=hwrd.socket, device="cpu",
                                         progress=False) as loaded:
            pipe = FluxPipeline.from_pretrained(pipe_dir, transformer=loaded.model, dtype=torch.bfloat16)
            images.append(run_flux_pipeline(pipe))
            outcomes.append(loaded.outcome)
            if loaded.outcome == "LOCAL_HIT":
                assert loaded.report.bytes_materialized == 0 and loaded.report.producer_calls == 0
                # Both denoising steps streamed every block through the backend.
                assert all(b.copies >= 2 for b in loaded.backend.stats.blocks)
    assert outcomes == ["CANONICAL_FALLBACK", "LOCAL_HIT"]
    assert torch.equal(images[0], reference) and torch.equal(images[1], reference)


def test_hub_cache_snapshot_is_read_through_the_daemons_hub_trust(saved, tmp_path_factory):
    import hashlib

    base = tmp_path_factory.mktemp("hubcache")
    repo = base / "hub" / "models--org--tiny-bert"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for name in os.listdir(saved["bert"]):
        data = open(os.path.join(saved["bert"], name), "rb").read()
        # Deliberately NOT the content's SHA-256: a key built from these names
        # proves the daemon answered from the hub layout without hashing.
        blob = hashlib.sha256(b"hub:" + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snap / name)
    d = make_daemon(base, "--source-root", str(base / "hub")).start()
    try:
        with dlo_runtime.from_pretrained(str(snap), socket=d.socket, progress=False) as cold:
            assert cold.outcome == "CANONICAL_FALLBACK" and cold.wait_published(60)["ok"]
        with dlo_runtime.from_pretrained(str(snap), socket=d.socket, progress=False) as warm:
            assert warm.outcome == "LOCAL_HIT" and warm.key == cold.key
            out = output_of(warm.model, "bert")
    finally:
        cleanup(d)
    files = model_files(str(snap))
    hashed = PretrainedContract(files, resolve_class(files)).identity(str(snap)).key  # local: hashes the bytes
    assert hashed != cold.key
    assert torch.equal(out, library_reference("bert", saved["bert"]))
