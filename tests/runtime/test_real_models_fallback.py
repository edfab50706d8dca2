"""Preferred is never worse than the library: a model HWR cannot represent
loads with the library's own ``from_pretrained`` (decided before any daemon
call, one WARNING naming the reason, the report saying so), required fails
with that reason; a missing daemon is said in one WARNING; a publication
that fails never reads as ``published``."""

from __future__ import annotations

import logging
import os
import re
import socket as pysocket

import pytest
import torch

pytest.importorskip("transformers")

import dlo_runtime  # noqa: E402
from hwr_client.core.errors import FailedPrecondition, Unavailable  # noqa: E402
from tests.support.checkpoints import Case, library_model, output, rewrite_shards  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.real_models import SHARD, save_model  # noqa: E402


@pytest.fixture
def no_hwr(monkeypatch):
    """Any daemon call or source hashing fails the test: eligibility and the
    daemon probe come first."""
    import hwr_client
    import hwr_client.sources

    def refuse(*a, **k):
        raise AssertionError("an ineligible start touched HWR")

    monkeypatch.setattr(hwr_client, "connect", refuse)
    monkeypatch.setattr(hwr_client.sources, "hash_locally", refuse)
    monkeypatch.setattr(hwr_client.sources, "resolve_sources", refuse)


def fresh_head(d: str) -> Case:
    """A BertModel checkpoint loaded into BertForSequenceClassification: the
    classifier is initialized by the library."""
    from transformers import BertForSequenceClassification

    save_model("bert", d)
    return Case(d, "bert", model_class=BertForSequenceClassification)


def converted(d: str) -> Case:
    """A Mixtral checkpoint: transformers merges the per-expert weights on load."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                     num_experts_per_tok=1)).save_pretrained(d, max_shard_size=SHARD)
    return Case(d, "llama")  # token-id inputs of the llama entry (vocabulary 128)


def custom_loader(d: str) -> Case:
    from transformers import BertModel

    class OwnLoaderBert(BertModel):
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            return super().from_pretrained(*args, **kwargs)

    save_model("bert", d)
    return Case(d, "bert", model_class=OwnLoaderBert)


def untied(d: str) -> Case:
    """Llama configured with tied embeddings whose checkpoint holds a
    different ``lm_head.weight``: the library unties them."""
    save_model("llama", d)

    def edit(tensors):
        if "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
        return tensors

    rewrite_shards(d, edit)
    return Case(d, "llama")


#: case -> (builder, the reason's words)
INELIGIBLE = {
    "fresh-head": (fresh_head, r"would initialize freshly \(e\.g\. 'classifier\.weight'"),
    "converter": (converted, r"go through the library's converters \['\.experts\.\*\.w1\.weight'"),
    "custom-loader": (custom_loader, r"OwnLoaderBert overrides from_pretrained"),
    "untied": (untied, r"are tied in transformers:LlamaForCausalLM but the checkpoint holds different values"),
}


def dlo_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith(("dlo_runtime", "hwr_client"))]


@pytest.mark.parametrize("name", list(INELIGIBLE))
def test_ineligible_loads_like_the_library_in_preferred_and_fails_in_required(name, tmp_path, no_hwr, caplog):
    build, reason = INELIGIBLE[name]
    case = build(str(tmp_path / name))
    caplog.set_level(logging.WARNING)
    torch.manual_seed(11)  # a freshly initialized head draws from it, in both loads
    with dlo_runtime.from_pretrained(case.directory, model_class=case.model_class, socket="/nonexistent/hwr.sock",
                                     device="cpu") as loaded:
        assert loaded.outcome == "DISABLED" and loaded.key == ""
        assert loaded.report.host_plan == "ordinary"
        assert re.search(reason, loaded.report.notes[0]) and "not eligible for HWR" in loaded.report.notes[0]
        out = output(loaded.model, case)
    warnings = dlo_warnings(caplog)
    assert len(warnings) == 1 and re.search(reason, warnings[0]), warnings
    torch.manual_seed(11)
    assert torch.equal(out, output(library_model(case), case))
    with pytest.raises(FailedPrecondition, match=reason):
        dlo_runtime.from_pretrained(case.directory, model_class=case.model_class, mode="required",
                                    socket="/nonexistent/hwr.sock")


def test_quantized_config_is_not_eligible(tmp_path, no_hwr):
    import json

    d = save_model("bert", str(tmp_path / "q"))
    doc = json.loads(open(os.path.join(d, "config.json")).read())
    doc["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(doc, f)
    with pytest.raises(FailedPrecondition, match="quantization_config: the library quantizes while loading"):
        dlo_runtime.from_pretrained(d, mode="required", socket="/nonexistent/hwr.sock")


@pytest.mark.parametrize("where", ["no-file", "stale-socket"])
def test_no_daemon_says_so_once_and_loads_like_the_library(where, tmp_path, monkeypatch, caplog):
    import hwr_client.sources

    def refuse(*a, **k):
        raise AssertionError("hashed the checkpoint for an identity nobody can serve")

    monkeypatch.setattr(hwr_client.sources, "hash_locally", refuse)
    d = save_model("bert", str(tmp_path / "bert"))
    sock = str(tmp_path / "hwr.sock")
    if where == "stale-socket":  # a daemon that died: its socket file refuses connections
        s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        s.bind(sock)
        s.close()
    caplog.set_level(logging.WARNING)
    expected = f"no HWR daemon at {sock}: is `hwr serve` running? loading without HWR"
    with dlo_runtime.from_pretrained(d, socket=sock, device="cpu") as loaded:
        assert loaded.outcome == "CANONICAL_FALLBACK" and loaded.report.notes[0] == expected
        out = output(loaded.model, Case(d, "bert"))
    warnings = dlo_warnings(caplog)
    assert len(warnings) == 1 and warnings[0].endswith(expected), warnings
    assert torch.equal(out, output(library_model(Case(d, "bert")), Case(d, "bert")))
    with pytest.raises(Unavailable, match=f"no HWR daemon at {sock}: is `hwr serve` running"):
        dlo_runtime.from_pretrained(d, socket=sock, mode="required")


def test_a_failed_publication_never_reads_as_published(tmp_path):
    """A daemon too small for the artifact: the start serves, the trail says
    the publication was scheduled and then that it failed."""
    d = make_daemon(tmp_path, "--capacity", "4KiB").start()
    try:
        directory = save_model("t5", str(tmp_path / "t5"))
        with dlo_runtime.from_pretrained(directory, socket=d.socket, progress=False) as cold:
            assert cold.outcome == "CANONICAL_FALLBACK"
            assert cold.wait_published(60) is not None and not cold.report.publish["ok"]
            trail = cold.report.trail
            assert "publish_scheduled" in [t.split(":")[0] for t in trail]
            assert trail[-1].startswith("publish_failed: ResourceExhausted"), trail
            assert not any(t.split(":")[0] == "published" for t in trail), trail
            out = output(cold.model, Case(directory, "t5"))
    finally:
        cleanup(d)
    assert torch.equal(out, output(library_model(Case(directory, "t5")), Case(directory, "t5")))
