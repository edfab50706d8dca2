"""What a model directory holds, and the library and class it names.

:func:`model_files` reads ``config.json`` and the shard index only (no
weight byte); :func:`resolve_class` imports the library lazily and names the
extra to install when it is missing.
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


@functools.lru_cache(maxsize=None)
def hwr_version() -> str:
    """HWR's version (the installed distribution's, else the source tree's).
    Cached: importlib.metadata scans every sys.path entry (2-6 ms), and the
    installed version does not change while the process runs."""
    try:
        return importlib.metadata.version("hwr")
    except importlib.metadata.PackageNotFoundError:
        return "source"
