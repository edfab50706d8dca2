"""Checkpoints with a real hub's history through :func:`dlo_runtime.from_pretrained`
against a real daemon, one tiny model per rule (tests/support/checkpoints.py):
cold publishes, warm restores from the lease, and both equal the library's own
``from_pretrained`` of the same directory bit for bit."""

from __future__ import annotations

import os
import re

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # diffusers' own from_pretrained (the reference) needs it for Wan

import dlo_runtime  # noqa: E402
from dlo_runtime.pretrained import PretrainedContract, model_files, resolve_class  # noqa: E402
from tests.support.checkpoints import CASES, Case, library_model, output  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.real_models import save_model  # noqa: E402


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()
    yield d
    cleanup(d)


def contract_of(case: Case, **kw) -> PretrainedContract:
    files = model_files(case.directory, **case.kwargs)
    return PretrainedContract(files, resolve_class(files, case.model_class), **kw)


#: case -> what its key plan must show (the rule the case exercises).
PLAN = {
    "ignored-unexpected-key": lambda k: k.ignored == ("blocks.0.attn2.norm_added_q.weight",) and not k.unused,
    "unused-key": lambda k: k.unused == ("extra.weight",) and not k.ignored,
    "non-persistent-buffer-in-file": lambda k: k.ignored == ("embeddings.position_ids",),
    "legacy-gamma-beta": lambda k: ("embeddings.LayerNorm.gamma", "embeddings.LayerNorm.weight") in k.renamed,
    "bin": lambda k: not k.renamed and not k.unused,
    "bin-sharded": lambda k: not k.renamed and "lm_head.weight" not in k.sources,  # tied: one tensor
    "diffusers-bin": lambda k: not k.renamed,
    "fp16-variant": lambda k: not k.renamed,
    "head-into-base": lambda k: ("bert.pooler.dense.weight", "pooler.dense.weight") in k.renamed
    and k.unused == ("classifier.bias", "classifier.weight"),
    "base-into-head": lambda k: ("embed_tokens.weight", "model.embed_tokens.weight") in k.renamed,
    "diffusers-legacy-attention": lambda k: any(a.endswith(".query.weight") and b.endswith(".to_q.weight")
                                                for a, b in k.renamed),
}


@pytest.mark.parametrize("name", list(CASES))
def test_history_loads_as_the_library_loads_it(name, hwrd, tmp_path):
    case = CASES[name](str(tmp_path / name))
    contract = contract_of(case)
    assert contract.ineligible() == [] and PLAN[name](contract.keys), contract.keys
    common = dict(socket=hwrd.socket, device="cpu", progress=False, model_class=case.model_class, **case.kwargs)
    with dlo_runtime.from_pretrained(case.directory, **common) as cold:
        assert cold.outcome == "CANONICAL_FALLBACK", cold.report.notes
        assert cold.wait_published(60)["ok"], cold.report.publish
        assert cold.report.trail[-1] == "published" and "publish_scheduled" in " ".join(cold.report.trail)
        cold_out = output(cold.model, case)
        # The library warns about keys it drops unannounced; so does the report.
        assert any("extra.weight" in n for n in cold.report.notes) == (name == "unused-key")
    with dlo_runtime.from_pretrained(case.directory, mode="required", **common) as warm:
        assert warm.outcome == "LOCAL_HIT" and warm.key == cold.key
        assert warm.report.bytes_materialized == 0 and warm.report.producer_calls == 0
        warm_out = output(warm.model, case)
    reference = output(library_model(case), case)
    assert torch.equal(cold_out, reference) and torch.equal(warm_out, reference)


def test_renamed_keys_have_their_own_identity(tmp_path):
    """The same tensors under legacy names load into the same model, but the
    mapping is part of the key (it is what turns the file into the artifact)."""
    plain = CASES["unused-key"](str(tmp_path / "plain"))
    legacy = CASES["legacy-gamma-beta"](str(tmp_path / "legacy"))
    doc = contract_of(legacy).identity(legacy.directory).document
    assert doc["extra"]["key_map"].startswith("sha256:")
    assert "key_map" not in contract_of(plain).identity(plain.directory).document["extra"]


def test_variant_and_use_safetensors_pick_the_files_the_library_picks(tmp_path):
    from hwr_client.core.errors import NotFound

    case = CASES["fp16-variant"](str(tmp_path / "t5"))
    names = lambda **kw: [os.path.basename(p) for p in model_files(case.directory, **kw).weights]  # noqa: E731
    assert all(n.startswith("model.fp16-") for n in names(variant="fp16"))
    assert all(n.startswith("model-") for n in names())
    with pytest.raises(NotFound, match="pytorch_model.bin"):
        model_files(case.directory, use_safetensors=False)
    with pytest.raises(NotFound, match=r"model\.bf16\.safetensors"):
        model_files(case.directory, variant="bf16")
    both = CASES["bin"](str(tmp_path / "bin"))
    save_model("bert", str(tmp_path / "st"), seed=3)
    for n in os.listdir(tmp_path / "st"):
        if n != "config.json":
            os.rename(tmp_path / "st" / n, os.path.join(both.directory, n))
    # transformers: safetensors first, .bin only when they are absent or refused.
    assert model_files(both.directory).format == "safetensors"
    assert model_files(both.directory, use_safetensors=False).weights == (
        os.path.join(both.directory, "pytorch_model.bin"),)


def test_t5_fp16_keeps_wo_in_fp32_as_transformers_does(hwrd, tmp_path):
    """transformers' keep-in-fp32 plan for fp16 (T5: ``wo``): HWR's artifact
    holds ``wo`` in fp32 and the output equals transformers' own fp16 load."""
    from transformers import T5EncoderModel

    directory = save_model("t5", str(tmp_path / "t5"), seed=7)
    case = Case(directory, "t5")
    common = dict(socket=hwrd.socket, device="cpu", progress=False, dtype="float16")
    with dlo_runtime.from_pretrained(directory, **common) as cold:
        assert cold.outcome == "CANONICAL_FALLBACK" and cold.wait_published(60)["ok"]
    with dlo_runtime.from_pretrained(directory, mode="required", **common) as warm:
        assert warm.outcome == "LOCAL_HIT"
        tensors = warm.lease.tensors()
        assert tensors["encoder.block.0.layer.1.DenseReluDense.wo.weight"].dtype == torch.float32
        assert tensors["encoder.block.0.layer.1.DenseReluDense.wi.weight"].dtype == torch.float16
        out = output(warm.model, case, torch.float16)
    reference = T5EncoderModel.from_pretrained(directory, dtype=torch.float16).eval()
    assert reference.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    assert out.dtype == torch.float16 and torch.equal(out, output(reference, case, torch.float16))


@pytest.mark.parametrize("name,why", [("bin", "checkpoint-mmap maps safetensors"),
                                      ("legacy-gamma-beta", "key(s) are renamed on load")])
def test_checkpoint_mmap_is_not_offered_what_it_cannot_map(name, why, hwrd, tmp_path):
    """A .bin file or renamed keys are no byte ranges under their own names:
    the direct plan is refused before preflight reads a header; ``auto``
    goes through HWR and says why."""
    from hwr_client.core.errors import FailedPrecondition

    case = CASES[name](str(tmp_path / name))
    with pytest.raises(FailedPrecondition, match=re.escape(why)):
        dlo_runtime.from_pretrained(case.directory, socket=hwrd.socket, host_plan="checkpoint-mmap")
    with dlo_runtime.from_pretrained(case.directory, socket=hwrd.socket, host_plan="auto", progress=False) as auto:
        assert auto.outcome in ("CANONICAL_FALLBACK", "LOCAL_HIT") and auto.report.host_plan == "hwr"
        assert why in auto.report.host_plan_reason
        out = output(auto.model, case)
    assert torch.equal(out, output(library_model(case), case))
