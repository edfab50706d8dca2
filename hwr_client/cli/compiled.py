"""What ``hwr ls`` and ``hwr inspect`` say about compile artifacts: the
model (weight artifact, or class and config) and device each one is for,
read from its identity (:mod:`hwr_client.core.compile_link`), and the
figures its publisher recorded. Torch-free, like every store command."""

from __future__ import annotations

import dataclasses
from typing import Any

from hwr_client.core._proto import hwr_pb2 as pb
from hwr_client.core.compile_link import COMPILE_CONTRACT, figures_of, target_of
from hwr_client.core.errors import HwrError
from hwr_client.core.manifest import Manifest


def compile_info(manifest_json: str) -> dict[str, Any] | None:
    """``{"belongs_to": {...}, "describe": "...", "figures": {...}}`` of a
    compile artifact's manifest text; None for any other artifact."""
    if not manifest_json:
        return None
    try:
        manifest = Manifest.from_json(manifest_json)
    except HwrError:
        return None
    target = target_of(manifest.identity)
    if target is None:
        return None
    return {"belongs_to": dataclasses.asdict(target), "describe": target.describe(),
            "figures": figures_of(manifest.annotations)}


def belongs_to(client: Any, rows: list[dict[str, Any]]) -> None:
    """Adds ``belongs_to`` (None for weights) to ``hwr ls`` rows: one
    InspectArtifact per compile artifact (there are few, and ListArtifacts
    carries no manifests)."""
    for row in rows:
        row["belongs_to"] = None
        if row["contract_name"] != COMPILE_CONTRACT:
            continue
        try:
            reply = client.call(client.reader.InspectArtifact, pb.InspectArtifactRequest(key=row["key"]))
        except HwrError:
            continue  # deleted meanwhile: listed without it
        info = compile_info(reply.manifest_json)
        row["belongs_to"] = info["belongs_to"] if info else None
        row["belongs_to_text"] = info["describe"] if info else ""


__all__ = ["belongs_to", "compile_info"]
