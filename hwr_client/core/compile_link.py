"""Compile artifacts as the store sees them (DESIGN §18): which artifact is
one, and what it belongs to.

A compile artifact holds what lets a fresh process skip ``torch.compile``'s
work for one model (:mod:`dlo_runtime.compile` builds, publishes and
restores it). It is an ordinary artifact with its own contract,
:data:`COMPILE_CONTRACT`, so the store, GC, verify, push and pull treat it
like weights; this module reads the link to its model out of its
**identity**::

    {"contract": {"name": "torch-compile", "version": 1},
     "sources": [{"name": "weights", "content_id": "sha256:<weights identity key>"}],
                 # or, where no weight artifact exists: {"name": "config.json", ...}
     "extra": {"model": {"name": "diffusers:FluxTransformer2DModel", ...},
               "device": {"kind": "cuda", "capability": "9.0", ...}, ...}, ...}

Why the identity and not the annotations: the key covers the identity, so
nothing can relabel a compile artifact as another model's without changing
its name; annotations (measured seconds, file counts) are the publisher's
claims and are shown as such.

Torch-free and client-free: ``hwr ls`` and the daemon's push and pull import it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping

from hwr_client.core.identity import Identity

#: The contract name of every compile artifact.
COMPILE_CONTRACT = "torch-compile"
#: Its version: the payload format (tensor names, annotations) of
#: :mod:`dlo_runtime.compile.payload`; another version is another key.
COMPILE_CONTRACT_VERSION = 1
#: The source name that links a compile artifact to a weight artifact.
WEIGHTS_SOURCE = "weights"
#: The source name of a compile artifact keyed by its model's config.
CONFIG_SOURCE = "config.json"
#: The key inside an annotations object's ``data`` that holds the
#: publisher's figures (:func:`figures_of`).
ANNOTATION_KEY = "hwr.compile"

_DEVICE_PART = re.compile(r"[A-Za-z0-9_.+-]{1,64}\Z")


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """What a compile artifact was compiled for, read from its identity.

    Attributes:
        weights_key: the identity key of the weight artifact it belongs to;
            "" when it is keyed by its model's class and config instead.
        config_id: ``sha256:<hex>`` of the model's ``config.json`` when no
            weight artifact was named, else "".
        model: ``<library>:<Class>`` (or a module's qualified class name).
        device: ``kind`` or ``kind:capability`` (``cpu``, ``cuda:9.0``):
            what :func:`device_matches` compares.
    """

    weights_key: str
    config_id: str
    model: str
    device: str

    def describe(self) -> str:
        """One line for ``hwr ls`` / ``inspect``."""
        owner = f"weights {self.weights_key[:16]}" if self.weights_key else f"config {self.config_id[7:23]}"
        return f"{owner} ({self.model}, {self.device})"


def is_compile(identity: Identity) -> bool:
    """True when ``identity`` is a compile artifact's."""
    return identity.contract_name == COMPILE_CONTRACT


def target_of(identity: Identity) -> CompileTarget | None:
    """The target of a compile artifact's identity; None for any other
    artifact, or one whose identity lacks the fields (an older or foreign
    producer: shown as a plain artifact, never guessed at)."""
    if not is_compile(identity):
        return None
    doc = identity.document
    sources = {s["name"]: s["content_id"] for s in doc["sources"]}
    extra = doc["extra"]
    model = extra.get("model")
    device = extra.get("device")
    if not isinstance(model, dict) or not isinstance(device, dict) or not isinstance(model.get("name"), str):
        return None
    weights = sources.get(WEIGHTS_SOURCE, "")
    config = sources.get(CONFIG_SOURCE, "")
    if not (weights or config):
        return None
    return CompileTarget(weights_key=weights[len("sha256:"):] if weights else "", config_id="" if weights else config,
                         model=model["name"], device=device_label(device))


def device_label(device: Mapping[str, Any]) -> str:
    """``kind`` or ``kind:capability`` of a compile identity's device object;
    ``unknown`` for parts that are not short plain words."""
    kind = device.get("kind")
    cap = device.get("capability")
    kind = kind if isinstance(kind, str) and _DEVICE_PART.match(kind) else "unknown"
    return f"{kind}:{cap}" if isinstance(cap, str) and cap and _DEVICE_PART.match(cap) else kind


def device_matches(label: str, patterns: Iterable[str]) -> bool:
    """True when a device label (:func:`device_label`) is selected by
    ``patterns``: ``"*"`` (every device), a kind (``"cuda"``: every
    capability) or an exact ``kind:capability``."""
    kind = label.split(":", 1)[0]
    return any(p == "*" or p == label or p == kind for p in patterns)


def figures_of(annotations: Mapping[str, Any] | None) -> dict[str, Any]:
    """The publisher's figures of a compile artifact
    (``data["hwr.compile"]``: ``first_output_ms``, ``files``, ...), or {}.
    Claims of its publisher, not part of the key: for display and for the
    seconds-saved estimate only."""
    if not annotations:
        return {}
    data = annotations.get("data")
    figures = data.get(ANNOTATION_KEY) if isinstance(data, dict) else None
    return dict(figures) if isinstance(figures, dict) else {}


__all__ = ["ANNOTATION_KEY", "COMPILE_CONTRACT", "COMPILE_CONTRACT_VERSION", "CONFIG_SOURCE", "CompileTarget",
           "WEIGHTS_SOURCE", "device_label", "device_matches", "figures_of", "is_compile", "target_of"]
