"""Compiled-kernel caches as node artifacts beside the weights (DESIGN §18).

``from_pretrained(..., compile=True)`` (or a dict of ``torch.compile``
arguments, also on ``lazy_pipeline``) compiles the model in place; at its
first call a compile artifact for exactly this model, toolchain, device,
options and input shapes is leased from the HWR store and restored into
the process's own inductor cache folder before torch compiles, so torch
finds every entry warm. Without one, torch compiles and, after the first
output, the cache folder is published in the background for the next
start (and, through push and pull, for other nodes: the artifact is a
referrer of its weight artifact).

Modules: :mod:`.settings` (the switch), :mod:`.key` (the identity),
:mod:`.folder` (the worker's own cache folder: choose, capture, restore),
:mod:`.payload` (files as tensors; what a restore checks and trusts),
:mod:`.hook` (the first call's sequence), :mod:`.background` (where
publication runs: a seam), :mod:`.records` (source and report).
"""

from __future__ import annotations

import hashlib
from typing import Any

from hwr_client.core.errors import InvalidArgument
from hwr_client.resolve import Mode

from dlo_runtime.compile.background import Publisher, ThreadPublisher
from dlo_runtime.compile.hook import compile_model
from dlo_runtime.compile.records import BYPASSED, HIT, MISS, PENDING, CompileReport, ModelSource
from dlo_runtime.compile.settings import CompileSettings, parse_compile, per_component


def settings_for_pretrained(compile: Any, *, device: Any) -> CompileSettings | None:
    """``from_pretrained``'s ``compile=``, checked before anything loads.

    Raises:
        InvalidArgument: a bad value, or ``device=`` given: layerwise
            offload streams blocks through hooks that ``torch.compile``
            would trace into the graph.
    """
    settings = parse_compile(compile)
    if settings is not None and device is not None:
        raise InvalidArgument(f"compile= with device={device!r}: layerwise offload streams blocks through hooks "
                              "that torch.compile would trace; load resident (device=None), move the model "
                              "yourself, or drop compile=")
    return settings


def attach_to_pretrained(loaded: Any, settings: CompileSettings | None, *, config_path: str, dtype: str,
                         mode: Mode, socket: str | None) -> None:
    """Compiles a :class:`~dlo_runtime.pretrained.LoadedModel`'s model in
    place and puts the compile report at ``loaded.report.compile``: the
    artifact belongs to the weight artifact when the start went through
    HWR (``report.key``), else to the class and ``config.json``."""
    if settings is None:
        return
    report = loaded.report
    # loaded.key, not report.key: a cold start's identity may still be
    # completing (its sources hashed for the background publication); the
    # compile artifact's key needs it, so this waits for it.
    weights_key = loaded.key
    config_sha = ""
    if not weights_key:
        with open(config_path, "rb") as f:
            config_sha = hashlib.sha256(f.read()).hexdigest()
    source = ModelSource(name=report.contract, dtype=dtype, weights_key=weights_key, config_sha256=config_sha,
                         library_version=report.library_version)
    report.compile = compile_model(loaded.model, settings, source=source, mode=mode, socket=socket)


__all__ = ["BYPASSED", "CompileReport", "CompileSettings", "HIT", "MISS", "ModelSource", "PENDING", "Publisher",
           "ThreadPublisher", "attach_to_pretrained", "compile_model", "parse_compile", "per_component",
           "settings_for_pretrained"]
