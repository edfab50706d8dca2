"""Checkpoints as real hubs hold them: one tiny random model each, written
with the library's ``save_pretrained`` and then given the history a real
checkpoint carries (a renamed legacy key, a stray or ignored key, an old
persistent buffer, a ``.bin`` file, an fp16 variant, a head model saved
and loaded into its base model or the other way round). What
``tests/runtime/test_real_models_keys.py`` and ``..._fallback.py`` load
through :func:`dlo_runtime.from_pretrained` and the library's own
``from_pretrained``. Nothing is downloaded."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from tests.support.real_models import MODELS, SHARD, save_model


@dataclasses.dataclass(frozen=True)
class Case:
    """A checkpoint directory and how to load it.

    Attributes:
        directory: the model directory.
        inputs: name of the :data:`MODELS` entry whose inputs it takes, or
            ``"vae"``.
        kwargs: extra ``from_pretrained`` arguments for both loaders
            (``variant``, ``use_safetensors``).
        model_class: the class to load into (None: the config's).
    """

    directory: str
    inputs: str
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    model_class: Any = None


def rewrite_shards(directory: str, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Rewrites every safetensors shard (and the index's weight map) through
    ``edit(tensors) -> tensors``."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    weight_map: dict[str, str] = {}
    for n in names:
        path = os.path.join(directory, n)
        tensors = edit(load_file(path))
        save_file(tensors, path, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, n))
    for n in os.listdir(directory):
        if n.endswith(".safetensors.index.json"):
            path = os.path.join(directory, n)
            doc = json.loads(open(path).read())
            doc["weight_map"] = weight_map
            with open(path, "w") as f:
                json.dump(doc, f)


def _add_to_first(directory: str, extra: dict[str, torch.Tensor]) -> None:
    done = [False]

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not done[0]:
            done[0] = True
            tensors.update(extra)
        return tensors

    rewrite_shards(directory, edit)


def ignored_key(d: str) -> Case:
    """Wan with ``norm_added_q`` saved: on diffusers' ignore list for Wan."""
    save_model("wan", d)
    _add_to_first(d, {"blocks.0.attn2.norm_added_q.weight": torch.ones(32)})
    return Case(d, "wan")


def unused_key(d: str) -> Case:
    """BERT with a stray key: transformers drops it with a warning."""
    save_model("bert", d)
    _add_to_first(d, {"extra.weight": torch.zeros(3)})
    return Case(d, "bert")


def old_buffer(d: str) -> Case:
    """BERT with ``embeddings.position_ids`` saved, as transformers < 4.31
    saved the then-persistent buffer (all-MiniLM-L6-v2 holds one)."""
    save_model("bert", d)
    _add_to_first(d, {"embeddings.position_ids": torch.arange(64).unsqueeze(0)})
    return Case(d, "bert")


def legacy_names(d: str) -> Case:
    """BERT saved with the TF-era ``LayerNorm.gamma`` / ``LayerNorm.beta``."""
    save_model("bert", d)

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
                for k, v in tensors.items()}

    rewrite_shards(d, edit)
    return Case(d, "bert")


def _bin_from(model: Any, d: str, shards: int) -> None:
    model.config.architectures = [type(model).__name__]  # what save_pretrained records
    model.config.save_pretrained(d)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if shards == 1:
        torch.save(state, os.path.join(d, "pytorch_model.bin"))
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        chunk = {n: state[n] for n in names[i::shards]}
        torch.save(chunk, os.path.join(d, part))
        weight_map.update(dict.fromkeys(chunk, part))
    with open(os.path.join(d, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def bin_single(d: str) -> Case:
    """BERT as a single ``pytorch_model.bin`` (what pre-safetensors hubs hold)."""
    os.makedirs(d)
    torch.manual_seed(0)
    _bin_from(MODELS["bert"][0](), d, 1)
    return Case(d, "bert")


def bin_sharded(d: str) -> Case:
    """Llama (tied embeddings) as three ``.bin`` shards with an index."""
    os.makedirs(d)
    torch.manual_seed(0)
    _bin_from(MODELS["llama"][0](), d, 3)
    return Case(d, "llama")


def diffusers_bin(d: str) -> Case:
    """FLUX saved by diffusers with ``safe_serialization=False``."""
    torch.manual_seed(0)
    MODELS["flux"][0]().save_pretrained(d, safe_serialization=False)
    return Case(d, "flux")


def fp16_variant(d: str) -> Case:
    """T5 with an fp16 variant beside a default fp32 file of OTHER weights:
    the output proves which one was read."""
    save_model("t5", d, seed=1)
    torch.manual_seed(2)
    MODELS["t5"][0]().half().save_pretrained(d, max_shard_size=SHARD, variant="fp16")
    return Case(d, "t5", {"variant": "fp16"})


def head_into_base(d: str) -> Case:
    """A ``BertForSequenceClassification`` checkpoint (``bert.`` prefix,
    a ``classifier``) loaded into ``BertModel``."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, max_position_embeddings=64, num_labels=3)
    BertForSequenceClassification(cfg).save_pretrained(d, max_shard_size=SHARD)
    return Case(d, "bert", model_class=BertModel)


def base_into_head(d: str) -> Case:
    """A ``LlamaModel`` checkpoint loaded into ``LlamaForCausalLM`` with
    tied embeddings: the prefix is added and the head is the embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaModel(cfg).save_pretrained(d, max_shard_size=SHARD)
    return Case(d, "llama", model_class=LlamaForCausalLM)


def _vae() -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 8), layers_per_block=1,
                         latent_channels=2, norm_num_groups=4, sample_size=16,
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)


def diffusers_legacy_attention(d: str) -> Case:
    """A one-file AutoencoderKL whose mid-block attention keeps the names
    of diffusers' deprecated attention block (``query``, ``proj_attn``)."""
    torch.manual_seed(0)
    _vae().save_pretrained(d)
    old = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in tensors.items():
            if ".mid_block.attentions." in k:
                for new, legacy in old.items():
                    k = k.replace(new, legacy)
            out[k] = v
        return out

    rewrite_shards(d, edit)
    return Case(d, "vae")


#: case name -> builder(directory) -> Case
CASES: dict[str, Callable[[str], Case]] = {
    "ignored-unexpected-key": ignored_key,
    "unused-key": unused_key,
    "non-persistent-buffer-in-file": old_buffer,
    "legacy-gamma-beta": legacy_names,
    "bin": bin_single,
    "bin-sharded": bin_sharded,
    "diffusers-bin": diffusers_bin,
    "fp16-variant": fp16_variant,
    "head-into-base": head_into_base,
    "base-into-head": base_into_head,
    "diffusers-legacy-attention": diffusers_legacy_attention,
}


def output(model: Any, case: Case, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The model's main output for the case's fixed inputs."""
    if case.inputs == "vae":
        inputs = {"sample": torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(5)).to(dtype)}
    else:
        inputs = MODELS[case.inputs][1](dtype)
    with torch.no_grad():
        out = model(**inputs)
    for attr in ("sample", "logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr)
    return out[0]


def library_model(case: Case, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The library's own ``from_pretrained`` of the case, eval mode."""
    from dlo_runtime.pretrained import model_files, resolve_class

    files = model_files(case.directory, **case.kwargs)
    cls = resolve_class(files, case.model_class)
    key = "torch_dtype" if files.library == "diffusers" else "dtype"
    return cls.from_pretrained(case.directory, **{key: dtype}, **case.kwargs).eval()
