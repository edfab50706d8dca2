"""A worker process for the compile-artifact tests: a tiny real transformers
model through ``dlo_runtime.from_pretrained(..., compile=...)``, its first
compiled output, and a JSON line on stdout saying what happened.

Run as ``python -m tests.support.compile_worker MODEL_DIR SOCKET [options]``.
``--cache-dir`` is set as ``TORCHINDUCTOR_CACHE_DIR`` before torch loads (a
user folder); without it HWR makes the process a private one. ``--probe``
loads once and asks for the changed keys (options, shapes, toolchain) in
required mode, then the unchanged one: each changed key must be a miss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

WIDTH, SEQ = 2, 7


def _inputs(torch: Any, batch: int) -> dict[str, Any]:
    return {"input_ids": torch.randint(0, 128, (batch, SEQ), generator=torch.Generator().manual_seed(4))}


def _sha(out: Any) -> str:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return hashlib.sha256(logits.detach().contiguous().numpy().tobytes()).hexdigest()


def _folder_files(path: str) -> list[str]:
    out = []
    for dirpath, dirnames, files in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        if rel.split(os.sep)[0] in ("locks",):
            continue
        out += [os.path.normpath(os.path.join(rel, f)) for f in files if not f.startswith(".")]
    return sorted(out)


def _probe(args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    """Each changed key in required mode must raise NotFound before any
    compile; the unchanged key then hits."""
    import dlo_runtime
    from dlo_runtime.compile import ModelSource, compile_model
    from dlo_runtime.compile.key import toolchain
    from hwr_client.core.errors import HwrError

    loaded = dlo_runtime.from_pretrained(args.model_dir, mode="preferred", dtype="float32", socket=args.socket)
    source = ModelSource(name=loaded.report.contract, dtype="float32", weights_key=loaded.key,
                         library_version=loaded.report.library_version)
    newer = {**toolchain(), "torch": "2.99.0"}
    cases = {"option": ({"dynamic": False}, WIDTH, None), "shape": (True, WIDTH + 1, None),
             "torch_version": (True, WIDTH, newer), "unchanged": (True, WIDTH, None)}
    result: dict[str, Any] = {}
    for name, (compile_arg, batch, tools) in cases.items():
        report = compile_model(loaded.model, compile_arg, source=source, mode="required", socket=args.socket,
                               toolchain=tools)
        try:
            with torch.no_grad():
                out = loaded.model(**_inputs(torch, batch))
            result[name] = {"raised": "", "report": report.to_dict(), "sha": _sha(out)}
        except HwrError as exc:
            result[name] = {"raised": f"{type(exc).__name__}: {exc}", "report": report.to_dict()}
    loaded.close()
    return {"probe": result}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("socket")
    p.add_argument("--mode", default="preferred")
    p.add_argument("--compile", default="true", help="JSON: true or a dict of torch.compile arguments")
    p.add_argument("--cache-dir", default="")
    p.add_argument("--batch", type=int, default=WIDTH)
    p.add_argument("--probe", action="store_true")
    args = p.parse_args()
    if args.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir
    t0 = time.perf_counter()
    import torch

    if args.probe:
        print(json.dumps(_probe(args, torch)), flush=True)
        return 0
    import dlo_runtime
    from hwr_client.core.errors import HwrError
    from torch._dynamo.utils import counters

    loaded = dlo_runtime.from_pretrained(args.model_dir, mode=args.mode, dtype="float32", socket=args.socket,
                                         compile=json.loads(args.compile))
    report = loaded.report.compile
    t1 = time.perf_counter()
    try:
        with torch.no_grad():
            out = loaded.model(**_inputs(torch, args.batch))
    except HwrError as exc:
        print(json.dumps({"raised": f"{type(exc).__name__}: {exc}", "compile": report.to_dict()}), flush=True)
        return 3
    t2 = time.perf_counter()
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    files = _folder_files(folder) if folder else []
    report.wait_published(300)
    with torch.no_grad():
        second = loaded.model(**_inputs(torch, args.batch))  # later calls go straight to torch
    print(json.dumps({"raised": "", "compile": report.to_dict(), "outcome": loaded.report.outcome,
                      "sha": _sha(out), "sha_second": _sha(second), "inductor": dict(counters["inductor"]),
                      "aot": dict(counters["aot_autograd"]), "folder": folder, "folder_files": files,
                      "seconds": {"load": t1 - t0, "first_call": t2 - t1}}), flush=True)
    loaded.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
