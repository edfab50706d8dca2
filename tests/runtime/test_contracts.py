"""Final-layout contracts: transforms, canonical loading hygiene, identity,
and the generic contract for any safetensors checkpoint."""

from __future__ import annotations

import os
import weakref

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dlo_runtime import contracts
from dlo_runtime.contracts import GenericContract, check_no_meta, parse_layout
from dlo_runtime.contract_registry import get_contract
from dlo_runtime.models.tiny_dit import TinyDiTConfig, canonical_names, write_checkpoint
from hwr_client.core.errors import FailedPrecondition, InvalidArgument

CFG = TinyDiTConfig(hidden=32, depth=2, heads=4, image=8, freq_dim=16)


@pytest.fixture
def ckpt(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    write_checkpoint(path, CFG, seed=7)
    return path


def test_tiny_dit_transforms_cover_every_runtime_tensor_once(ckpt):
    contract = get_contract("tiny-dit")
    model = contract.build_skeleton(ckpt)
    transforms = contract.transforms(ckpt, model)
    assert sorted(t.target for t in transforms) == sorted(model.state_dict())
    kinds = {t.target: t.kind for t in transforms}
    assert kinds["blocks.1.attn.qkv.weight"] == "pack" and kinds["pos_embed"] == "computed"
    assert kinds["t_embedder.freqs"] == "computed" and kinds["blocks.0.mlp.fc1.weight"] == "cast"
    assert contract.block_prefixes(model) == ["blocks.0.", "blocks.1."]
    assert all(p.is_meta for p in model.parameters())


def test_canonical_load_releases_checkpoint_tensors_as_copied(ckpt, monkeypatch):
    alive: list[weakref.ref] = []
    peak = [0]
    take = contracts.CheckpointReader.take

    def tracking_take(self, name):
        peak[0] = max(peak[0], sum(r() is not None for r in alive))
        t = take(self, name)
        alive.append(weakref.ref(t))
        return t

    monkeypatch.setattr(contracts.CheckpointReader, "take", tracking_take)
    contract = get_contract("tiny-dit")
    model = contract.canonical_load(contract.build_skeleton(ckpt), ckpt)
    check_no_meta(model)
    # At most the sibling sources of one pack (q, k) are alive when the next
    # checkpoint tensor is read: nothing accumulates.
    assert peak[0] <= 2
    assert len(alive) == len(canonical_names(CFG))  # every checkpoint tensor read once


def test_canonical_load_rejects_a_checkpoint_that_does_not_match(ckpt, tmp_path):
    contract = get_contract("tiny-dit")
    save_file({"unused.weight": torch.zeros(2)}, os.path.join(ckpt, "zz-extra.safetensors"))
    with pytest.raises(FailedPrecondition, match="unused.weight"):
        contract.canonical_load(contract.build_skeleton(ckpt), ckpt)
    os.remove(os.path.join(ckpt, "zz-extra.safetensors"))
    other = str(tmp_path / "other")
    write_checkpoint(other, TinyDiTConfig(hidden=32, depth=3, heads=4, image=8, freq_dim=16))
    model = contract.build_skeleton(ckpt)  # 2 blocks, checkpoint has 3
    with pytest.raises(FailedPrecondition, match="blocks.2"):
        contract.canonical_load(model, other)


def test_identity_follows_every_byte_relevant_input(ckpt, tmp_path):
    contract = get_contract("tiny-dit")
    base = contract.identity(ckpt)
    assert base.key == contract.identity(ckpt, "tp_rank=0").key
    assert base.key != contract.identity(ckpt, "tp_rank=1,tp_size=2").key
    assert [s["name"] for s in base.document["sources"]] == ["config.json", "model.safetensors"]
    other = str(tmp_path / "other")
    write_checkpoint(other, CFG, seed=8)
    assert contract.identity(other).key != base.key
    generic = GenericContract(dtype="float16")
    assert generic.identity(ckpt).key != GenericContract().identity(ckpt).key
    with pytest.raises(InvalidArgument, match="layout key"):
        parse_layout("dp_rank=1")
    with pytest.raises(InvalidArgument, match="key=value"):
        parse_layout("tp_rank")
    assert parse_layout("tp_rank=1, tp_size=2")["tp_rank"] == 1
    with pytest.raises(InvalidArgument, match="expected one of"):
        get_contract("nope")


class _HfLike(nn.Module):
    """Shaped like a Hugging Face decoder: embed, model.layers.N, norm."""

    def __init__(self, n: int = 3, d: int = 16):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, d)
        self.layers = nn.ModuleList(nn.ModuleDict({"self_attn": nn.Linear(d, 3 * d), "input_layernorm": nn.LayerNorm(d)})
                                    for _ in range(n))
        self.norm = nn.LayerNorm(d)


def test_generic_contract_loads_any_safetensors_model(tmp_path):
    ref = _HfLike()
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    contract = GenericContract(model_factory=_HfLike)
    model = contract.build_skeleton(str(tmp_path))
    assert [type(b) for b in contract.blocks(model)] == [nn.ModuleDict] * 3
    assert contract.block_prefixes(model) == ["layers.0.", "layers.1.", "layers.2."]
    contract.canonical_load(model, str(tmp_path))
    loaded = model.state_dict()
    assert loaded["layers.1.self_attn.weight"].dtype == torch.bfloat16
    assert loaded["layers.1.input_layernorm.weight"].dtype == torch.float32
    assert torch.equal(loaded["embed_tokens.weight"], state["embed_tokens.weight"].to(torch.bfloat16))
    produced = contract.produce(str(tmp_path))  # no module needed
    assert produced.keys() == loaded.keys()
    assert all(torch.equal(produced[k], loaded[k]) for k in loaded)
    with pytest.raises(InvalidArgument, match="model_factory"):
        GenericContract().build_skeleton(str(tmp_path))


def test_identity_without_a_client_connects_nowhere(ckpt, monkeypatch):
    # contracts build the document through hwr_client.sources.build_identity;
    # without a client it must hash here, never dial the default socket.
    import hwr_client.client

    monkeypatch.setattr(hwr_client.client, "connect", lambda *a, **k: pytest.fail("connected"))
    ident = get_contract("tiny-dit").identity(ckpt)
    assert ident.document["producer"] == {"id": "dlo_runtime.contracts/tiny-dit", "version": "1"}


def test_identity_is_the_same_through_the_daemon_source_cache(ckpt, make_daemon_fixture):
    daemon = make_daemon_fixture("--source-root", os.path.dirname(ckpt))
    contract = get_contract("tiny-dit")
    with daemon.client() as client:
        cached = [contract.identity(ckpt, client=client).key for _ in range(2)]
    assert cached == [contract.identity(ckpt).key] * 2
