"""A fresh worker process for the real-checkpoint tests: loads a model
directory through :func:`dlo_runtime.from_pretrained`, embeds two sentences
with the directory's own tokenizer, saves the last hidden state to
``--out`` and prints the report as one JSON line.

    python -m tests.support.embed_worker DIR --out FILE [--socket S] [--mode M] [--dtype D]
"""

from __future__ import annotations

import argparse
import json
import sys

SENTENCES = ["The cat sits on the mat.", "A host weight runtime maps final-layout weights."]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--out", required=True)
    p.add_argument("--socket")
    p.add_argument("--mode", default="preferred")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    batch = AutoTokenizer.from_pretrained(args.directory)(SENTENCES, padding=True, return_tensors="pt")
    import dlo_runtime

    with dlo_runtime.from_pretrained(args.directory, socket=args.socket, mode=args.mode, dtype=args.dtype,
                                     device="cpu", progress=False) as loaded:
        with torch.no_grad():
            out = loaded.model(**batch).last_hidden_state
        report = loaded.report.to_dict()
    torch.save(out, args.out)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
