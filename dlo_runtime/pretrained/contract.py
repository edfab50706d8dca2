"""The final-layout contract of a diffusers / transformers model class
(see :mod:`dlo_runtime.pretrained` for what it decides and why)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from hwr_client.core.errors import FailedPrecondition, InvalidArgument

from dlo_runtime.contracts import Contract
from dlo_runtime.pretrained.eligibility import class_reasons
from dlo_runtime.pretrained.files import ModelFiles, hwr_version, import_library
from dlo_runtime.pretrained.keys import KeyPlan, plan_keys
from dlo_runtime.pretrained.skeleton import (check_loaded, default_dtype, dtype_of, find_blocks,
                                              parameters_on_meta, rebind)
from dlo_runtime.pretrained.weights import open_weights
from dlo_runtime.restore import tensor_slots

class PretrainedContract(Contract):
    """The final-layout contract of a diffusers / transformers model class.

    Args:
        files: the model directory (:func:`model_files`).
        model_class: the class (:func:`resolve_class`).
        dtype: runtime dtype name.
        fuse_qkv: apply the library's ``fuse_qkv_projections()`` (cold: on
            the loaded weights; warm: on the meta skeleton).
        blocks: ``"auto"`` or module names (a ``ModuleList`` name streams
            each of its children).
    """

    version = 1

    def __init__(self, files: ModelFiles, model_class: Any, *, dtype: str = "bfloat16", fuse_qkv: bool = False,
                 blocks: str | Sequence[str] = "auto"):
        super().__init__()
        self.files, self.model_class = files, model_class
        self.dtype_name, self.dtype = dtype, dtype_of(dtype)
        self.fuse_qkv = bool(fuse_qkv)
        self.block_names = blocks
        self.library = files.library
        lib = import_library(self.library)
        self.library_version = str(lib.__version__)
        self.name = f"{self.library}:{model_class.__name__}"
        self.producer_version = (f"hwr {hwr_version()}; {self.library} {self.library_version}; "
                                 f"torch {torch.__version__.split('+')[0]}")
        if self.fuse_qkv and not hasattr(model_class, "fuse_qkv_projections"):
            raise InvalidArgument(f"fuse_qkv=True: {self.name} has no fuse_qkv_projections(); "
                                  "expected a diffusers model that supports QKV fusion")
        self._spare: nn.Module | None = None
        self._keys: KeyPlan | None = None
        self._fp32_patterns: tuple[str, ...] = ()
        # Built now: the fp32 policy (part of the identity) is read off the
        # instance, as both libraries read it; the first start reuses it.
        self._spare = self._build(fused=self.fuse_qkv)
        policy = ",".join(self._fp32_patterns) or "none"
        self.representation = {"dtype": dtype, "policy": f"{self.library}-keep-fp32:{policy}"}

    # -- sources and identity -----------------------------------------------------

    def source_files(self, checkpoint_dir: str) -> list[str]:
        """Every weight shard and ``config.json`` (the architecture)."""
        return sorted(self.files.weights) + [self.files.config_path]

    def extra(self) -> dict[str, Any]:
        """``fuse_qkv`` changes bytes; explicit ``blocks`` change the
        artifact's block layout (what the backend streams as one range), so
        both are part of the key. ``"auto"`` adds nothing. A checkpoint
        whose keys are renamed on load adds the renames' digest
        (:meth:`KeyPlan.digest`); one loaded name for name adds nothing,
        so its key is what it was before key mapping existed."""
        out: dict[str, Any] = {"fuse_qkv": True} if self.fuse_qkv else {}
        if self.block_names != "auto":
            names = [self.block_names] if isinstance(self.block_names, str) else list(self.block_names)
            out["blocks"] = names
        if self.keys.digest():
            out["key_map"] = self.keys.digest()
        return out

    # -- key mapping and eligibility ------------------------------------------------

    @property
    def keys(self) -> KeyPlan:
        """The canonical key mapping (:mod:`dlo_runtime.pretrained.keys`),
        planned once on the unfused skeleton from the headers."""
        if self._keys is None:
            unfused = self._spare if self._spare is not None and not self.fuse_qkv else self._build(fused=False)
            self._keys = plan_keys(unfused, self.files, self.name)
        return self._keys

    def ineligible(self) -> list[str]:
        """Why HWR does not load this model (empty: it does); the start
        then loads with the library (:mod:`dlo_runtime.pretrained.eligibility`).
        Reads headers only; no daemon call."""
        reasons = class_reasons(self.files, self.model_class)
        return reasons if reasons else list(self.keys.ineligible)

    def check_keys(self) -> None:
        """Raises what the library would refuse too (a shape mismatch).

        Raises:
            FailedPrecondition: naming the file, the key and both shapes.
        """
        errors = self.keys.errors
        if errors:
            raise FailedPrecondition(f"checkpoint {self.files.directory}: {len(errors)} problem(s) loading "
                                     f"{self.name}: " + "; ".join(errors[:8]))

    # -- skeleton -----------------------------------------------------------------

    def _construct(self) -> nn.Module:
        cls = self.model_class
        with default_dtype(self.dtype), parameters_on_meta(), torch.no_grad():
            if self.library == "diffusers":
                config = cls.load_config(self.files.directory)
                model = cls.from_config(config)
            else:
                config = cls.config_class.from_pretrained(self.files.directory, local_files_only=True)
                # As transformers' from_pretrained does before it builds the
                # model: the requested dtype on the config and on every
                # sub-config, so a nested `_from_config` (CLIPTextModelWith-
                # Projection's text model) builds in it, not in the dtype the
                # checkpoint was saved in.
                config.dtype = self.dtype
                for sub_key in getattr(config, "sub_configs", {}) or {}:
                    sub = getattr(config, sub_key, None)
                    if sub is not None:
                        sub.dtype = self.dtype
                model = cls(config)
        if self.library == "transformers" and hasattr(model, "tie_weights"):
            model.tie_weights()  # as the ordinary load ties them: one tensor, two names
        return model

    def _policy(self, model: nn.Module) -> Callable[[str, torch.Tensor], torch.dtype]:
        """The library's dtype rule for a parameter / persistent buffer."""
        dtype = self.dtype
        if self.library == "diffusers":
            # diffusers.models.model_loading_utils.load_model_dict_into_meta:
            # floating tensors to `dtype`, fp32 under a kept module name component.
            keep = getattr(model, "_keep_in_fp32_modules", None) or []
            keep = [keep] if isinstance(keep, str) else list(keep)
            self._fp32_patterns = tuple(sorted(keep))

            def rule(name: str, t: torch.Tensor) -> torch.dtype:
                if not t.is_floating_point():
                    return t.dtype
                return torch.float32 if any(k in name.split(".") for k in keep) else dtype
            return rule
        # transformers: the constructed dtype, except the dtype plan's patterns
        # (transformers.core_model_loading: re.search of the alternation).
        plan = dict(model._get_dtype_plan(dtype)) if hasattr(model, "_get_dtype_plan") else {}
        self._fp32_patterns = tuple(sorted(plan))
        if not plan:
            return lambda name, t: t.dtype
        from transformers.core_model_loading import build_glob_alternation

        alt, by_group, _ = build_glob_alternation(list(plan))

        def rule_tf(name: str, t: torch.Tensor) -> torch.dtype:
            m = alt.search(name)
            return plan[by_group[m.lastgroup]] if m is not None and m.lastgroup is not None else t.dtype
        return rule_tf

    def _build(self, *, fused: bool) -> nn.Module:
        model = self._construct()
        rule = self._policy(model)
        replaced: dict[int, torch.Tensor] = {}
        for s in tensor_slots(model).slots:
            target = rule(s.name, s.tensor)
            if s.is_parameter:
                replaced[id(s.tensor)] = nn.Parameter(torch.empty(s.tensor.shape, dtype=target, device="meta"),
                                                      requires_grad=s.tensor.requires_grad)
            else:
                # Persistent buffers come from the artifact (warm) or the checkpoint (cold).
                replaced[id(s.tensor)] = torch.empty(s.tensor.shape, dtype=target, device="meta")
        rebind(model, replaced)
        if fused:
            with torch.no_grad():
                model.fuse_qkv_projections()  # on meta: shapes and modules only, no bytes
        model.eval()
        return model

    def block_count(self) -> int:
        """How many blocks :meth:`blocks` finds (on the prepared skeleton)."""
        model = self._spare if self._spare is not None else self._build(fused=self.fuse_qkv)
        return len(self.blocks(model))

    def give_back(self, model: nn.Module) -> None:
        """Keeps an untouched skeleton (one preflight only read) as the next
        :meth:`build_skeleton`'s: one model construction per start."""
        self._spare = model

    def build_skeleton(self, checkpoint_dir: str = "") -> nn.Module:
        """Parameters and persistent buffers on meta with runtime dtypes,
        non-persistent buffers real on the CPU; fused if ``fuse_qkv``."""
        spare, self._spare = self._spare, None
        return spare if spare is not None else self._build(fused=self.fuse_qkv)

    # -- canonical load -----------------------------------------------------------

    def transforms(self, checkpoint_dir: str, model: nn.Module) -> list[Any]:
        """Not used: :meth:`canonical_load` casts each tensor itself (tied
        names and fusion are the library's, not a per-tensor transform)."""
        raise NotImplementedError("PretrainedContract loads through canonical_load")

    def canonical_load(self, model: nn.Module, checkpoint_dir: str = "", *, mmap: bool = True) -> nn.Module:
        """Loads the checkpoint into the skeleton ``model`` (unfused) by the
        key plan and, with ``fuse_qkv``, fuses it with the library's own code.

        Every key, shape and dtype was planned from the headers before a
        byte is read; each checkpoint tensor is cast and released as soon
        as it is bound; keys the plan drops are never read.

        Returns:
            The loaded model (a fresh unfused skeleton is loaded and then
            fused when ``model`` is a fused skeleton).

        Raises:
            FailedPrecondition: an ineligible checkpoint (naming why: e.g. a
                tensor the checkpoint lacks), a shape mismatch (naming the
                file and the key), or a tensor left on meta.
        """
        reasons = self.ineligible()
        if reasons:
            raise FailedPrecondition(f"checkpoint {self.files.directory}: {self.name} cannot load through HWR: "
                                     + "; ".join(reasons))
        self.check_keys()
        self.counters.producer_calls += 1
        if self.fuse_qkv:
            model = self._build(fused=False)
        slots = {s.name: s for s in tensor_slots(model).slots}
        # checkpoint key -> the slot it fills (each slot from one key; tied names are one slot).
        fills = {key: slots[name] for name, key in self.keys.sources.items()}
        replaced: dict[int, torch.Tensor] = {}
        with open_weights(self.files.weights, self.files.format, mmap=mmap) as reader, torch.no_grad():
            for key in reader.file_order():
                s = fills.get(key)
                if s is None:
                    continue  # dropped by the plan (unused, ignored, a tied duplicate): not read
                src = reader.take(key)
                value = src.to(s.tensor.dtype)
                # A same-dtype tensor stays a view of the checkpoint's
                # copy-on-write mapping, as the library's own safetensors load
                # leaves it: no private copy, the pages shared with the page
                # cache (a cold bf16 start costs what the library's does).
                # The background publication reads those views; its
                # before/after snapshot catches a file changed underneath.
                aliased = value.data_ptr() == src.data_ptr()
                del src  # released before the next tensor is read
                replaced[id(s.tensor)] = (nn.Parameter(value, requires_grad=s.tensor.requires_grad)
                                          if s.is_parameter else value)
                self.counters.bytes_materialized += 0 if aliased else value.nbytes
                del value
            self.counters.checkpoint_bytes_read += reader.bytes_read
        rebind(model, replaced)
        if self.fuse_qkv:
            before = _param_bytes(model)
            with torch.no_grad():
                model.fuse_qkv_projections()  # the library's byte-changing transform, cold path only
            self.counters.bytes_materialized += _param_bytes(model) - before
        check_loaded(model, self.name)
        return model

    def produce(self, checkpoint_dir: str = "") -> dict[str, torch.Tensor]:
        """The final-layout tensors, each tied tensor once (what
        ``hwr prewarm --model`` publishes)."""
        model = self.canonical_load(self.build_skeleton(), mmap=True)
        return {s.name: s.tensor.detach() for s in tensor_slots(model).slots}

    # -- blocks ---------------------------------------------------------------------

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The streamed blocks in execution order (see :func:`find_blocks`)."""
        return find_blocks(model, self.block_names)

    def finalize(self, model: nn.Module) -> nn.Module:
        """Eval mode, no grad: neutral for bytes and pointers."""
        model.eval()
        model.requires_grad_(False)
        return model


def _param_bytes(model: nn.Module) -> int:
    return sum(s.tensor.nbytes for s in tensor_slots(model).slots if not s.tensor.is_meta)
