"""What the bench scripts share: where results go, the "command" field,
the temporary work directory and the JSON-writing tail.

Only the parts that are the same everywhere live here; each script keeps its
own options, run() and table. Import it as ``bench.common`` (the scripts put
the repository root on ``sys.path`` first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")


def result_path(name: str) -> str:
    """The default ``--out`` of a bench: ``bench/results/<name>``."""
    return os.path.join(RESULTS, name)


def result_command(script: str, argv: list[str] | None) -> str:
    """How this run was started (``python bench/x.py ARGS``), recorded in the
    JSON so a figure can be reproduced from its file alone."""
    return " ".join([os.path.basename(sys.executable), script, *(argv or sys.argv[1:])])


def save_result(doc: Any, out: str, *, indent: int = 2, sort_keys: bool = False, default: Any = None,
                quiet: bool = False) -> str:
    """Writes ``doc`` as JSON to ``out`` (its directory created) and says so
    unless ``quiet``; returns ``out``. ``indent``, ``sort_keys`` and
    ``default`` are json.dump's, so each bench keeps its file's format."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=indent, sort_keys=sort_keys, default=default)
    if not quiet:
        print(f"wrote {out}")
    return out


@contextlib.contextmanager
def bench_dir(name: str, parent: str | None = None) -> Iterator[str]:
    """A fresh ``hwr-bench-<name>-*`` work directory under ``parent`` (the
    system temp dir when None), removed with everything in it at the end,
    also when the run fails (a 2 GiB store left in /var/tmp would fill the
    disk a few runs later)."""
    directory = tempfile.mkdtemp(prefix=f"hwr-bench-{name}-", dir=parent)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def add_artifact_args(parser: argparse.ArgumentParser, name: str, quick: str, where: str) -> None:
    """The options of the benches that build one synthetic artifact
    (bench/publish.py, bench/pull.py): --size, --blocks, --quick, --dir and
    --out (default bench/results/<name>.json). ``quick`` and ``where`` are
    the help texts of --quick and --dir."""
    parser.add_argument("--size", default="2GiB", help="artifact payload size (default 2GiB)")
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--dir", help=f"where {where} go (default: a temp dir under /var/tmp)")
    parser.add_argument("--out", default=result_path(f"{name}.json"))


def add_daemon_args(parser: argparse.ArgumentParser, name: str, where: str) -> None:
    """The options of the benches that start their own daemon unless given
    one: --socket, --dir (help ``where``) and --out (default
    bench/results/<name>.json)."""
    parser.add_argument("--socket", help="use a running daemon (default: start one on a temp root)")
    parser.add_argument("--dir", default=None, help=where)
    parser.add_argument("--out", default=result_path(f"{name}.json"))


def private_bytes_of(model: Any) -> int:
    """Bytes of the library model's tensors that are not views of a file
    mapping (what it materialized): storages outside every file-backed
    range of ``/proc/self/maps``."""
    with open("/proc/self/maps") as f:
        files = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f
                 if len(line.split()) >= 6 and line.split()[5].startswith("/")]
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += 0 if any(lo <= st.data_ptr() < hi for lo, hi in files) else st.nbytes()
    return total
