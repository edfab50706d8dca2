"""Tiny random-weight models of real diffusers / transformers classes, saved
with ``save_pretrained`` into several shards plus an index, and inputs for
each: what tests/test_real_models*.py load through
:func:`dlo_runtime.from_pretrained`. Nothing is downloaded."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

#: Small enough that every class writes 3+ shards.
SHARD = "20KB"


def _flux() -> Any:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=[4, 6, 6])


def _wan() -> Any:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=3,
                                 rope_max_seq_len=32)


def _sd3() -> Any:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16,
                                 num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                 pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16)


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def _bert() -> Any:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=4, max_position_embeddings=64))


def _t5() -> Any:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4))


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _flux_inputs(dtype: torch.dtype) -> dict[str, Any]:
    g = _g(1)
    return {"hidden_states": torch.randn(1, 16, 8, generator=g).to(dtype),
            "encoder_hidden_states": torch.randn(1, 6, 32, generator=g).to(dtype),
            "pooled_projections": torch.randn(1, 32, generator=g).to(dtype),
            "timestep": torch.tensor([0.5]).to(dtype),
            "img_ids": torch.randint(0, 4, (16, 3), generator=g).float(),
            "txt_ids": torch.zeros(6, 3)}


def _wan_inputs(dtype: torch.dtype) -> dict[str, Any]:
    g = _g(2)
    return {"hidden_states": torch.randn(1, 4, 1, 4, 4, generator=g).to(dtype),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 6, 32, generator=g).to(dtype)}


def _sd3_inputs(dtype: torch.dtype) -> dict[str, Any]:
    g = _g(3)
    return {"hidden_states": torch.randn(1, 4, 8, 8, generator=g).to(dtype),
            "encoder_hidden_states": torch.randn(1, 6, 32, generator=g).to(dtype),
            "pooled_projections": torch.randn(1, 32, generator=g).to(dtype),
            "timestep": torch.tensor([500])}


def _ids_inputs(dtype: torch.dtype) -> dict[str, Any]:
    return {"input_ids": torch.randint(0, 128, (2, 7), generator=_g(4))}


#: name -> (builder, inputs(dtype), library)
MODELS: dict[str, tuple[Callable[[], Any], Callable[[torch.dtype], dict[str, Any]], str]] = {
    "flux": (_flux, _flux_inputs, "diffusers"),
    "wan": (_wan, _wan_inputs, "diffusers"),
    "sd3": (_sd3, _sd3_inputs, "diffusers"),
    "llama": (_llama, _ids_inputs, "transformers"),
    "bert": (_bert, _ids_inputs, "transformers"),
    "t5": (_t5, _ids_inputs, "transformers"),
}


def save_model(name: str, directory: str, *, seed: int = 0) -> str:
    """Writes model ``name`` (random weights from ``seed``) to ``directory``."""
    torch.manual_seed(seed)
    model = MODELS[name][0]()
    model.save_pretrained(directory, max_shard_size=SHARD)
    return directory


def output_of(model: Any, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The model's main output tensor for the fixed inputs of ``name``."""
    with torch.no_grad():
        out = model(**MODELS[name][1](dtype))
    for attr in ("sample", "logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr)
    return out[0]


def shard_count(directory: str) -> int:
    """Number of safetensors shards in ``directory``."""
    return sum(n.endswith(".safetensors") for n in os.listdir(directory))


# -- a tiny FLUX pipeline, tokenizers built locally ---------------------------------

_WORDS = ["a", "cat", "dog", "photo", "of", "the", "red", "on", "grass"]


def _clip_tokenizer(directory: str) -> Any:
    """A CLIP BPE tokenizer over a small local vocabulary (no merges)."""
    import json

    from transformers import CLIPTokenizer

    os.makedirs(directory, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for w in _WORDS:
        vocab[w + "</w>"] = len(vocab)
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    with open(os.path.join(directory, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(directory, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    return CLIPTokenizer(os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt"),
                         model_max_length=16)


def _t5_tokenizer(directory: str) -> Any:
    """A T5 tokenizer: a Unigram model over the same words, built with the
    ``tokenizers`` library (what T5's spiece model would hold)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import T5TokenizerFast

    os.makedirs(directory, exist_ok=True)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0) for w in _WORDS]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz\u2581"]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    return T5TokenizerFast(tokenizer_file=path, extra_ids=0)


def save_flux_pipeline(directory: str, *, seed: int = 0, wide: int = 1, shard: str = SHARD,
                       t5: dict[str, Any] | None = None, transformer: dict[str, Any] | None = None,
                       save_dtype: torch.dtype | None = None) -> str:
    """A tiny FluxPipeline (CLIP + T5 encoders, VAE, transformer, scheduler)
    written with ``save_pretrained``; the transformer in several shards.

    ``wide`` multiplies the T5 feed-forward width and the transformer's
    attention heads and block count (memory tests need components whose
    sizes stand out of the process's noise; 1 is the tiny pipeline).
    ``t5`` / ``transformer`` override config fields (``bench/pipelines.py``
    builds a FLUX-shaped one); ``save_dtype`` casts the encoders and the
    transformer before saving (default: as built, fp32)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    scratch = directory + ".tokenizers"
    clip_tok, t5_tok = _clip_tokenizer(os.path.join(scratch, "clip")), _t5_tokenizer(os.path.join(scratch, "t5"))
    clip = CLIPTextModel(CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32,
                                        intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                                        vocab_size=len(clip_tok), projection_dim=32, max_position_embeddings=16))
    t5_cfg: dict[str, Any] = {"vocab_size": len(t5_tok), "d_model": 32 * wide, "d_kv": 8, "d_ff": 37 * wide * wide,
                              "num_layers": 2 if wide == 1 else wide, "num_heads": 4, **(t5 or {})}
    tr_cfg: dict[str, Any] = {"patch_size": 1, "in_channels": 4, "num_layers": 2 * (1 + (wide > 1)),
                              "num_single_layers": 2 * (1 + (wide > 1)), "attention_head_dim": 16,
                              "num_attention_heads": 2 * wide, "joint_attention_dim": t5_cfg["d_model"],
                              "pooled_projection_dim": 32, "axes_dims_rope": [4, 4, 8], **(transformer or {})}
    old = torch.get_default_dtype()
    if save_dtype is not None:
        torch.set_default_dtype(save_dtype)  # built in the saved dtype: no fp32 copy of a big component
    try:
        t5_model = T5EncoderModel(T5Config(**t5_cfg))
        flux = FluxTransformer2DModel(**tr_cfg)
    finally:
        torch.set_default_dtype(old)
    if save_dtype is not None:
        clip.to(save_dtype)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip, tokenizer=clip_tok,
                        text_encoder_2=t5_model, tokenizer_2=t5_tok, transformer=flux)
    pipe.save_pretrained(directory, max_shard_size=shard)
    return directory


def run_flux_pipeline(pipe: Any) -> torch.Tensor:
    """Two steps at 16x16 from a fixed seed; the image as a tensor."""
    with torch.no_grad():
        return pipe(prompt="a photo of a cat", height=16, width=16, num_inference_steps=2, guidance_scale=3.5,
                    max_sequence_length=12, generator=torch.Generator().manual_seed(0), output_type="pt").images
