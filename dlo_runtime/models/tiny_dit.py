"""A small, deterministic diffusion transformer (DiT): the reference model.

It has the parts that make real DiT checkpoints awkward to load, so that the
final-layout contract (:mod:`dlo_runtime.models.tiny_dit_contract`) has
real work to do:

- **Packed attention projections.** The runtime module has one
  ``attn.qkv`` linear; the canonical checkpoint stores ``attn.to_q``,
  ``attn.to_k`` and ``attn.to_v`` separately (as diffusers checkpoints do).
- **Mixed representation.** The checkpoint is fp32; at runtime every
  weight is bf16 except norm weights, which stay fp32 (see
  :func:`runtime_dtype`).
- **Buffers computed at load.** ``pos_embed`` (2-D sin/cos table) and
  ``t_embedder.freqs`` (timestep frequency table) are persistent buffers
  that are NOT in the checkpoint: the loader computes them from
  ``config.json``.

Module tree (runtime names; ``N`` = block index)::

    x_embedder.{weight,bias}                 patch embedding, Linear(C*p*p, D)
    pos_embed                                buffer [1, T, D] fp32 (computed)
    t_embedder.freqs                         buffer [F/2] fp32 (computed)
    t_embedder.mlp.{0,2}.{weight,bias}       Linear(F, D), SiLU, Linear(D, D)
    blocks.N.norm1.{weight,bias}             LayerNorm (fp32)
    blocks.N.attn.qkv.{weight,bias}          packed Linear(D, 3D)
    blocks.N.attn.q_norm.weight / k_norm     RMSNorm over head_dim (fp32)
    blocks.N.attn.proj.{weight,bias}         Linear(D, D)
    blocks.N.norm2.{weight,bias}             LayerNorm (fp32)
    blocks.N.mlp.fc1 / fc2                   Linear(D, 4D), GELU, Linear(4D, D)
    blocks.N.adaLN_modulation.{weight,bias}  Linear(D, 6D) on SiLU(c)
    final_layer.norm.{weight,bias}           LayerNorm (fp32)
    final_layer.adaLN_modulation / linear    Linear(D, 2D), Linear(D, p*p*C)

The forward pass is deterministic on CPU and uses only ``F.linear``,
``layer_norm``, ``scaled_dot_product_attention`` and elementwise ops, so two
models holding the same bytes produce bitwise-equal outputs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE = "config.json"
#: Runtime dtype of every floating tensor that is not a norm weight/bias.
RUNTIME_DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class TinyDiTConfig:
    """Shape of a TinyDiT. All sizes are element counts.

    ``hidden`` must be divisible by ``heads``; ``heads`` divides into
    ``head_dim`` which must be even (the RMSNorm is over ``head_dim``).
    """

    in_channels: int = 4
    patch: int = 2
    image: int = 16  # latent height = width
    hidden: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    freq_dim: int = 64  # timestep sinusoid width
    eps: float = 1e-6

    @property
    def tokens(self) -> int:
        """Tokens per image: patches along each side, squared."""
        return (self.image // self.patch) ** 2

    @property
    def patch_dim(self) -> int:
        """Elements of one flattened patch (channels × patch × patch)."""
        return self.in_channels * self.patch * self.patch

    def to_json(self) -> str:
        """The ``config.json`` text of this config (sorted keys)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=1) + "\n"

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "TinyDiTConfig":
        """Builds a config from a ``config.json`` document (unknown keys
        rejected, so a typo never silently changes the model)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(doc) - fields - {"model_type"}
        if unknown:
            raise ValueError(f"TinyDiT config: unknown keys {sorted(unknown)}; expected {sorted(fields)}")
        return cls(**{k: v for k, v in doc.items() if k in fields})

    @classmethod
    def load(cls, checkpoint_dir: str) -> "TinyDiTConfig":
        """The config in ``checkpoint_dir/config.json``.

        Raises:
            ValueError: unknown keys (see :meth:`from_dict`).
            OSError: no readable ``config.json``.
        """
        with open(os.path.join(checkpoint_dir, CONFIG_FILE)) as f:
            return cls.from_dict(json.load(f))

    def block_bytes_fp32(self) -> int:
        """Bytes of one block in the fp32 canonical checkpoint."""
        d, m = self.hidden, self.hidden * self.mlp_ratio
        hd = d // self.heads
        weights = 6 * d * d + 3 * d * d + d * d + 2 * d * m
        biases = 6 * d + 3 * d + d + m + d + 4 * d + 2 * hd
        return 4 * (weights + biases)

    @classmethod
    def for_size(cls, nbytes: int, *, hidden: int | None = None) -> "TinyDiTConfig":
        """A config whose fp32 checkpoint is about ``nbytes``.

        Width grows with size (64 for a few MiB, 512 at 1 GiB, 2048 at 8 GiB)
        and depth fills the rest, so the block count stays like real DiTs'
        (FLUX has 57 blocks): 14–60.
        """
        if hidden is None:
            hidden = 64
            while hidden < 2048 and cls(hidden=hidden * 2, heads=max(4, hidden * 2 // 64)).block_bytes_fp32() * 24 <= nbytes:
                hidden *= 2
        heads = max(4, hidden // 64)
        probe = cls(hidden=hidden, heads=heads)
        depth = max(1, round(nbytes / probe.block_bytes_fp32()))
        return cls(hidden=hidden, heads=heads, depth=depth)


def is_norm(name: str) -> bool:
    """True for tensors kept in fp32 at runtime (norm weights and biases)."""
    return ".norm" in f".{name}" or "_norm." in name


def runtime_dtype(name: str) -> torch.dtype:
    """The runtime dtype of a parameter: fp32 for norms, bf16 otherwise."""
    return torch.float32 if is_norm(name) else RUNTIME_DTYPE


class Linear(nn.Module):
    """``y = x W^T + b`` with bf16 parameters created uninitialized on
    ``device`` (meta for a skeleton): no init work, no dtype conversion, so a
    skeleton costs O(tensors) and nothing else."""

    def __init__(self, fan_in: int, fan_out: int, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fan_out, fan_in, dtype=RUNTIME_DTYPE, device=device))
        self.bias = nn.Parameter(torch.empty(fan_out, dtype=RUNTIME_DTYPE, device=device))


class LayerNorm(nn.Module):
    """LayerNorm parameters (fp32, kept so at runtime)."""

    def __init__(self, dim: int, device: torch.device | str):
        super().__init__()
        self.normalized_shape = (dim,)
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(dim, dtype=torch.float32, device=device))


def _layer_norm(x: torch.Tensor, norm: LayerNorm, eps: float) -> torch.Tensor:
    # Norms run in fp32 (their weights are fp32) and hand bf16 back.
    return F.layer_norm(x.float(), norm.normalized_shape, norm.weight, norm.bias, eps).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _linear(x: torch.Tensor, lin: Linear) -> torch.Tensor:
    return F.linear(x.to(lin.weight.dtype), lin.weight, lin.bias)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class RMSNormWeight(nn.Module):
    """The fp32 weight of an RMSNorm over one head (applied in :class:`Attention`)."""

    def __init__(self, dim: int, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32, device=device))


class Attention(nn.Module):
    """Self-attention with one packed ``qkv`` projection and q/k RMSNorm."""

    def __init__(self, cfg: TinyDiTConfig, dev: torch.device | str):
        super().__init__()
        self.heads, self.eps = cfg.heads, cfg.eps
        self.qkv = Linear(cfg.hidden, 3 * cfg.hidden, dev)
        self.q_norm = RMSNormWeight(cfg.hidden // cfg.heads, dev)
        self.k_norm = RMSNormWeight(cfg.hidden // cfg.heads, dev)
        self.proj = Linear(cfg.hidden, cfg.hidden, dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends over ``x`` [batch, tokens, hidden]; same shape out."""
        b, t, d = x.shape
        qkv = _linear(x, self.qkv).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q = _rms_norm(qkv[0], self.q_norm.weight, self.eps)
        k = _rms_norm(qkv[1], self.k_norm.weight, self.eps)
        out = F.scaled_dot_product_attention(q, k, qkv[2])
        return _linear(out.transpose(1, 2).reshape(b, t, d), self.proj)


class Mlp(nn.Module):
    """The block's feed-forward: Linear, tanh-GELU, Linear."""

    def __init__(self, cfg: TinyDiTConfig, dev: torch.device | str):
        super().__init__()
        self.fc1 = Linear(cfg.hidden, cfg.hidden * cfg.mlp_ratio, dev)
        self.fc2 = Linear(cfg.hidden * cfg.mlp_ratio, cfg.hidden, dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the feed-forward to ``x``; same shape out."""
        return _linear(F.gelu(_linear(x, self.fc1), approximate="tanh"), self.fc2)


class DiTBlock(nn.Module):
    """One transformer block with adaLN-Zero style modulation."""

    def __init__(self, cfg: TinyDiTConfig, dev: torch.device | str):
        super().__init__()
        self.eps = cfg.eps
        self.norm1 = LayerNorm(cfg.hidden, dev)
        self.attn = Attention(cfg, dev)
        self.norm2 = LayerNorm(cfg.hidden, dev)
        self.mlp = Mlp(cfg, dev)
        self.adaLN_modulation = Linear(cfg.hidden, 6 * cfg.hidden, dev)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """One block on tokens ``x`` conditioned on ``c`` [batch, hidden]."""
        mod = _linear(F.silu(c), self.adaLN_modulation).to(x.dtype)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = mod.chunk(6, dim=-1)
        x = x + gate_a.unsqueeze(1) * self.attn(_modulate(_layer_norm(x, self.norm1, self.eps), shift_a, scale_a))
        return x + gate_m.unsqueeze(1) * self.mlp(_modulate(_layer_norm(x, self.norm2, self.eps), shift_m, scale_m))


class TimestepEmbedder(nn.Module):
    """Sinusoidal timestep features (``freqs``, computed at load), then an MLP."""

    def __init__(self, cfg: TinyDiTConfig, dev: torch.device | str):
        super().__init__()
        self.register_buffer("freqs", torch.empty(cfg.freq_dim // 2, device=dev), persistent=True)
        self.mlp = nn.Sequential(Linear(cfg.freq_dim, cfg.hidden, dev), nn.SiLU(), Linear(cfg.hidden, cfg.hidden, dev))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """The conditioning vector [batch, hidden] of timesteps ``t`` [batch]."""
        args = t.float()[:, None] * self.freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return _linear(F.silu(_linear(emb, self.mlp[0])), self.mlp[2])


class FinalLayer(nn.Module):
    """adaLN-modulated norm and the projection back to patches."""

    def __init__(self, cfg: TinyDiTConfig, dev: torch.device | str):
        super().__init__()
        self.eps = cfg.eps
        self.norm = LayerNorm(cfg.hidden, dev)
        self.adaLN_modulation = Linear(cfg.hidden, 2 * cfg.hidden, dev)
        self.linear = Linear(cfg.hidden, cfg.patch_dim, dev)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Tokens ``x`` conditioned on ``c`` -> patches [batch, tokens, patch_dim]."""
        shift, scale = _linear(F.silu(c), self.adaLN_modulation).to(x.dtype).chunk(2, dim=-1)
        return _linear(_modulate(_layer_norm(x, self.norm, self.eps), shift, scale), self.linear)


class TinyDiT(nn.Module):
    """The reference DiT, built with runtime dtypes and uninitialized
    tensors on ``dev`` (default meta: a skeleton), then loaded canonically or
    restored from a lease."""

    def __init__(self, cfg: TinyDiTConfig, dev: torch.device | str = "meta"):
        super().__init__()
        self.config = cfg
        self.x_embedder = Linear(cfg.patch_dim, cfg.hidden, dev)
        self.register_buffer("pos_embed", torch.empty(1, cfg.tokens, cfg.hidden, device=dev), persistent=True)
        self.t_embedder = TimestepEmbedder(cfg, dev)
        self.blocks = nn.ModuleList(DiTBlock(cfg, dev) for _ in range(cfg.depth))
        self.final_layer = FinalLayer(cfg, dev)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Denoises images ``x`` [batch, C, H, W] at timesteps ``t`` [batch]; fp32 out, same shape."""
        cfg = self.config
        b, c, h, w = x.shape
        p = cfg.patch
        patches = x.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, cfg.patch_dim)
        tokens = (_linear(patches, self.x_embedder).float() + self.pos_embed).to(RUNTIME_DTYPE)
        cond = self.t_embedder(t)
        for block in self.blocks:
            tokens = block(tokens, cond)
        out = self.final_layer(tokens, cond).float()
        return out.view(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


# -- tensors computed at load (not in the checkpoint) ------------------------


def timestep_freqs(cfg: TinyDiTConfig) -> torch.Tensor:
    """``t_embedder.freqs``: exp(-ln(10000) * i / half), fp32."""
    half = cfg.freq_dim // 2
    return torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half).float()


def pos_embed_table(cfg: TinyDiTConfig) -> torch.Tensor:
    """``pos_embed``: the 2-D sin/cos table of DiT, [1, T, D] fp32."""
    grid = cfg.image // cfg.patch
    quarter = cfg.hidden // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    ys, xs = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64), indexing="ij")

    def emb(pos: torch.Tensor) -> torch.Tensor:
        out = pos.reshape(-1, 1) * omega[None]
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    table = torch.cat([emb(ys), emb(xs)], dim=1)
    return table.float().reshape(1, grid * grid, cfg.hidden)


def sample_inputs(cfg: TinyDiTConfig, *, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (latent, timestep) inputs for a forward pass."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, cfg.image, cfg.image, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    return x, t


# -- the canonical checkpoint -------------------------------------------------

#: Default largest shard of a written checkpoint (like HF's max_shard_size).
SHARD_BYTES = 512 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"


def canonical_names(cfg: TinyDiTConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every canonical checkpoint tensor, in file order.

    The checkpoint holds q/k/v separately and has no computed buffers.
    """
    d, m, hd = cfg.hidden, cfg.hidden * cfg.mlp_ratio, cfg.hidden // cfg.heads
    out: list[tuple[str, tuple[int, ...]]] = [
        ("x_embedder.weight", (d, cfg.patch_dim)), ("x_embedder.bias", (d,)),
        ("t_embedder.mlp.0.weight", (d, cfg.freq_dim)), ("t_embedder.mlp.0.bias", (d,)),
        ("t_embedder.mlp.2.weight", (d, d)), ("t_embedder.mlp.2.bias", (d,)),
    ]
    for i in range(cfg.depth):
        p = f"blocks.{i}."
        out += [(p + "norm1.weight", (d,)), (p + "norm1.bias", (d,))]
        for proj in ("to_q", "to_k", "to_v"):
            out += [(f"{p}attn.{proj}.weight", (d, d)), (f"{p}attn.{proj}.bias", (d,))]
        out += [
            (p + "attn.q_norm.weight", (hd,)), (p + "attn.k_norm.weight", (hd,)),
            (p + "attn.proj.weight", (d, d)), (p + "attn.proj.bias", (d,)),
            (p + "norm2.weight", (d,)), (p + "norm2.bias", (d,)),
            (p + "mlp.fc1.weight", (m, d)), (p + "mlp.fc1.bias", (m,)),
            (p + "mlp.fc2.weight", (d, m)), (p + "mlp.fc2.bias", (d,)),
            (p + "adaLN_modulation.weight", (6 * d, d)), (p + "adaLN_modulation.bias", (6 * d,)),
        ]
    out += [
        ("final_layer.norm.weight", (d,)), ("final_layer.norm.bias", (d,)),
        ("final_layer.adaLN_modulation.weight", (2 * d, d)), ("final_layer.adaLN_modulation.bias", (2 * d,)),
        ("final_layer.linear.weight", (cfg.patch_dim, d)), ("final_layer.linear.bias", (cfg.patch_dim,)),
    ]
    return out


def _init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Deterministic init with sane scales, so deep stacks stay finite."""
    t = torch.randn(shape, generator=g)
    if is_norm(name):
        return t.mul_(0.1).add_(1.0) if name.endswith("weight") else t.mul_(0.02)
    if len(shape) == 2:
        return t.mul_(1.0 / math.sqrt(shape[1]))
    return t.mul_(0.02)


def write_checkpoint(
    directory: str,
    cfg: TinyDiTConfig,
    *,
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    progress: Any = None,
) -> list[str]:
    """Writes a canonical fp32 checkpoint (``config.json`` + safetensors,
    sharded with an HF-style index when larger than ``shard_bytes``).

    Deterministic: the same (cfg, seed, shard_bytes) gives the same bytes.
    Holds at most one shard in memory.

    Args:
        directory: created if missing.
        cfg: the model shape.
        seed: init seed.
        shard_bytes: largest shard size.
        progress: optional callable(bytes_done, bytes_total).

    Returns:
        The paths of the written files (config and index included).
    """
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    names = canonical_names(cfg)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in names:
        nbytes = 4 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    total, done = sum(4 * math.prod(s) for _, s in names), 0
    g = torch.Generator().manual_seed(seed)
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _init(name, shape, g) for name, shape in shard}
        save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
        done += sum(t.numel() * 4 for t in tensors.values())
        del tensors
        weight_map.update({name: fname for name, _ in shard})
        paths.append(os.path.join(directory, fname))
        if progress is not None:
            progress(done, total)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=1, sort_keys=True)
        paths.append(os.path.join(directory, INDEX_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        f.write(json.dumps(dict(dataclasses.asdict(cfg), model_type="tiny-dit"), sort_keys=True, indent=1) + "\n")
    paths.append(os.path.join(directory, CONFIG_FILE))
    return paths
