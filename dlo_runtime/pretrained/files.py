"""What a model directory holds, and the library and class it names.

:func:`model_files` reads ``config.json`` and the shard index only (no
weight byte) and picks the weight files the library's own
``from_pretrained`` would read for ``variant=`` and ``use_safetensors=``
(:func:`_weight_files`); :func:`resolve_class` imports the library lazily
and names the extra to install when it is missing.

The file rules, for a local directory, as both libraries apply them
(diffusers 0.42 ``ModelMixin.from_pretrained``, transformers 5
``_get_resolved_checkpoint_files``); ``<v>`` is the variant inserted before
the last extension (``model.fp16.safetensors``,
``model.safetensors.index.fp16.json``):

- transformers: ``model.<v>.safetensors``, then ``model.safetensors.index.<v>.json``
  (unless ``use_safetensors=False``), then ``pytorch_model.<v>.bin``, then
  ``pytorch_model.bin.index.<v>.json`` (unless ``use_safetensors=True``);
  a config's ``transformers_weights`` names the file outright.
- diffusers: the index first (``diffusion_pytorch_model.safetensors.index.<v>.json``,
  or the ``.bin`` index with ``use_safetensors=False``), then the single
  file ``diffusion_pytorch_model.<v>.safetensors``, and a single ``.bin``
  only when ``use_safetensors`` was not given (diffusers' ``allow_pickle``)
  or is False. A sharded ``.bin`` is read only with ``use_safetensors=False``.

Where the library would fail, so does this (NotFound naming the names
tried). diffusers' deprecated variant index name (variant before
``.index``) is not followed: :attr:`ModelFiles.unsupported` says so and the
start falls back to the library (:mod:`dlo_runtime.pretrained.eligibility`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import json
import os
from typing import Any

from torch import nn

from dlo_runtime.pretrained.hub import missing_directory
from hwr_client.core.errors import FailedPrecondition, InvalidArgument, NotFound

#: Libraries a directory can belong to, with the weight file stem each writes.
WEIGHT_STEMS = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}

#: Extra to install per library (named in the error when it is missing).
EXTRAS = {"diffusers": "diffusers", "transformers": "transformers"}


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """The files of one model directory.

    Attributes:
        directory: the model's own directory (``model_dir/subfolder``).
        library: ``"diffusers"`` or ``"transformers"``.
        class_name: ``_class_name`` / ``architectures[0]`` of the config.
        config_path: its ``config.json``.
        weights: its weight files (safetensors or ``.bin``), sorted.
        config: the parsed config.
        format: ``"safetensors"`` or ``"bin"`` (``torch.load`` pickles).
        sharded: the weights came from an index file.
        variant: the ``variant=`` asked for (None: none).
        use_safetensors: the ``use_safetensors=`` asked for (None: the
            library's default).
        unsupported: why HWR does not follow this directory's layout ("":
            it does); the start then loads with the library.
    """

    directory: str
    library: str
    class_name: str
    config_path: str
    weights: tuple[str, ...]
    config: dict[str, Any]
    format: str = "safetensors"
    sharded: bool = False
    variant: str | None = None
    use_safetensors: bool | None = None
    unsupported: str = ""


def model_files(model_dir: str, subfolder: str | None = None, *, variant: str | None = None,
                use_safetensors: bool | None = None) -> ModelFiles:
    """Reads what ``model_dir`` (or its ``subfolder``) holds; touches no weight.

    Args:
        variant: the weight variant (``"fp16"``), as the library's ``variant=``.
        use_safetensors: as the library's ``use_safetensors=``: True reads
            only safetensors, False only ``.bin``, None prefers safetensors.

    Raises:
        NotFound: no such directory (a hub id: naming its local snapshot,
            :mod:`dlo_runtime.pretrained.hub`), no ``config.json`` in it, or
            none of the weight files the library would read (naming them).
        InvalidArgument: a config naming no class, a malformed index, or a
            bad ``variant``.
    """
    directory = os.path.join(model_dir, subfolder) if subfolder else model_dir
    if not os.path.isdir(model_dir):
        # A hub id the library would download: say so, and name its local snapshot.
        raise missing_directory(model_dir, "model directory")
    if not os.path.isdir(directory):
        raise NotFound(f"model directory {directory}: no such directory")
    if variant is not None and (not isinstance(variant, str) or not variant or "/" in variant):
        raise InvalidArgument(f"variant={variant!r}: expected a non-empty name such as 'fp16'")
    if use_safetensors not in (None, True, False):
        raise InvalidArgument(f"use_safetensors={use_safetensors!r}: expected True, False or None")
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
    choose = _diffusers_weights if library == "diffusers" else _transformers_weights
    name, sharded, unsupported = choose(directory, config, variant, use_safetensors)
    path = os.path.join(directory, name)
    weights = _shards(path, directory) if sharded else (path,)
    fmt = "safetensors" if weights[0].endswith(".safetensors") else "bin"
    return ModelFiles(directory, library, class_name, config_path, weights, config, fmt, sharded, variant,
                      use_safetensors, unsupported)


def add_variant(name: str, variant: str | None) -> str:
    """``model.safetensors`` -> ``model.fp16.safetensors`` (both libraries'
    rule: the variant goes before the last extension)."""
    if variant is None:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def _first(directory: str, candidates: list[tuple[str, bool]]) -> tuple[str, bool] | None:
    for name, sharded in candidates:
        if os.path.isfile(os.path.join(directory, name)):
            return name, sharded
    return None


def _not_found(directory: str, tried: list[tuple[str, bool]]) -> NotFound:
    others = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".safetensors", ".json"))
                    and n != "config.json")
    return NotFound(f"model directory {directory}: no weights; expected "
                    + " or ".join(n for n, _ in tried)
                    + (f" (found {others[:4]}; pass variant= or use_safetensors= to pick them)" if others else ""))


def _transformers_weights(directory: str, config: dict[str, Any], variant: str | None,
                          use_safetensors: bool | None) -> tuple[str, bool, str]:
    explicit = config.get("transformers_weights")
    if isinstance(explicit, str):
        if not explicit.endswith((".safetensors", ".safetensors.index.json")) or os.path.isabs(explicit) \
                or ".." in explicit.split("/"):
            raise InvalidArgument(f"{directory}/config.json: transformers_weights={explicit!r}; expected a "
                                  "safetensors file or index inside the model directory")
        if not os.path.isfile(os.path.join(directory, explicit)):
            raise NotFound(f"model directory {directory}: config.json names transformers_weights={explicit!r}, "
                           "which is not there")
        return explicit, explicit.endswith(".index.json"), ""
    tried: list[tuple[str, bool]] = []
    if use_safetensors is not False:
        tried += [(add_variant("model.safetensors", variant), False),
                  (add_variant("model.safetensors.index.json", variant), True)]
    if not use_safetensors:
        tried += [(add_variant("pytorch_model.bin", variant), False),
                  (add_variant("pytorch_model.bin.index.json", variant), True)]
    found = _first(directory, tried)
    if found is None:
        raise _not_found(directory, tried)
    return found[0], found[1], ""


def _diffusers_weights(directory: str, config: dict[str, Any], variant: str | None,
                       use_safetensors: bool | None) -> tuple[str, bool, str]:
    # diffusers: use_safetensors=None means True, but then a single .bin
    # is allowed (its allow_pickle); only an explicit False reads .bin indexes.
    safetensors, allow_pickle = use_safetensors is not False, use_safetensors is None
    stem = "diffusion_pytorch_model"
    index = add_variant(f"{stem}.safetensors.index.json" if safetensors else f"{stem}.bin.index.json", variant)
    tried = [(index, True)]
    tried += [(add_variant(f"{stem}.safetensors", variant), False)] if safetensors else []
    tried += [(add_variant(f"{stem}.bin", variant), False)] if allow_pickle or not safetensors else []
    found = _first(directory, tried)
    unsupported = ""
    if variant is not None and not os.path.isfile(os.path.join(directory, index)):
        parts = (f"{stem}.safetensors.index.json" if safetensors else f"{stem}.bin.index.json").split(".")
        legacy = ".".join(parts[:2] + [variant] + parts[2:])
        if os.path.isfile(os.path.join(directory, legacy)):
            unsupported = (f"{legacy}: diffusers' deprecated sharded-variant index name (the library resolves it "
                           "from the full path); HWR reads only the current layout")
            found = found or (legacy, True)
    if found is None:
        raise _not_found(directory, tried)
    return found[0], found[1], unsupported


def _shards(index: str, directory: str) -> tuple[str, ...]:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        shards = sorted({os.path.join(directory, str(v)) for v in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidArgument(f"{index}: not a weight index ({exc}); expected {{'weight_map': ...}}") from None
    if not shards:
        raise InvalidArgument(f"{index}: an empty weight_map; expected at least one shard")
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        raise NotFound(f"{index}: names shard {os.path.basename(missing[0])}, which is not in {directory}")
    return tuple(shards)


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


@functools.lru_cache(maxsize=None)
def hwr_version() -> str:
    """HWR's version (the installed distribution's, else the source tree's).
    Cached: importlib.metadata scans every sys.path entry (2-6 ms), and the
    installed version does not change while the process runs."""
    try:
        return importlib.metadata.version("hwr")
    except importlib.metadata.PackageNotFoundError:
        return "source"
