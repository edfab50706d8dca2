"""Compile artifacts end to end, as users run them: real worker processes
(``python -m tests.support.compile_worker``: a tiny real LlamaForCausalLM
through ``dlo_runtime.from_pretrained(..., compile=True)``) against a real
daemon started with no options.

ONE cold inductor compile serves the module (about 1-2 minutes on 2
shared cores: unavoidable, hence ``slow``); every other worker restores
or probes, and each asserts counts and bytes, never seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from hwr_client.core.compile_link import COMPILE_CONTRACT  # noqa: E402
from tests.support.daemon import cleanup, make_daemon  # noqa: E402
from tests.support.oci_nodes import push  # noqa: E402
from tests.support.oci_registry import make_registry, remote_config  # noqa: E402
from tests.support.paths import REPO_DIR  # noqa: E402
from tests.support.real_models import save_model  # noqa: E402

pytestmark = [pytest.mark.slow]


def run_worker(model_dir: str, node, *args: str, rc: int = 0) -> dict:
    """One worker process; its JSON line. A private cache folder unless
    ``--cache-dir`` is given (TORCHINDUCTOR_CACHE_DIR removed from its env)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = REPO_DIR + os.pathsep + env.get("PYTHONPATH", "")
    # One compile thread: no worker pool to start on 2 shared cores (same for every worker: the key reads it).
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "tests.support.compile_worker", model_dir, node.socket, *args],
                          capture_output=True, text=True, env=env, cwd=REPO_DIR, timeout=900)
    assert proc.returncode == rc, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def artifacts(node) -> list[dict]:
    out = node.cli("ls", "--json", check=True)
    return json.loads(out.stdout)


def compile_rows(node) -> list[dict]:
    return [r for r in artifacts(node) if r["contract_name"] == COMPILE_CONTRACT]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model("llama", str(tmp_path_factory.mktemp("models") / "llama"))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    d = make_daemon(tmp_path_factory.mktemp("node")).start()
    yield d
    cleanup(d)


@pytest.fixture(scope="module")
def cold(model_dir, node):
    """The one cold compile: a fresh process, empty private cache folder."""
    return run_worker(model_dir, node)


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("user-cache")
    os.chmod(path, 0o700)
    return str(path)


@pytest.fixture(scope="module")
def warm(model_dir, node, cold, user_folder):
    """A fresh process with an empty cache folder of the user's own."""
    return run_worker(model_dir, node, "--cache-dir", user_folder)


def test_cold_compile_publishes_after_the_first_output(cold, node):
    rep = cold["compile"]
    assert cold["outcome"] == "CANONICAL_FALLBACK"  # the weights were cold too
    assert rep["status"] == "miss" and "not in the store" in rep["reason"]
    assert rep["publish"] == "published", rep
    assert rep["files"] > 0 and rep["bytes"] > 0
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 1  # torch really compiled
    assert cold["sha"] == cold["sha_second"]
    rows = compile_rows(node)
    assert [r["key"] for r in rows] == [rep["key"]]
    weights = [r for r in artifacts(node) if r["contract_name"] != COMPILE_CONTRACT]
    assert len(weights) == 1
    # What it belongs to, read from its identity: the weights' key, the class, the device.
    assert rows[0]["belongs_to"]["weights_key"] == weights[0]["key"]
    assert rows[0]["belongs_to"]["model"] == "transformers:LlamaForCausalLM"
    assert rows[0]["belongs_to"]["device"].startswith("cpu")


def test_fresh_process_takes_the_artifact_and_its_output_equals_the_cold_one(cold, warm, user_folder):
    rep = warm["compile"]
    assert warm["outcome"] == "LOCAL_HIT"
    assert rep["status"] == "hit" and rep["key"] == cold["compile"]["key"]
    assert warm["sha"] == cold["sha"] and warm["sha_second"] == cold["sha"]  # bitwise
    # Torch found its graph entries warm and compiled nothing: the folder
    # holds exactly the restored files afterwards (no new kernel, no .so).
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert warm["aot"].get("autograd_cache_hit", 0) >= 1
    assert warm["folder"] == user_folder
    assert len(warm["folder_files"]) == rep["files"] > 0
    assert any(f.endswith(".so") for f in warm["folder_files"])
    # Nothing to publish on a hit; the seconds saved are against the cold
    # process's own measurement, carried in the artifact.
    assert rep["publish"] == ""
    # (milliseconds in the artifact's annotations)
    assert rep["seconds"]["cold_first_output"] == pytest.approx(cold["compile"]["seconds"]["first_output"], abs=1e-3)
    assert rep["seconds"]["saved"] == pytest.approx(rep["seconds"]["cold_first_output"]
                                                    - rep["seconds"]["first_output"], abs=2e-3)


def test_changed_option_shape_or_torch_version_is_another_key(model_dir, node, cold, warm):
    """Required mode makes a miss an error before anything compiles: each
    changed key fails as a miss (NotFound), never a restore of the cold
    artifact; the unchanged key then hits and computes the cold output."""
    probe = run_worker(model_dir, node, "--probe")["probe"]
    keys = {name: case["report"]["key"] for name, case in probe.items()}
    for name in ("option", "shape", "torch_version"):
        assert probe[name]["raised"].startswith("NotFound: HWR required"), probe[name]
        assert keys[name] != cold["compile"]["key"]
    assert len(set(keys.values())) == 4
    assert probe["unchanged"]["raised"] == "" and keys["unchanged"] == cold["compile"]["key"]
    assert probe["unchanged"]["report"]["status"] == "hit"
    assert probe["unchanged"]["sha"] == cold["sha"]
    assert len(compile_rows(node)) == 1  # nothing published by the probes


def test_gc_collects_compile_artifacts_like_any_unleased_artifact(node, cold, warm):
    plan = json.loads(node.cli("gc", "--dry-run", "--target", "1", "--json", check=True).stdout)
    names = [i["name"] for i in plan["items"] if i["kind"] == "artifact"]
    assert any(cold["compile"]["key"].startswith(n) or n.startswith(cold["compile"]["key"][:12]) for n in names)


def test_push_pull_and_a_warm_compile_on_a_second_daemon(model_dir, node, cold, warm, tmp_path_factory):
    """Node A pushes the weights (their compile artifact goes along as a
    referrer); node B's required worker misses the weights, B pulls them on
    the miss and their compile artifact with them; the worker restores it
    and computes the cold output bit for bit without compiling."""
    tmp = tmp_path_factory.mktemp("cross")
    reg = make_registry(str(tmp / "registry"))
    second = None
    try:
        repo = "hwr/compile"
        # Node A again on its root, now able to reach the loopback registry (plain HTTP).
        node.stop()
        node.extra_args = ["--config", remote_config(str(tmp / "a.toml"), registry=reg.host, repository=repo)]
        node.start()
        weights = [r["key"] for r in artifacts(node) if r["contract_name"] != COMPILE_CONTRACT][0]
        push(node, weights, f"{reg.host}/{repo}")
        (tmp / "b").mkdir()
        second = make_daemon(tmp / "b", "--config", remote_config(str(tmp / "b.toml"), registry=reg.host,
                                                                  repository=repo, pull_on_miss=True)).start()
        got = run_worker(model_dir, second, "--mode", "required")
        rep = got["compile"]
        assert got["outcome"] == "LOCAL_HIT" and rep["status"] == "hit", rep
        assert rep["key"] == cold["compile"]["key"] and got["sha"] == cold["sha"]
        assert got["inductor"].get("fxgraph_cache_miss", 0) == 0 and len(got["folder_files"]) == rep["files"]
        # The kernels came with the weights' pull on the miss (as their referrer), before the compile lookup.
        assert f"pull of {weights[:12]}: 1 compile artifact(s)" in second.log()
        assert {r["key"] for r in compile_rows(second)} == {rep["key"]}
    finally:
        if second is not None:
            cleanup(second)
        reg.stop()


def _corrupt(node, key: str) -> None:
    """Flips one byte in the middle of the artifact's payload blob."""
    with node.client() as c:
        manifest = c.lookup(key)
    path = os.path.join(node.root, "blobs", "sha256", manifest.files[0].blob)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(manifest.files[0].size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupted_artifact_is_refused_preferred_compiles_required_fails(model_dir, node, cold, warm, user_folder):
    key = cold["compile"]["key"]
    # Preferred: the worker's full verification refuses the bytes (the
    # daemon re-verifies and quarantines); torch compiles as it would
    # without HWR (here from the user's warm folder), the output is the
    # cold one, and a good artifact is published again.
    _corrupt(node, key)
    again = run_worker(model_dir, node, "--cache-dir", user_folder)
    rep = again["compile"]
    assert rep["status"] == "miss" and "unusable" in rep["reason"], rep
    assert again["sha"] == cold["sha"]
    assert rep["publish"] == "published" and rep["key"] == key
    # Required: `hwr verify` finds it corrupt and quarantines it; the
    # worker fails at its first call instead of compiling.
    _corrupt(node, key)
    verify = node.cli("verify", key)
    assert verify.returncode == 1 and "CORRUPT" in verify.stdout
    assert [r["state"] for r in compile_rows(node)] == ["quarantined"]
    failed = run_worker(model_dir, node, "--mode", "required", rc=3)
    assert failed["raised"].startswith(("FailedPrecondition: HWR required", "NotFound: HWR required")), failed
    assert failed["compile"]["key"] == key
