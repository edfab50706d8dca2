"""Runs vLLM-Omni's OWN host-weight tests against the HWR store.

Their code is never copied into this repository: :func:`main` takes the
test files out of a vLLM-Omni git checkout into a scratch directory outside
the project and runs pytest there twice, once on vLLM-Omni's filesystem
store (the baseline) and once with this module as a plugin, which starts a
real ``hwr serve`` and calls :func:`dlo_runtime.integrations.vllm_omni.install`
before any test module is imported::

    python -m tests.support.vllm_omni_upstream --checkout PATH [--ref REF]

The plugin (``-p tests.support.vllm_omni_upstream``, with
``HWR_UPSTREAM_ADAPTER=1``) also makes the wheel's subpackages importable
without vLLM (:func:`tests.support.vllm_omni.load`) and stands in for the
one model module the final-layout tests import that needs vLLM (MiniMax-H3):
the two tests that use it are skipped in both runs.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import types

import pytest

from tests.support.paths import REPO_DIR

#: The upstream test files run, relative to the checkout.
TEST_FILES = (
    "tests/host_weight_runtime/test_contracts.py",
    "tests/host_weight_runtime/test_runtime_resolution.py",
    "tests/diffusion/model_loader/test_final_layout_host_weights.py",
)
_MINIMAX = "vllm_omni.diffusion.models.minimax_h3"
_daemon = None


class _NeedsVllm:
    """Stands in for MiniMaxH3DiTModel (its module imports vLLM)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pytest.skip("needs vllm (MiniMax-H3 model module)")


def pytest_configure(config: pytest.Config) -> None:
    from tests.support.vllm_omni import load

    load()
    for name in ("core_model", "cpu", "gpu", "cuda", "diffusion"):
        config.addinivalue_line("markers", f"{name}: vLLM-Omni's marker")
    package = types.ModuleType(_MINIMAX)
    package.__path__ = []
    module = types.ModuleType(f"{_MINIMAX}.minimax_h3_transformer")
    module.MiniMaxH3DiTModel = _NeedsVllm  # type: ignore[attr-defined]
    sys.modules.setdefault(_MINIMAX, package)
    sys.modules.setdefault(module.__name__, module)
    if os.environ.get("HWR_UPSTREAM_ADAPTER") == "1":
        _start_and_install()


def _start_and_install() -> None:
    global _daemon
    from dlo_runtime.integrations import vllm_omni
    from tests.support.daemon import make_daemon

    _daemon = make_daemon(pathlib.Path(tempfile.mkdtemp(prefix="hwr-upstream-"))).start()
    vllm_omni.install(socket=_daemon.socket, admin_socket=_daemon.admin_socket)


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: pytest.Config) -> None:
    """Proof that the HWR store served the run: the daemon's publication
    and lease figures."""
    if _daemon is None:
        return
    import json

    from hwr_client.core._proto import hwr_pb2 as pb

    client = _daemon.client()
    stats = json.loads(client.call(client.reader.GetStats, pb.GetStatsRequest()).stats_json)
    shown = {k.removeprefix("hwr_"): int(v) for k, v in stats.items()
             if k.startswith(("hwr_publications_total", "hwr_artifacts"))}
    terminalreporter.write_line(f"HWR daemon: {shown}")  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _daemon is not None:
        from tests.support.daemon import cleanup

        cleanup(_daemon)
        shutil.rmtree(os.path.dirname(_daemon.root), ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "minimax_h3" in item.name:
            item.add_marker(pytest.mark.skip(reason="needs vllm (MiniMax-H3 model module)"))


def _scratch(checkout: str, ref: str) -> str:
    """A directory outside the project with the upstream test files at
    ``ref`` and a ``vllm_omni`` link to the installed package (the boundary
    test reads the package source next to ``tests/``)."""
    from tests.support.vllm_omni import load

    api = load()
    scratch = tempfile.mkdtemp(prefix="vllm-omni-upstream-")
    for path in TEST_FILES:
        text = subprocess.run(["git", "-C", checkout, "show", f"{ref}:{path}"], check=True, capture_output=True,
                              text=True).stdout
        os.makedirs(os.path.join(scratch, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(scratch, path), "w") as f:
            f.write(text)
    os.symlink(os.path.dirname(os.path.dirname(api.__file__)), os.path.join(scratch, "vllm_omni"))
    with open(os.path.join(scratch, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")  # the scratch is the rootdir: no project config applies
    return scratch


def _run(scratch: str, adapter: bool) -> dict[str, str]:
    """One pytest run per file; its summary line per file."""
    env = dict(os.environ, PYTHONPATH=REPO_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HWR_UPSTREAM_ADAPTER="1" if adapter else "0")
    out = {}
    for path in TEST_FILES:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                               "tests.support.vllm_omni_upstream", "-rfEs", path], cwd=scratch, env=env,
                              capture_output=True, text=True, timeout=900)
        lines = proc.stdout.strip().splitlines()
        failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "HWR daemon"))]
        out[path] = (lines[-1] if lines else proc.stderr[-500:]) + "".join(f"\n    {ln}" for ln in failed)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, help="a git checkout of vllm-project/vllm-omni")
    parser.add_argument("--ref", default="HEAD", help="the commit whose tests run (default HEAD)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args(argv)
    scratch = _scratch(args.checkout, args.ref)
    try:
        for adapter in (False, True):
            print("with the HWR store:" if adapter else "baseline (vLLM-Omni's filesystem store):")
            for path, summary in _run(scratch, adapter).items():
                print(f"  {path}: {re.sub(r' in [0-9.]+s', '', summary)}")
    finally:
        if args.keep:
            print(f"scratch kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
