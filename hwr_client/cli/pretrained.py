"""``hwr prewarm --model DIR``: publish a diffusers / transformers model's
final-layout artifact without a worker, so ``mode="required"`` starts warm.

The flags mirror :func:`dlo_runtime.from_pretrained` (``--subfolder``,
``--dtype``, ``--fuse-qkv``, ``--blocks``): the same contract gives the same
key and the same block layout the worker's DLO backend streams. torch and
the model library are imported by the command, never by the parser.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from hwr_client.cli.common import client_from
from hwr_client.core.errors import NotFound


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The ``--model`` flags of ``hwr prewarm``."""
    parser.add_argument("--model", help="a diffusers / transformers model directory (or pipeline dir with --subfolder)")
    parser.add_argument("--subfolder", help="pipeline component, e.g. transformer")
    parser.add_argument("--dtype", default="bfloat16", help="runtime dtype (default bfloat16)")
    parser.add_argument("--fuse-qkv", action="store_true", help="the library's fuse_qkv_projections() as the layout")
    parser.add_argument("--blocks", help="streamed module names, comma-separated (default: found automatically)")


def prewarm_model(args: argparse.Namespace) -> dict[str, Any]:
    """Publishes ``--model``'s artifact (or finds it published); returns the
    result row ``hwr prewarm`` prints."""
    from dlo_runtime.pretrained import PretrainedContract, model_files, publish_groups, resolve_class
    from dlo_runtime.restore import tensor_slots

    files = model_files(args.model, args.subfolder)
    blocks = [b.strip() for b in args.blocks.split(",") if b.strip()] if args.blocks else "auto"
    contract = PretrainedContract(files, resolve_class(files), dtype=args.dtype, fuse_qkv=args.fuse_qkv,
                                  blocks=blocks)
    with client_from(args) as client:
        identity = contract.identity(files.directory, client=client)
        try:
            manifest = client.lookup(identity.key)
            return {"key": identity.key, "outcome": "already_published", "bytes": manifest.size_bytes,
                    "seconds": 0.0, "contract": contract.name}
        except NotFound:
            pass
        t0 = time.perf_counter()
        model = contract.canonical_load(contract.build_skeleton())
        tensors = {s.name: s.tensor.detach() for s in tensor_slots(model).slots}
        report = client.publish(identity, tensors, blocks=publish_groups(model, contract.blocks(model)))
        del tensors, model
    return {"key": report.key, "outcome": "already_published" if report.already_published else "committed",
            "bytes": report.manifest.size_bytes, "bytes_written": report.bytes_written,
            "seconds": round(time.perf_counter() - t0, 3), "contract": contract.name}
