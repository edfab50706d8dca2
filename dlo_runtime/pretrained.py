"""Real models through HWR and DLO with one call: :func:`from_pretrained`.

A diffusers model directory (``config.json`` with ``_class_name``,
``diffusion_pytorch_model*.safetensors``), a transformers one (``config.json``
with ``architectures``, ``model*.safetensors``), a pipeline component
(``subfolder="transformer"``) or a hub cache snapshot becomes a
:class:`PretrainedContract`: the same :class:`~dlo_runtime.contracts.Contract`
seam the reference model uses, filled in from the library class instead of
written by hand. The start then runs the one start-up decision path every
worker runs: :func:`hwr_client.resolve.resolve` decides (hit / miss / failure
per mode), :class:`~dlo_runtime.transaction.StartupTransaction` restores or
loads canonically and hands the lease to the DLO backend, and a preferred
miss publishes for the next start.

What the contract decides, and why:

- **identity**: every weight shard and ``config.json`` (the config decides the
  architecture); contract ``<library>:<Class>``; representation = dtype and
  the library's fp32-kept policy; producer = HWR's, the library's and torch's
  versions (an upgrade may change load transforms, so it gets a new key);
  ``fuse_qkv`` in ``extra``.
- **skeleton**: the model's own constructor under the target default dtype
  (what both libraries' ``from_pretrained`` do) with parameters put on meta
  as they are registered and buffers built for real on the CPU (accelerate's
  ``init_empty_weights(include_buffers=False)`` convention, ~20 lines here
  instead of a dependency), so non-persistent buffers (rotary tables,
  position ids) equal the ordinary load's; persistent buffers go to meta and
  come from the artifact or the checkpoint.
- **dtype policy**: the library's own: diffusers casts every floating tensor
  to the dtype except those under a ``_keep_in_fp32_modules`` name
  component; transformers keeps the constructed dtype except its dtype plan
  (``_keep_in_fp32_modules`` for fp16, ``_keep_in_fp32_modules_strict``
  for fp16 and bf16). Outputs then equal the library's ``from_pretrained``
  bit for bit (the tests prove it).
- **blocks**: ``"auto"`` finds the outermost ``nn.ModuleList`` stacks of
  same-class modules holding a tenth or more of the parameters, in
  registration order (the parity tests prove it is the execution order for
  the shipped families).

Example::

    loaded = dlo_runtime.from_pretrained("models/flux/transformer", device="cuda:0")
    image = pipe_with(loaded.model)          # LOCAL_HIT from the second start on
    loaded.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from hwr_client.core.errors import FailedPrecondition, InvalidArgument, NotFound
from hwr_client.resolve import Mode, Outcome, parse_mode

from dlo_runtime.checkpoint import CheckpointReader
from dlo_runtime.contracts import Contract, private_bytes
from dlo_runtime.restore import tensor_slots

log = logging.getLogger(__name__)

#: Libraries a directory can belong to, with the weight file stem each writes.
WEIGHT_STEMS = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}

#: Extra to install per library (named in the error when it is missing).
EXTRAS = {"diffusers": "diffusers", "transformers": "transformers"}

#: Share of the parameters an automatically found block stack must hold.
AUTO_BLOCK_MIN_SHARE = 0.10


# -- what a model directory holds ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """The files of one model directory.

    Attributes:
        directory: the model's own directory (``model_dir/subfolder``).
        library: ``"diffusers"`` or ``"transformers"``.
        class_name: ``_class_name`` / ``architectures[0]`` of the config.
        config_path: its ``config.json``.
        weights: its safetensors shards, sorted.
        config: the parsed config.
    """

    directory: str
    library: str
    class_name: str
    config_path: str
    weights: tuple[str, ...]
    config: dict[str, Any]


def model_files(model_dir: str, subfolder: str | None = None) -> ModelFiles:
    """Reads what ``model_dir`` (or its ``subfolder``) holds; touches no weight.

    Raises:
        NotFound: no such directory, or no ``config.json`` in it.
        InvalidArgument: a config naming no class, or no safetensors weights
            (the message says which file names were expected).
    """
    directory = os.path.join(model_dir, subfolder) if subfolder else model_dir
    if not os.path.isdir(directory):
        raise NotFound(f"model directory {directory}: no such directory")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        hint = " (a pipeline directory? pass subfolder=, e.g. 'transformer')" if os.path.isfile(
            os.path.join(directory, "model_index.json")) else ""
        raise NotFound(f"model directory {directory}: no config.json; expected a diffusers or transformers "
                       f"model directory{hint}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{config_path}: not a JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{config_path}: expected a JSON object")
    if isinstance(config.get("_class_name"), str):
        library, class_name = "diffusers", config["_class_name"]
    elif isinstance(config.get("architectures"), list) and config["architectures"]:
        library, class_name = "transformers", str(config["architectures"][0])
    else:
        raise InvalidArgument(f"{config_path}: names no model class; expected '_class_name' (diffusers) or "
                              "'architectures' (transformers)")
    weights = _weight_files(directory, WEIGHT_STEMS[library])
    return ModelFiles(directory, library, class_name, config_path, weights, config)


def _weight_files(directory: str, stem: str) -> tuple[str, ...]:
    index = os.path.join(directory, f"{stem}.safetensors.index.json")
    single = os.path.join(directory, f"{stem}.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted({os.path.join(directory, str(v)) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgument(f"{index}: not a safetensors index ({exc}); expected {{'weight_map': ...}}") from None
        missing = [s for s in shards if not os.path.isfile(s)]
        if missing:
            raise NotFound(f"{index}: names shard {os.path.basename(missing[0])}, which is not in {directory}")
        return tuple(shards)
    if os.path.isfile(single):
        return (single,)
    others = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".safetensors", ".pt", ".pth")))
    raise InvalidArgument(
        f"model directory {directory}: no weights; expected {stem}.safetensors or {stem}.safetensors.index.json"
        + (f" (found {others[:3]}: only safetensors checkpoints with the library's file names are read)"
           if others else ""))


def import_library(library: str) -> Any:
    """The library module, or an error naming the extra to install.

    Raises:
        FailedPrecondition: it is not installed.
    """
    try:
        return importlib.import_module(library)
    except ImportError as exc:
        raise FailedPrecondition(f"{library} is not installed ({exc}); install it with "
                                 f"pip install 'hwr[{EXTRAS[library]}]'") from None


def resolve_class(files: ModelFiles, model_class: Any = None) -> Any:
    """The model class: ``model_class`` or the config's class in the library.

    Raises:
        InvalidArgument: the installed library has no such class, or
            ``model_class`` has no ``from_config``.
    """
    lib = import_library(files.library)
    if model_class is not None:
        if not hasattr(model_class, "from_config") and not hasattr(model_class, "_from_config"):
            raise InvalidArgument(f"model_class {model_class!r}: expected a class with from_config "
                                  "(a diffusers ModelMixin or a transformers PreTrainedModel)")
        return model_class
    cls = getattr(lib, files.class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise InvalidArgument(f"{files.config_path}: class {files.class_name!r} is not in the installed "
                              f"{files.library} {lib.__version__}; upgrade {files.library} or pass model_class=")
    return cls


def hwr_version() -> str:
    """HWR's version (the installed distribution's, else the source tree's)."""
    try:
        return importlib.metadata.version("hwr")
    except importlib.metadata.PackageNotFoundError:
        return "source"


# -- skeletons ----------------------------------------------------------------------

_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers
    stay where their module built them (accelerate's
    ``init_empty_weights(include_buffers=False)`` convention).

    Patches ``nn.Module.register_parameter`` (``self.weight = Parameter(...)``
    goes through it), process-wide for the duration: a lock keeps two
    builds from unpatching each other.
    """
    with _PATCH_LOCK:
        original = nn.Module.register_parameter

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original(module, name, param)
            if param is not None and not param.is_meta:
                p = module._parameters[name]
                assert p is not None
                # The parameter's class and attributes survive (as accelerate keeps them).
                kwargs = dict(p.__dict__)
                kwargs["requires_grad"] = p.requires_grad
                module._parameters[name] = type(p)(p.data.to("meta"), **kwargs)

        nn.Module.register_parameter = register  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """The model is constructed under the target dtype, as both libraries'
    ``from_pretrained`` construct it (buffers made without an explicit dtype
    then match)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _dtype_of(name: str) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise InvalidArgument(f"dtype {name!r}: expected a floating torch dtype name (bfloat16, float16, float32)")
    return value


def _rebind(model: nn.Module, replaced: dict[int, torch.Tensor]) -> None:
    """Puts ``replaced[id(old)]`` in place of ``old`` in every module that
    holds it, so tied weights stay one tensor."""
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for attr, t in table.items():
                if t is not None and id(t) in replaced:
                    table[attr] = replaced[id(t)]


# -- the contract -------------------------------------------------------------------


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
        self.dtype_name, self.dtype = dtype, _dtype_of(dtype)
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
        """``fuse_qkv`` changes bytes, so it is part of the key."""
        return {"fuse_qkv": True} if self.fuse_qkv else {}

    # -- skeleton -----------------------------------------------------------------

    def _construct(self) -> nn.Module:
        cls = self.model_class
        with default_dtype(self.dtype), parameters_on_meta(), torch.no_grad():
            if self.library == "diffusers":
                config = cls.load_config(self.files.directory)
                model = cls.from_config(config)
            else:
                config = cls.config_class.from_pretrained(self.files.directory, local_files_only=True)
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
        _rebind(model, replaced)
        if fused:
            with torch.no_grad():
                model.fuse_qkv_projections()  # on meta: shapes and modules only, no bytes
        model.eval()
        return model

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
        """Loads the checkpoint into the skeleton ``model`` (unfused) and, with
        ``fuse_qkv``, fuses it with the library's own code.

        Every name, shape and dtype is checked against the shard headers
        before a byte is read; each checkpoint tensor is cast and released
        as soon as it is bound.

        Returns:
            The loaded model (a fresh unfused skeleton is loaded and then
            fused when ``model`` is a fused skeleton).

        Raises:
            FailedPrecondition: a missing or unexpected key, a shape
                mismatch (naming the shard and the key), or a tensor left on
                meta.
        """
        self.counters.producer_calls += 1
        if self.fuse_qkv:
            model = self._build(fused=False)
        walk = tensor_slots(model)
        slots = {s.name: s for s in walk.slots}
        # Tied aliases (lm_head.weight = embed_tokens.weight): a checkpoint
        # may carry them; the library ignores them, and so does this load.
        aliases = set(model.state_dict(keep_vars=True)) - set(slots)
        reader = CheckpointReader(list(self.files.weights), mmap=mmap)
        with reader:
            where = dict(reader._where)
            problems = []
            for name, s in slots.items():
                found = where.get(name)
                if found is None:
                    problems.append(f"missing key {name!r} (expected {list(s.tensor.shape)})")
                elif tuple(found[1].shape) != tuple(s.tensor.shape):
                    problems.append(f"{os.path.basename(self.files.weights[found[0]])}: {name!r} has shape "
                                    f"{list(found[1].shape)}, {self.name} expects {list(s.tensor.shape)}")
            unexpected = sorted(n for n in where if n not in slots and n not in aliases)
            problems += [f"{os.path.basename(self.files.weights[where[n][0]])}: unexpected key {n!r} "
                         f"(not a parameter or persistent buffer of {self.name})" for n in unexpected[:5]]
            if problems:
                raise FailedPrecondition(
                    f"checkpoint {self.files.directory}: {len(problems)} problem(s) loading {self.name}: "
                    + "; ".join(problems[:8]))
            replaced: dict[int, torch.Tensor] = {}
            with torch.no_grad():
                for name in reader.file_order():
                    if name not in slots:
                        reader.take(name)  # an ignored tied alias: read nothing into the model
                        continue
                    s = slots[name]
                    src = reader.take(name)
                    value = src.to(s.tensor.dtype)
                    if value.data_ptr() == src.data_ptr():
                        value = value.clone()  # a same-dtype cast aliases the checkpoint mapping
                    del src  # released before the next tensor is read
                    replaced[id(s.tensor)] = (nn.Parameter(value, requires_grad=s.tensor.requires_grad)
                                              if s.is_parameter else value)
                    self.counters.bytes_materialized += value.nbytes
                    del value
            self.counters.checkpoint_bytes_read += reader.bytes_read
        _rebind(model, replaced)
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


def check_loaded(model: nn.Module, what: str) -> None:
    """Raises if any parameter or buffer (persistent or not) is on meta.

    Raises:
        FailedPrecondition: naming the tensors and why.
    """
    walk = tensor_slots(model)
    left = [s.name for s in walk.slots if s.tensor.is_meta]
    if left:
        raise FailedPrecondition(f"{what}: {left[:5]} still on meta after the load; the checkpoint does not hold "
                                 "them and the model does not compute them")
    if walk.meta_non_persistent:
        raise FailedPrecondition(f"{what}: non-persistent buffers {walk.meta_non_persistent[:5]} are on meta; "
                                 "the model built them on meta, so neither the checkpoint nor the artifact has them")


# -- blocks ---------------------------------------------------------------------------


def _nparams(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, names: str | Sequence[str] = "auto") -> list[nn.Module]:
    """The blocks to stream, in execution order.

    ``"auto"``: the outermost ``nn.ModuleList``s whose children are two or
    more modules of one class and which hold at least
    :data:`AUTO_BLOCK_MIN_SHARE` of the parameters, in registration order
    (FLUX: ``transformer_blocks`` then ``single_transformer_blocks``; Llama:
    ``model.layers``; T5: ``encoder.block``). Otherwise module names: a
    ``ModuleList`` streams each child, any other module streams itself.

    Raises:
        InvalidArgument: a name that is not a submodule.
    """
    modules = dict(model.named_modules())
    if names != "auto":
        if isinstance(names, str):
            names = [names]
        out: list[nn.Module] = []
        for n in names:
            if n not in modules or n == "":
                raise InvalidArgument(f"blocks: {n!r} is not a submodule of {type(model).__name__}; expected one "
                                      f"of its module names, e.g. {[k for k in modules if k][:3]}")
            m = modules[n]
            out += list(m) if isinstance(m, nn.ModuleList) else [m]
        return out
    total = max(_nparams(model), 1)
    chosen: list[str] = []
    for name, m in modules.items():
        if not isinstance(m, nn.ModuleList) or len(m) < 2 or len({type(c) for c in m}) != 1:
            continue
        if any(name.startswith(c + ".") for c in chosen):
            continue  # inside a stack already chosen
        if _nparams(m) >= AUTO_BLOCK_MIN_SHARE * total:
            chosen.append(name)
    return [c for name in chosen for c in modules[name]]


# -- the one call ---------------------------------------------------------------------


@dataclasses.dataclass
class PretrainedReport:
    """What a :func:`from_pretrained` start did and cost.

    Attributes:
        outcome: ``LOCAL_HIT``, ``CANONICAL_FALLBACK`` or ``DISABLED``.
        key: identity key ("" when disabled).
        contract: ``<library>:<Class>``; ``library_version`` its version.
        seconds: wall seconds per phase, and ``total``.
        bytes_materialized: private bytes this process allocated for the
            model's tensors (0 on a warm start).
        producer_calls: canonical loads run (0 on a warm start).
        blocks: names of the streamed blocks, in order; ``streamed_bytes``
            their bytes; ``streamed_fraction`` their share of the parameters.
        notes: anything worth a look (streamed blocks under half the model).
        publish: the publish-after-load report on a preferred miss.
        trail: the startup transaction's steps.
    """

    outcome: str
    key: str = ""
    contract: str = ""
    library_version: str = ""
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_materialized: int = 0
    producer_calls: int = 0
    checkpoint_bytes_read: int = 0
    blocks: list[str] = dataclasses.field(default_factory=list)
    streamed_bytes: int = 0
    streamed_fraction: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)
    publish: dict[str, Any] | None = None
    trail: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return dataclasses.asdict(self)


class LoadedModel:
    """A model :func:`from_pretrained` started: ``model`` (eval mode, DLO
    hooks when a device was given), ``outcome``, ``key``, ``report``.
    :meth:`close` (or leaving the ``with`` block) tears down the backend,
    which closes the lease, then the client."""

    def __init__(self, model: nn.Module, report: PretrainedReport, *, backend: Any = None, client: Any = None,
                 contract: PretrainedContract | None = None):
        self.model, self.report = model, report
        self.backend, self.client, self.contract = backend, client, contract

    @property
    def outcome(self) -> Outcome:
        """How the start went (:class:`~hwr_client.resolve.Outcome`)."""
        return Outcome(self.report.outcome)

    @property
    def key(self) -> str:
        """The identity key ("" when HWR was disabled)."""
        return self.report.key

    @property
    def lease(self) -> Any:
        """The lease the backend owns on a warm start, else None."""
        return getattr(self.backend, "lease", None)

    def close(self) -> None:
        """Backend (drain, unhook, close the lease), then the client. Idempotent."""
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()
        client, self.client = self.client, None
        if client is not None:
            client.close()

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _library_load(files: ModelFiles, cls: Any, dtype: torch.dtype) -> nn.Module:
    """The library's own ``from_pretrained`` (what ``mode="disabled"`` is)."""
    key = "torch_dtype" if files.library == "diffusers" else "dtype"
    return cls.from_pretrained(files.directory, **{key: dtype}, local_files_only=True)


def _block_report(model: nn.Module, blocks: Sequence[nn.Module], report: PretrainedReport) -> None:
    names = {id(m): n for n, m in model.named_modules()}
    report.blocks = [names[id(b)] for b in blocks]
    streamed = sum(s.tensor.nbytes for b in blocks for s in tensor_slots(b).slots)
    params = sum(p.numel() for b in blocks for p in b.parameters())
    report.streamed_bytes = streamed
    report.streamed_fraction = round(params / max(_nparams(model), 1), 4)
    if report.streamed_fraction < 0.5:
        report.notes.append(f"streamed blocks hold {report.streamed_fraction:.0%} of the parameters (under half): "
                            "pass blocks=[...] to stream more")


def publish_groups(model: nn.Module, blocks: Sequence[nn.Module]) -> list[tuple[str, list[str]]]:
    """The artifact's block groups: one ``(prefix, names)`` per block, so
    each streamed block is one contiguous range of the artifact (what the
    DLO backend copies in one go)."""
    names = {id(m): n for n, m in model.named_modules()}
    groups = []
    for b in blocks:
        prefix = names[id(b)] + "."
        # The prefix travels with the group: T5's tensors all sit under
        # block.N.layer., deeper than the module the backend streams.
        groups.append((prefix, [prefix + s.name for s in tensor_slots(b).slots]))
    return groups


def _progress_printer(what: str) -> Callable[[int, int], None]:
    last = [-1]

    def show(done: int, total: int) -> None:
        step = 100 * done // max(total, 1) // 25 * 25
        if step > last[0]:
            last[0] = step
            print(f"{what} {step:3d}%  ({done >> 20} / {total >> 20} MiB)", file=sys.stderr, flush=True)

    return show


def from_pretrained(
    model_dir: str | os.PathLike[str],
    *,
    subfolder: str | None = None,
    model_class: Any = None,
    mode: Mode | str = "preferred",
    dtype: str = "bfloat16",
    device: str | torch.device | None = None,
    blocks: str | Sequence[str] = "auto",
    resident_blocks: int = 0,
    fuse_qkv: bool = False,
    socket: str | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Loads a diffusers / transformers model through HWR (and DLO).

    Args:
        model_dir: a model directory, a pipeline directory with
            ``subfolder``, or a hub cache snapshot. Never the network.
        subfolder: the component (``"transformer"``).
        model_class: default: the config's class in the installed library.
        mode: ``"preferred"`` (miss: load, serve, publish), ``"required"``
            (miss: raise, saying how to populate the store), ``"disabled"``
            (the library's own ``from_pretrained``; no socket, no hashing).
        dtype: runtime dtype; the library's fp32-kept modules stay fp32.
        device: DLO compute device (``"cuda:0"``, ``"cpu"``); None keeps the
            model resident on the CPU (no hooks).
        blocks: ``"auto"`` or module names (:func:`find_blocks`).
        resident_blocks: leading blocks kept on the device.
        fuse_qkv: the library's ``fuse_qkv_projections()`` as a final
            layout (its own key).
        socket: daemon runtime socket (default: the client's).
        progress: print publication progress to stderr.

    Returns:
        The :class:`LoadedModel`; close it (or use ``with``).

    Raises:
        NotFound, InvalidArgument: a bad directory, class or argument.
        FailedPrecondition: a checkpoint that does not fit the class, a
            missing library (naming the extra), a required miss.
        HwrError: a FAILED resolution.
    """
    t0 = time.perf_counter()
    mode = parse_mode(mode)
    files = model_files(os.fspath(model_dir), subfolder)
    cls = resolve_class(files, model_class)
    target = _dtype_of(dtype)
    seconds: dict[str, float] = {}
    if mode is Mode.DISABLED:
        return _disabled(files, cls, target, device, blocks, resident_blocks, fuse_qkv, t0)
    from dlo_runtime.options import OffloadOptions
    from dlo_runtime.transaction import ModelRecipe, StartupTransaction

    import hwr_client

    contract = PretrainedContract(files, cls, dtype=dtype, fuse_qkv=fuse_qkv, blocks=blocks)
    seconds["skeleton"] = round(time.perf_counter() - t0, 6)
    nblocks = len(contract.blocks(contract._spare)) if contract._spare is not None else 0
    if device is None:
        # Resident: the backend keeps every block on the CPU and streams none,
        # but still owns (and closes) the lease on a warm start.
        options = OffloadOptions(device="cpu", resident_blocks=nblocks)
    else:
        options = OffloadOptions(device=device, resident_blocks=resident_blocks)
    if nblocks == 0:
        raise InvalidArgument(f"{contract.name}: no blocks found to stream; pass blocks=[...] module names")
    client = hwr_client.connect(socket)
    pending: list[bool] = []
    try:
        t = time.perf_counter()
        identity = contract.identity(files.directory, client=client)
        seconds["identity"] = round(time.perf_counter() - t, 6)
        recipe = ModelRecipe(
            build_skeleton=contract.build_skeleton,
            load_canonical=lambda skel, copts: contract.canonical_load(skel, mmap=copts.checkpoint_mmap),
            select_blocks=contract.blocks,
            finalize=contract.finalize,
            publish_after_load=lambda m: pending.append(True),
        )
        t = time.perf_counter()
        result = StartupTransaction(mode, recipe, lambda: client.resolve(identity, mode=mode), options).run()
        seconds["start"] = round(time.perf_counter() - t, 6)
    except BaseException:
        client.close()
        raise
    model, backend = result.model, result.backend
    report = PretrainedReport(result.outcome.value, identity.key, contract.name, contract.library_version,
                        trail=[f"{s.what}: {s.note}" if s.note else s.what for s in result.trail])
    report.producer_calls = contract.counters.producer_calls
    report.checkpoint_bytes_read = contract.counters.checkpoint_bytes_read
    report.bytes_materialized = contract.counters.bytes_materialized
    if result.outcome is Outcome.LOCAL_HIT:
        # Independent of the counters: every CPU tensor must lie in the lease's mapping.
        report.bytes_materialized += private_bytes(model, backend.lease.regions())
    streamed = contract.blocks(model)[options.resident_blocks:]
    _block_report(model, streamed, report)
    loaded = LoadedModel(model, report, backend=backend, client=client, contract=contract)
    if pending:
        t = time.perf_counter()
        tensors = {s.name: s.tensor.detach() for s in tensor_slots(model).slots}
        rep = client.publish_after_load(identity, tensors, blocks=publish_groups(model, contract.blocks(model)),
                                        progress=_progress_printer(f"hwr: publishing {contract.name}")
                                        if progress else None)
        del tensors
        report.publish = dataclasses.asdict(rep)
        seconds["publish"] = round(time.perf_counter() - t, 6)
    seconds["total"] = round(time.perf_counter() - t0, 6)
    report.seconds = seconds
    log.info("from_pretrained %s: %s in %.3fs (materialized %d bytes, %d producer calls)", contract.name,
             report.outcome, seconds["total"], report.bytes_materialized, report.producer_calls)
    return loaded


def _disabled(files: ModelFiles, cls: Any, dtype: torch.dtype, device: Any, blocks: Any, resident_blocks: int,
              fuse_qkv: bool, t0: float) -> LoadedModel:
    """``mode="disabled"``: the library's own load; no client, no identity."""
    model = _library_load(files, cls, dtype)
    if fuse_qkv:
        with torch.no_grad():
            model.fuse_qkv_projections()
    model.eval()
    model.requires_grad_(False)
    lib = import_library(files.library)
    report = PretrainedReport(Outcome.DISABLED.value, "", f"{files.library}:{cls.__name__}", str(lib.__version__))
    backend = None
    found = find_blocks(model, blocks)
    if device is not None and found:
        from dlo_runtime.backend import enable_layerwise_offload

        backend = enable_layerwise_offload(model, found, device=device, resident_blocks=resident_blocks)
        found = found[resident_blocks:]
    _block_report(model, found if device is not None else [], report)
    report.seconds = {"total": round(time.perf_counter() - t0, 6)}
    return LoadedModel(model, report, backend=backend)


__all__ = ["PretrainedReport", "LoadedModel", "ModelFiles", "PretrainedContract", "check_loaded", "find_blocks",
           "from_pretrained", "model_files", "parameters_on_meta", "publish_groups", "resolve_class"]
