"""The final-layout contract of the reference DiT (:mod:`dlo_runtime.models.tiny_dit`),
kept beside the model it describes: copy this file for a real model.

Its checkpoint differs from its runtime layout the way real ones do: q/k/v
are packed into one ``qkv`` linear, fp32 is cast to bf16 with norms kept
fp32, and ``pos_embed`` and ``t_embedder.freqs`` are computed at load.
Registered as ``tiny-dit`` (:func:`dlo_runtime.contract_registry.get_contract`).
"""

from __future__ import annotations

from torch import nn

from dlo_runtime.contracts import Contract, Transform
from dlo_runtime.models import tiny_dit


class TinyDiTContract(Contract):
    """Final layout of :class:`dlo_runtime.models.tiny_dit.TinyDiT`:
    bf16 weights, fp32 norms, packed qkv, computed ``pos_embed``/``freqs``."""

    name = "tiny-dit"
    version = 1
    representation = {"dtype": "bfloat16", "policy": "fp32-norms"}

    def build_skeleton(self, checkpoint_dir: str) -> nn.Module:
        """A meta TinyDiT shaped by the checkpoint's ``config.json``."""
        return tiny_dit.TinyDiT(tiny_dit.TinyDiTConfig.load(checkpoint_dir), "meta")

    def transforms(self, checkpoint_dir: str, model: nn.Module) -> list[Transform]:
        """Pack for ``attn.qkv``, computed for the two tables, cast for the rest."""
        assert isinstance(model, tiny_dit.TinyDiT), f"contract {self.name}: expected a TinyDiT, got {type(model).__name__}"
        cfg = model.config
        computed = {"pos_embed": lambda: tiny_dit.pos_embed_table(cfg),
                    "t_embedder.freqs": lambda: tiny_dit.timestep_freqs(cfg)}
        out = []
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name in computed:
                out.append(Transform(name, "computed", (), tensor.dtype, computed[name]))
            elif name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
                stem, leaf = name.rsplit(".qkv.", 1)
                out.append(Transform(name, "pack", tuple(f"{stem}.to_{x}.{leaf}" for x in "qkv"), tensor.dtype))
            else:
                out.append(Transform(name, "cast", (name,), tensor.dtype))
        return out

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """``model.blocks``, in execution order."""
        assert isinstance(model, tiny_dit.TinyDiT), f"contract {self.name}: expected a TinyDiT, got {type(model).__name__}"
        return list(model.blocks)
