"""The reference DiT: deterministic checkpoints, a finite deterministic
forward, and a canonical layout that differs from the runtime layout."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from dlo_runtime.contract_registry import get_contract
from dlo_runtime.models.tiny_dit import TinyDiTConfig, sample_inputs, write_checkpoint

CFG = TinyDiTConfig(hidden=32, depth=3, heads=4, image=8, freq_dim=16)


def _load(path: str):
    contract = get_contract("tiny-dit")
    return contract.finalize(contract.canonical_load(contract.build_skeleton(path), path))


def _names(path: str) -> dict[str, torch.dtype]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                out.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    return out


def test_checkpoint_is_deterministic_and_sharded(tmp_path):
    a = write_checkpoint(str(tmp_path / "a"), CFG, seed=3, shard_bytes=64 * 1024)
    b = write_checkpoint(str(tmp_path / "b"), CFG, seed=3, shard_bytes=64 * 1024)
    shards = [p for p in a if p.endswith(".safetensors")]
    assert len(shards) > 1
    for pa, pb in zip(a, b):
        with open(pa, "rb") as fa, open(pb, "rb") as fb:
            assert fa.read() == fb.read(), pa
    index = json.load(open(tmp_path / "a" / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(_names(str(tmp_path / "a")))


def test_canonical_layout_differs_from_runtime(tmp_path):
    write_checkpoint(str(tmp_path), CFG)
    canonical = _names(str(tmp_path))
    assert all(d == "F32" for d in canonical.values())
    assert "blocks.0.attn.to_q.weight" in canonical and "blocks.0.attn.qkv.weight" not in canonical
    assert "pos_embed" not in canonical and "t_embedder.freqs" not in canonical
    model = _load(str(tmp_path))
    state = model.state_dict()
    assert state["blocks.0.attn.qkv.weight"].shape == (3 * CFG.hidden, CFG.hidden)
    assert state["blocks.0.attn.qkv.weight"].dtype == torch.bfloat16
    assert state["blocks.0.norm1.weight"].dtype == torch.float32
    assert state["blocks.1.attn.q_norm.weight"].dtype == torch.float32
    assert state["pos_embed"].abs().sum() > 0 and state["t_embedder.freqs"][0] == 1.0
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        q, k = f.get_tensor("blocks.2.attn.to_q.weight"), f.get_tensor("blocks.2.attn.to_k.weight")
    packed = state["blocks.2.attn.qkv.weight"]
    assert torch.equal(packed[: CFG.hidden], q.to(torch.bfloat16))
    assert torch.equal(packed[CFG.hidden : 2 * CFG.hidden], k.to(torch.bfloat16))


def test_forward_is_deterministic_across_loads(tmp_path):
    write_checkpoint(str(tmp_path), CFG, seed=1)
    x, t = sample_inputs(CFG, batch=2, seed=5)
    with torch.no_grad():
        y1 = _load(str(tmp_path))(x, t)
        y2 = _load(str(tmp_path))(x, t)
    assert y1.shape == x.shape and torch.isfinite(y1).all()
    assert torch.equal(y1, y2)


def test_for_size_hits_the_requested_size():
    for size in (4 << 20, 64 << 20, 1 << 30, 8 << 30):
        cfg = TinyDiTConfig.for_size(size)
        total = cfg.block_bytes_fp32() * cfg.depth
        assert 0.8 * size <= total <= 1.2 * size, (size, cfg)
        assert 8 <= cfg.depth <= 64
