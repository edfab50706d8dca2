"""The identity of a compile artifact: everything that decides whether
torch's cache entries from one process serve another.

Its parts (``hwr_client.core.compile_link`` reads the link back):

- **model** (:class:`~dlo_runtime.compile.records.ModelSource`): the weight
  artifact's key as the one source (the artifact belongs to it), or the
  model's ``config.json`` digest when there is no weight artifact; the
  class and library version in ``extra.model``.
- **toolchain**: torch, triton and Python versions, the C++ compiler's
  ``--version`` line, and where torch and Python's headers are installed
  (inductor's C++ kernel keys hash the compile command, include paths and
  all: a node with torch elsewhere recompiles every CPU kernel, so it gets
  its own artifact instead of one it cannot use).
- **device**: kind and capability (``cpu`` with ATen's CPU capability, e.g.
  ``avx512``; ``cuda`` with ``major.minor``, the device name and CUDA/HIP
  version).
- **options**: the ``compile=`` settings, plus a digest of inductor's whole
  portable config (a global ``torch._inductor.config`` change is a change).
- **inputs**: the first call's arguments as dynamo guards on them: every
  tensor's dtype, device and shape (``dynamic=True``: sizes other than 0
  and 1 become ``"s"``), Python scalars by value, grad mode, train/eval
  and autocast state.

Any difference is another key: a miss that compiles and publishes its own,
never a wrong kernel. Torch's own cache keys stay the last word on what a
restored entry may serve; HWR's key chooses which entries travel.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import sysconfig
from typing import Any, Mapping

import torch
from torch import nn

from hwr_client.core.compile_link import COMPILE_CONTRACT, COMPILE_CONTRACT_VERSION, CONFIG_SOURCE, WEIGHTS_SOURCE
from hwr_client.core.identity import Identity

from dlo_runtime.compile.records import ModelSource
from dlo_runtime.compile.settings import CompileSettings

#: Leaves of the input description (tensors, scalars) beyond which the rest
#: is summarized: a key must stay small, and such inputs are rare.
MAX_INPUT_LEAVES = 256
_MAX_DEPTH = 8
_LAYOUT = {"tp_rank": 0, "tp_size": 1, "sp_size": 1, "sp_backend": "none"}


@functools.cache
def _cxx() -> str:
    """Inductor's C++ compiler and its ``--version`` line (once per process)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        cxx = get_cpp_compiler()
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
        first = out.stdout.splitlines()[0].strip() if out.stdout else ""
        return f"{cxx}: {first}" if first else cxx
    except Exception as exc:  # noqa: BLE001 - no compiler is a toolchain too; inductor will say why
        return f"none ({type(exc).__name__})"


def toolchain() -> dict[str, str]:
    """The toolchain part of the key for this process."""
    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        triton_version = ""
    return {"torch": str(torch.__version__), "triton": triton_version, "python": platform.python_version(),
            "cxx": _cxx(), "torch_dir": os.path.dirname(torch.__file__),
            "python_include": sysconfig.get_paths().get("include", "")}


def device_of(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.device:
    """Where the model computes: its first parameter's (or buffer's) device,
    else the first tensor argument's, else the CPU."""
    for t in _first_tensors(model):
        return t.device
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _first_tensors(model: nn.Module) -> Any:
    yield from model.parameters()
    yield from model.buffers()


def device_document(device: torch.device) -> dict[str, str]:
    """The device part of the key."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        runtime = f"hip {torch.version.hip}" if torch.version.hip else f"cuda {torch.version.cuda}"
        return {"kind": "cuda", "capability": f"{major}.{minor}", "name": torch.cuda.get_device_name(index),
                "runtime": runtime}
    if device.type == "cpu":
        # ATen's own dispatch capability: cheap. Inductor's pick_vec_isa()
        # builds test programs (tens of seconds on a cold folder), which a
        # key computed before the restore must not pay.
        return {"kind": "cpu", "capability": torch.backends.cpu.get_cpu_capability().lower(),
                "name": platform.machine(), "runtime": ""}
    return {"kind": device.type, "capability": "", "name": "", "runtime": ""}


def inductor_config_digest() -> str:
    """SHA-256 of inductor's portable config (what torch's own FX-graph key
    reads): a global override outside ``compile=`` changes the key too.
    Values whose repr holds an address (a custom pass object) count by type."""
    try:
        import torch._inductor.config as inductor_config

        items = inductor_config.save_config_portable()
    except Exception as exc:  # noqa: BLE001 - an inductor without it: the version decides
        return f"unavailable ({type(exc).__name__})"
    text = "\n".join(f"{k}={_stable_repr(v)}" for k, v in sorted(items.items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _stable_repr(value: Any) -> str:
    text = repr(value)
    return f"<{type(value).__qualname__}>" if " at 0x" in text else text


def input_document(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], *,
                   dynamic: bool | None) -> dict[str, Any]:
    """The inputs part of the key: what dynamo guards on at the first call."""
    leaves: list[Any] = []
    _describe(list(args), "args", leaves, dynamic, 0)
    _describe(dict(kwargs), "kwargs", leaves, dynamic, 0)
    autocast = sorted(d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))
    return {"leaves": leaves, "grad": torch.is_grad_enabled(), "training": model.training, "autocast": autocast,
            "dynamic": dynamic}


def _describe(value: Any, path: str, out: list[Any], dynamic: bool | None, depth: int) -> None:
    if len(out) >= MAX_INPUT_LEAVES:
        if out[-1] != {"path": "...", "type": "more"}:
            out.append({"path": "...", "type": "more"})
        return
    if isinstance(value, torch.Tensor):
        shape = [d if (dynamic is not True or d in (0, 1)) else "s" for d in value.shape]
        out.append({"path": path, "dtype": str(value.dtype).removeprefix("torch."), "shape": shape,
                    "device": value.device.type, "requires_grad": value.requires_grad})
    elif value is None or isinstance(value, (bool, int, str)):
        out.append({"path": path, "value": value})
    elif isinstance(value, float):
        out.append({"path": path, "value": {"float": repr(value)}})
    elif isinstance(value, (list, tuple)) and depth < _MAX_DEPTH:
        for i, v in enumerate(value):
            _describe(v, f"{path}[{i}]", out, dynamic, depth + 1)
    elif isinstance(value, dict) and depth < _MAX_DEPTH and all(isinstance(k, str) for k in value):
        for k in sorted(value):
            _describe(value[k], f"{path}.{k}", out, dynamic, depth + 1)
    else:
        out.append({"path": path, "type": f"{type(value).__module__}.{type(value).__qualname__}"})


def compile_identity(source: ModelSource, settings: CompileSettings, *, tools: Mapping[str, str],
                     device: Mapping[str, str], inputs: Mapping[str, Any], inductor_config: str) -> Identity:
    """The compile artifact's identity (module doc)."""
    if source.weights_key:
        sources = [{"name": WEIGHTS_SOURCE, "content_id": "sha256:" + source.weights_key}]
    else:
        sources = [{"name": CONFIG_SOURCE, "content_id": "sha256:" + source.config_sha256}]
    from dlo_runtime.pretrained.files import hwr_version

    return Identity.from_dict({
        "contract": {"name": COMPILE_CONTRACT, "version": COMPILE_CONTRACT_VERSION},
        "sources": sources,
        "representation": {"dtype": source.dtype},
        "layout": dict(_LAYOUT),
        "producer": {"id": "hwr-compile", "version": hwr_version()},
        "extra": {"model": {"name": source.name, "library_version": source.library_version},
                  "toolchain": dict(tools), "device": dict(device), "options": settings.key_document(),
                  "inductor_config": inductor_config, "inputs": dict(inputs)},
    })


__all__ = ["MAX_INPUT_LEAVES", "compile_identity", "device_document", "device_of", "inductor_config_digest",
           "input_document", "toolchain"]
