"""Tiny pipelines of classes other than FLUX for the lazy-pipeline tests:
a StableDiffusion3Pipeline (two CLIP encoders with projection, T5,
SD3 transformer, VAE) and a WanPipeline (UMT5, Wan transformer, Wan VAE;
``transformer_2`` absent), random weights saved with ``save_pretrained``,
tokenizers built locally (:mod:`tests.support.real_models`); nothing is
downloaded. Also a peak-RSS sampler shared by the lazy tests."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from tests.support.real_models import SHARD, _clip_tokenizer, _t5_tokenizer


def _clip_with_projection(vocab: int) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=vocab, projection_dim=32, max_position_embeddings=16))


def save_sd3_pipeline(directory: str, *, seed: int = 0, clip_dtype: torch.dtype | None = None,
                      t5: dict[str, Any] | None = None, transformer: dict[str, Any] | None = None,
                      save_dtype: torch.dtype | None = None, shard: str = SHARD) -> str:
    """A tiny StableDiffusion3Pipeline; its transformer in several shards.

    ``clip_dtype``: the two CLIP encoders saved in it (default fp32);
    ``t5`` / ``transformer``: config overrides (``bench/pipelines.py``
    builds an SD3-shaped one); ``save_dtype``: T5 and the transformer built
    and saved in it (default fp32)."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    scratch = directory + ".tokenizers"
    clip_tok, t5_tok = _clip_tokenizer(os.path.join(scratch, "clip")), _t5_tokenizer(os.path.join(scratch, "t5"))
    # pooled_projection_dim: both CLIP projections side by side (2 x 32);
    # joint_attention_dim: T5's width (the CLIP states are cut to it).
    t5_cfg: dict[str, Any] = {"vocab_size": len(t5_tok), "d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2,
                              "num_heads": 4, **(t5 or {})}
    tr_cfg: dict[str, Any] = {"sample_size": 8, "patch_size": 1, "in_channels": 4, "num_layers": 2,
                              "attention_head_dim": 8, "num_attention_heads": 4, "caption_projection_dim": 32,
                              "joint_attention_dim": t5_cfg["d_model"], "pooled_projection_dim": 64,
                              "out_channels": 4, "pos_embed_max_size": 16, **(transformer or {})}
    old = torch.get_default_dtype()
    if save_dtype is not None:
        torch.set_default_dtype(save_dtype)  # built in the saved dtype: no fp32 copy of a big component
    try:
        t5_model = T5EncoderModel(T5Config(**t5_cfg))
        sd3 = SD3Transformer2DModel(**tr_cfg)
    finally:
        torch.set_default_dtype(old)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    clips = [_clip_with_projection(len(clip_tok)) for _ in range(2)]
    if clip_dtype is not None:
        clips = [c.to(clip_dtype) for c in clips]
    pipe = StableDiffusion3Pipeline(
        transformer=sd3, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
        text_encoder=clips[0], tokenizer=clip_tok, text_encoder_2=clips[1], tokenizer_2=clip_tok,
        text_encoder_3=t5_model, tokenizer_3=t5_tok)
    pipe.save_pretrained(directory, max_shard_size=shard)
    return directory


def run_sd3_pipeline(pipe: Any, *, guidance_scale: float = 1.0) -> torch.Tensor:
    """Two steps at 16x16 from a fixed seed (guidance 1: no CFG)."""
    with torch.no_grad():
        return pipe(prompt="a photo of a cat", negative_prompt="blurry red", height=16, width=16,
                    num_inference_steps=2, guidance_scale=guidance_scale, max_sequence_length=12,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images


def save_wan_pipeline(directory: str, *, seed: int = 0) -> str:
    """A tiny WanPipeline (Wan 2.1 shape: ``transformer_2`` absent)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tok = _t5_tokenizer(os.path.join(directory + ".tokenizers", "t5"))
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        rope_max_seq_len=32)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                          num_heads=4))
    pipe = WanPipeline(tokenizer=tok, text_encoder=encoder, transformer=transformer, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.save_pretrained(directory, max_shard_size=SHARD)
    return directory


def run_wan_pipeline(pipe: Any) -> torch.Tensor:
    """Two CFG steps, 5 frames at 16x16, from a fixed seed."""
    with torch.no_grad():
        return pipe(prompt="a dog on the grass", negative_prompt="blurry", height=16, width=16, num_frames=5,
                    num_inference_steps=2, guidance_scale=5.0, max_sequence_length=12,
                    generator=torch.Generator().manual_seed(0), output_type="pt").frames


# -- peak memory, sampled -----------------------------------------------------------------


def rss() -> int:
    """This process's resident set (bytes), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """Peak RSS of this process, sampled from a thread every millisecond."""

    def __enter__(self) -> "Sampler":
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base
