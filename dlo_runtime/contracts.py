"""Final-layout contracts: how a model's canonical checkpoint becomes the
exact runtime bytes an HWR artifact holds.

A contract is the template a model author fills in to use HWR. It says:

- **who it is**: ``name`` and ``version`` (part of the identity key: bump the
  version whenever a transform changes bytes);
- **what the bytes are**: ``representation`` (runtime dtype and policy, e.g.
  bf16 with fp32 norms) and the ``transforms`` list, one :class:`Transform`
  per runtime tensor (cast, pack several canonical tensors into one, or
  compute a tensor the checkpoint does not hold);
- **what streams**: ``block_prefixes`` (``blocks.N.``) and ``blocks`` (the
  modules the DLO backend hooks), in execution order;
- **how to load without HWR**: :meth:`Contract.canonical_load` materializes
  the skeleton and copies each runtime tensor in, releasing every checkpoint
  tensor as soon as it has been copied (peak ≈ model, not checkpoint + model);
- **how to build an empty model**: :meth:`Contract.build_skeleton` (meta
  device, runtime dtypes), which a warm start restores from a lease;
- **which sources it reads**: :meth:`Contract.source_files`, hashed into the
  :class:`~hwr_client.core.identity.Identity` by :meth:`Contract.identity`.

Two contracts ship:

- ``tiny-dit`` (:class:`dlo_runtime.models.tiny_dit_contract.TinyDiTContract`,
  beside its model): the reference DiT. Its checkpoint differs from its
  runtime layout the way real ones do (q/k/v packed into one ``qkv``; fp32
  cast to bf16 with norms kept fp32; ``pos_embed`` and ``t_embedder.freqs``
  computed at load). Copy it for a real model.
- ``generic-safetensors`` (:class:`GenericContract`): any safetensors
  checkpoint whose runtime names ARE its checkpoint names, cast only. Any
  Hugging Face transformer can use it: pass a ``model_factory`` that builds
  the module (it is called under ``torch.device("meta")``).

Example (a Hugging Face model)::

    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(path)
    contract = GenericContract(model_factory=lambda: AutoModelForCausalLM.from_config(cfg))
    register_contract(contract)
    model = contract.build_skeleton(path)          # meta, no bytes
    contract.canonical_load(model, path)           # or dlo_runtime.restore_model(model, lease)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from hwr_client.core.errors import FailedPrecondition, InvalidArgument
from hwr_client.core.identity import Identity
from hwr_client.core.plan import derive_blocks
from hwr_client.sources import build_identity

from dlo_runtime.canonical import load_canonical_into
from dlo_runtime.checkpoint import CheckpointReader, checkpoint_files, iter_checkpoint

log = logging.getLogger(__name__)

#: Default parallel layout: TP1, no sequence parallelism.
DEFAULT_LAYOUT = {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"}


@dataclasses.dataclass(frozen=True)
class Transform:
    """How one runtime tensor is produced.

    ``kind`` is ``"cast"`` (one source, converted to ``dtype``), ``"pack"``
    (sources concatenated along dim 0, then cast) or ``"computed"`` (no
    source; ``compute()`` builds it from the config).
    """

    target: str
    kind: str
    sources: tuple[str, ...]
    dtype: torch.dtype
    compute: Callable[[], torch.Tensor] | None = None

    def apply(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The runtime tensor from its source tensors (in ``sources`` order)."""
        if self.kind == "computed":
            assert self.compute is not None
            return self.compute().to(self.dtype)
        if self.kind == "pack":
            return torch.cat([t.to(self.dtype) for t in inputs], dim=0)
        return inputs[0].to(self.dtype)


@dataclasses.dataclass
class LoadCounters:
    """What the canonical (producer) path did in this process. A warm start
    must leave every counter at zero (promotion gate)."""

    producer_calls: int = 0  # canonical_load / produce invocations
    bytes_materialized: int = 0  # private bytes allocated for model tensors
    checkpoint_bytes_read: int = 0

    def reset(self) -> None:
        """Sets every counter back to zero."""
        self.producer_calls = self.bytes_materialized = self.checkpoint_bytes_read = 0


def parse_layout(text: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A layout dict from ``"tp_rank=0,tp_size=2"`` (unset keys default to TP1).

    Raises:
        InvalidArgument: unknown keys or non-integer ranks/sizes.
    """
    layout = dict(DEFAULT_LAYOUT)
    if not text:
        return layout
    if isinstance(text, Mapping):
        items = dict(text)
    else:
        pairs = [kv.split("=", 1) for kv in str(text).split(",") if kv.strip()]
        if any(len(p) != 2 for p in pairs):
            raise InvalidArgument(f"layout {text!r}: expected key=value pairs, e.g. tp_rank=0,tp_size=2")
        items = dict(pairs)
    for key, value in items.items():
        key = key.strip()
        if key not in layout:
            raise InvalidArgument(f"layout key {key!r}: expected one of {sorted(layout)}")
        if key == "sp_backend":
            layout[key] = str(value).strip()
        else:
            try:
                layout[key] = int(value)
            except ValueError:
                raise InvalidArgument(f"layout {key}={value!r}: expected an integer") from None
    return layout


class Contract:
    """Base class of final-layout contracts; see the module docstring.

    Subclasses set ``name``, ``version``, ``representation`` and implement
    :meth:`build_skeleton`, :meth:`transforms` and :meth:`blocks`.
    """

    name: str = ""
    version: int = 1
    #: ``representation`` document of the identity.
    representation: Mapping[str, str] = {"dtype": "bfloat16"}
    #: Version of the producing code (this module) in the identity.
    producer_version: str = "1"

    def __init__(self) -> None:
        self.counters = LoadCounters()

    # -- what a model author implements ------------------------------------

    def build_skeleton(self, checkpoint_dir: str) -> nn.Module:
        """An empty model on the meta device with runtime dtypes."""
        raise NotImplementedError

    def transforms(self, checkpoint_dir: str, model: nn.Module) -> list[Transform]:
        """One transform per runtime tensor (every parameter and persistent
        buffer of ``model``), in the order they are produced."""
        raise NotImplementedError

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The streamable block modules in execution order."""
        raise NotImplementedError

    def block_prefixes(self, model: nn.Module) -> list[str]:
        """Name prefixes of the streamable blocks (``blocks.N.``)."""
        index = {id(m): n for n, m in model.named_modules()}
        return [index[id(b)] + "." for b in self.blocks(model)]

    def source_files(self, checkpoint_dir: str) -> list[str]:
        """Canonical files whose bytes determine the artifact (sorted paths)."""
        files = checkpoint_files(checkpoint_dir)
        config = os.path.join(checkpoint_dir, "config.json")
        return files + ([config] if os.path.exists(config) else [])

    # -- shared machinery ---------------------------------------------------

    def identity(self, checkpoint_dir: str, layout: Any = None, *, client: Any = None) -> Identity:
        """The identity of this contract's artifact for a checkpoint.

        With a ``client``, content ids come from the daemon's source-digest
        cache (:func:`hwr_client.sources.build_identity`); without one the
        files are hashed locally and nothing connects. The key is the same.

        Raises:
            InvalidArgument: bad layout or no checkpoint files.
        """
        t = self.identity_template(layout)
        return build_identity(
            contract=t["contract"], sources=self.source_files(checkpoint_dir), representation=t["representation"],
            layout=t["layout"], producer=t["producer"], extra=t["extra"], client=client, local=client is None,
        )

    def identity_template(self, layout: Any = None) -> dict[str, Any]:
        """The identity document of this contract's artifact without its
        sources (what :func:`hwr_client.start.resolve_start` sends; the
        daemon adds the content ids). :meth:`identity` builds from it, so
        both give one key.

        Raises:
            InvalidArgument: a bad layout.
        """
        return {
            "contract": {"name": self.name, "version": self.version},
            "representation": dict(self.representation), "layout": parse_layout(layout),
            # A stable name, not a module path: it is part of every key.
            "producer": {"id": f"dlo_runtime.contracts/{self.name}", "version": self.producer_version},
            "extra": dict(self.extra()),
        }

    def extra(self) -> dict[str, Any]:
        """Byte-relevant inputs not covered elsewhere (identity ``extra``)."""
        return {}

    def canonical_load(self, model: nn.Module, checkpoint_dir: str, *, mmap: bool = True) -> nn.Module:
        """Loads the canonical checkpoint into ``model`` (a skeleton): the
        ordinary, HWR-less path and the producer of a publication.

        For each transform it reads the sources, computes the runtime tensor
        (a fresh CPU tensor: the model's own memory), binds it in place of
        the meta tensor and drops the checkpoint tensors at once, so peak
        host memory is the model plus one transform's sources — never
        checkpoint + model.

        Args:
            model: the skeleton (meta); its tensors become CPU tensors here.
            checkpoint_dir: the canonical checkpoint.
            mmap: read through safetensors' mapping (default) or, False,
                ``readinto`` private buffers with no mapping at all (the
                startup transaction's recovery load bypasses checkpoint mmap).

        Raises:
            FailedPrecondition: the checkpoint lacks a tensor the contract
                needs, or has one it does not use, or a shape/dtype differs.
        """
        self.counters.producer_calls += 1
        transforms = self.transforms(checkpoint_dir, model)
        targets = dict(model.state_dict(keep_vars=True))
        reader = CheckpointReader(checkpoint_dir, mmap=mmap)
        with reader, torch.no_grad():
            for tr in transforms:
                inputs = [reader.take(s) for s in tr.sources]
                value = tr.apply(inputs)
                if inputs and value.data_ptr() == inputs[0].data_ptr():
                    value = value.clone()  # a same-dtype cast aliases the checkpoint tensor
                del inputs  # release checkpoint tensors as soon as they are transformed
                dest = targets.pop(tr.target, None)
                if dest is None or dest.shape != value.shape or dest.dtype != value.dtype:
                    raise FailedPrecondition(
                        f"contract {self.name}: runtime tensor {tr.target!r} is {value.dtype} {tuple(value.shape)}, "
                        f"model expects {'nothing' if dest is None else f'{dest.dtype} {tuple(dest.shape)}'}"
                    )
                _bind(model, tr.target, value)
                self.counters.bytes_materialized += value.nbytes
                del value
            self.counters.checkpoint_bytes_read += reader.bytes_read
        if targets:
            raise FailedPrecondition(f"contract {self.name}: no transform produces {sorted(targets)[:5]}")
        reader.check_consumed(self.name)
        return model

    def produce(self, checkpoint_dir: str) -> dict[str, torch.Tensor]:
        """The final-layout tensors (what ``hwr prewarm`` publishes)."""
        model = self.canonical_load(self.build_skeleton(checkpoint_dir), checkpoint_dir)
        return dict(model.state_dict())

    def finalize(self, model: nn.Module) -> nn.Module:
        """Shared cold/warm finalization. Must change neither bytes nor
        pointers (a warm start proves it): eval mode, no grad."""
        model.eval()
        model.requires_grad_(False)
        return model


def _bind(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replaces parameter or buffer ``name`` of ``model`` with ``value``."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if attr in owner._parameters:
        old = owner._parameters[attr]
        owner._parameters[attr] = nn.Parameter(value, requires_grad=bool(old is not None and old.requires_grad))
    else:
        owner._buffers[attr] = value


# -- any safetensors checkpoint --------------------------------------------------


class GenericContract(Contract):
    """Runtime layout = checkpoint layout; floating tensors are cast to
    ``dtype`` except names matching ``keep_fp32`` (norms by default).

    Args:
        model_factory: builds the module (called under the meta device);
            needed for :meth:`build_skeleton`/:meth:`canonical_load`, not for
            :meth:`produce`.
        dtype: runtime dtype name (torch spelling).
        keep_fp32: substrings of names kept in fp32.
        name: contract name (change it per model family if you like).
    """

    version = 1

    def __init__(
        self,
        model_factory: Callable[[], nn.Module] | None = None,
        *,
        dtype: str = "bfloat16",
        keep_fp32: Iterable[str] = ("norm",),
        name: str = "generic-safetensors",
    ):
        super().__init__()
        self.name = name
        self.model_factory = model_factory
        self.dtype = getattr(torch, dtype)
        self.keep_fp32 = tuple(keep_fp32)
        policy = "fp32:" + "|".join(self.keep_fp32) if self.keep_fp32 else "cast-all"
        self.representation = {"dtype": dtype, "policy": policy}

    def _dtype_of(self, name: str, source: torch.dtype) -> torch.dtype:
        if not source.is_floating_point:
            return source
        return torch.float32 if any(k in name for k in self.keep_fp32) else self.dtype

    def build_skeleton(self, checkpoint_dir: str) -> nn.Module:
        """``model_factory()`` under the meta device, cast to the runtime dtypes.

        Raises:
            InvalidArgument: no ``model_factory``.
        """
        if self.model_factory is None:
            raise InvalidArgument(f"contract {self.name}: build_skeleton needs a model_factory (a module class to build)")
        with torch.device("meta"):
            model = self.model_factory()
        for name, p in model.named_parameters():
            p.data = p.data.to(self._dtype_of(name, p.dtype))
        return model

    def transforms(self, checkpoint_dir: str, model: nn.Module) -> list[Transform]:
        """A cast per runtime tensor, from the checkpoint tensor of the same name."""
        return [Transform(n, "cast", (n,), t.dtype) for n, t in model.state_dict(keep_vars=True).items()]

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The modules of the name-derived blocks (``layers.N``...), in order."""
        modules = dict(model.named_modules())
        return [modules[prefix[:-1]] for prefix, _ in derive_blocks(list(model.state_dict())) if prefix[:-1] in modules]

    def canonical_load(self, model: nn.Module, checkpoint_dir: str, *, mmap: bool = True) -> nn.Module:
        """Cast-only load through :func:`dlo_runtime.canonical.load_canonical_into`
        (each checkpoint tensor released as soon as it is copied)."""
        self.counters.producer_calls += 1
        model.to_empty(device="cpu")
        self.counters.bytes_materialized += sum(t.nbytes for t in model.state_dict(keep_vars=True).values())
        report = load_canonical_into(model, iter_checkpoint(checkpoint_files(checkpoint_dir), mmap=mmap))
        self.counters.checkpoint_bytes_read += report.nbytes
        return model

    def produce(self, checkpoint_dir: str) -> dict[str, torch.Tensor]:
        """Cast tensors straight from the checkpoint; no module needed."""
        self.counters.producer_calls += 1
        out = {}
        with CheckpointReader(checkpoint_dir) as reader:
            for name in reader.names():
                t = reader.take(name)
                out[name] = t.to(self._dtype_of(name, t.dtype))
                self.counters.bytes_materialized += out[name].nbytes
            self.counters.checkpoint_bytes_read += reader.bytes_read
        return out




def check_no_meta(model: nn.Module) -> None:
    """Raises if any parameter or persistent buffer is still on meta.

    Raises:
        FailedPrecondition: naming the first tensors left on meta.
    """
    left = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise FailedPrecondition(f"model: tensors {left[:5]} are still on the meta device after load")


def private_bytes(model: nn.Module, regions: Sequence[Any] = ()) -> int:
    """Bytes of model tensors NOT backed by one of ``regions`` (objects with
    ``address`` and ``length``): what this process materialized itself."""
    spans = [(r.address, r.address + r.length) for r in regions]
    seen, total = set(), 0
    for t in model.state_dict(keep_vars=True).values():
        if t.is_meta or t.device.type != "cpu":
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        if not any(a <= ptr < b for a, b in spans):
            total += t.untyped_storage().nbytes()
    return total
