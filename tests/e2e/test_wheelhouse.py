"""The air-gapped install: ``.ci/wheelhouse``
downloads every wheel for the running Python, ``.ci/setup --wheelhouse DIR
--no-torch`` installs from it into a temp venv with no index, and the
packages import there, the daemon without torch.

The build needs the package index; it is skipped, with the reason, where the
index is unreachable (.ci/wheelhouse exits 3). The refusal tests need
neither the index nor a venv."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import tomllib
import sys

import pytest
from tests.support.paths import REPO_DIR

REPO = pathlib.Path(REPO_DIR)
PYVER = "%d.%d" % sys.version_info[:2]
# Any network use by the install would go through these dead proxies and
# fail: with --no-index there must be none.
NO_NET = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
          "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}


def _run(args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHON=sys.executable)
    full.update(env)
    return subprocess.run(["bash", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A torch-free wheelhouse for the running Python, built by .ci/wheelhouse."""
    out = tmp_path_factory.mktemp("wheelhouse")
    try:
        r = _run([".ci/wheelhouse", str(out), "--python", PYVER], timeout=240)
    except subprocess.TimeoutExpired:
        pytest.skip(".ci/wheelhouse took over 240 s: the package index is too slow from here")
    if r.returncode == 3:
        pytest.skip(f"package index unreachable: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def venv(wheelhouse: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A temp venv made by ``.ci/setup --wheelhouse DIR --no-torch``, offline."""
    path = tmp_path_factory.mktemp("venv") / "v"
    r = _run([".ci/setup", "--wheelhouse", str(wheelhouse), "--no-torch"], timeout=240,
             HWR_VENV=str(path), **NO_NET)
    assert r.returncode == 0, r.stderr
    assert "installed hwr-" in r.stdout
    return path


def _manifest(wheelhouse: pathlib.Path) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
    fields, wheels = {}, {}
    for line in (wheelhouse / "hwr-wheelhouse.txt").read_text().splitlines():
        if line.startswith("wheel "):
            _, size, sha, name = line.split()
            wheels[name] = (int(size), sha)
        elif "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            fields[key] = value
    return fields, wheels


def test_manifest_lists_every_wheel_and_no_torch(wheelhouse: pathlib.Path) -> None:
    fields, wheels = _manifest(wheelhouse)
    assert fields["python"] == PYVER and fields["torch"] == "no" and fields["dev"] == "no"
    on_disk = {p.name for p in wheelhouse.glob("*.whl")}
    assert set(wheels) == on_disk
    for name, (size, sha) in wheels.items():
        data = (wheelhouse / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size, sha), name
    assert fields["project"] in on_disk and fields["project"].startswith("hwr-")
    assert not any(n.startswith("torch-") for n in on_disk)
    # Binary wheels only: nothing to build on the air-gapped node.
    assert not list(wheelhouse.glob("*.tar.gz"))
    for dep in ("pip-", "grpcio-", "grpcio_health_checking-", "protobuf-", "xxhash-"):
        assert any(n.startswith(dep) for n in on_disk), dep
    reqs = (wheelhouse / "requirements.txt").read_text().split()
    # The project's own requirement, as pyproject.toml states it.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    health = next(d for d in pyproject["project"]["dependencies"] if d.startswith("grpcio-health-checking"))
    assert health in reqs
    assert not any(r.startswith("torch") for r in reqs)


def test_setup_installs_from_wheelhouse_and_imports(venv: pathlib.Path,
                                                    wheelhouse: pathlib.Path) -> None:
    code = ("import sys, grpc, grpc_health.v1.health, google.protobuf, xxhash, filelock, "
            "prometheus_client, safetensors, hwr_client.core, hwr_server.daemon\n"
            "import pip, hwr_server\n"
            "print(pip.__version__, hwr_server.__file__, 'torch' in sys.modules)\n"
            "import importlib.util\n"
            "print(importlib.util.find_spec('torch') is None)")
    # Outside the checkout: the venv's own copy must be the one imported.
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd="/", capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    pip_version, daemon_file, torch_loaded = first.split()
    assert pathlib.Path(daemon_file).is_relative_to(venv)
    assert torch_loaded == "False" and second == "True"
    # pip was upgraded from the wheelhouse (an image's old pip is replaced).
    assert (wheelhouse / f"pip-{pip_version}-py3-none-any.whl").exists()
    r = subprocess.run([str(venv / "bin" / "hwr"), "serve", "--help"], cwd="/",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--socket" in r.stdout, r.stderr


def test_setup_rejects_wheelhouse_for_another_python(venv: pathlib.Path, wheelhouse: pathlib.Path,
                                                     tmp_path: pathlib.Path) -> None:
    fields, _ = _manifest(wheelhouse)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(wheelhouse / fields["project"], other)
    text = (wheelhouse / "hwr-wheelhouse.txt").read_text()
    (other / "hwr-wheelhouse.txt").write_text(text.replace(f"python={PYVER}\n", "python=3.99\n"))
    r = _run([".ci/setup", "--wheelhouse", str(other), "--no-torch"], timeout=60,
             HWR_VENV=str(venv), **NO_NET)
    assert r.returncode == 2
    assert "Python 3.99" in r.stderr and f"Python {PYVER}" in r.stderr


def _fake_wheelhouse(path: pathlib.Path, torch: str = "no") -> pathlib.Path:
    path.mkdir()
    (path / "hwr-0.1.0-py3-none-any.whl").write_bytes(b"")
    (path / "requirements.txt").write_text("")
    (path / "hwr-wheelhouse.txt").write_text(
        f"python={PYVER}\ntorch={torch}\ndev=no\nproject=hwr-0.1.0-py3-none-any.whl\n")
    return path


def test_setup_refuses_torchless_wheelhouse_without_no_torch(tmp_path: pathlib.Path) -> None:
    fake = _fake_wheelhouse(tmp_path / "wh")
    r = _run([".ci/setup", "--wheelhouse", str(fake)], timeout=30,
             HWR_VENV=str(tmp_path / "v"), **NO_NET)
    assert r.returncode == 2 and "--no-torch" in r.stderr, r.stderr
    assert not (tmp_path / "v").exists()


def test_setup_refuses_a_directory_that_is_not_a_wheelhouse(tmp_path: pathlib.Path) -> None:
    r = _run([".ci/setup", "--wheelhouse", str(tmp_path)], timeout=30,
             HWR_VENV=str(tmp_path / "v"), **NO_NET)
    assert r.returncode == 2 and "hwr-wheelhouse.txt" in r.stderr, r.stderr


def test_setup_names_a_python_without_venv(tmp_path: pathlib.Path) -> None:
    # A Debian python3 without python3-venv: ensurepip does not import.
    shadow = tmp_path / "shadow"
    (shadow / "ensurepip").mkdir(parents=True)
    (shadow / "ensurepip" / "__init__.py").write_text("raise ImportError('no ensurepip here')\n")
    fake = _fake_wheelhouse(tmp_path / "wh")
    r = _run([".ci/setup", "--wheelhouse", str(fake), "--no-torch"], timeout=30,
             HWR_VENV=str(tmp_path / "v"), PYTHONPATH=str(shadow), **NO_NET)
    assert r.returncode == 2 and "python3-venv" in r.stderr, r.stderr
    assert not (tmp_path / "v").exists()


def test_wheelhouse_only_flags_need_a_wheelhouse(tmp_path: pathlib.Path) -> None:
    # Without --wheelhouse, .ci/setup is CI's index install; the offline
    # flags are refused instead of silently ignored.
    r = _run([".ci/setup", "--no-torch"], timeout=30, HWR_VENV=str(tmp_path / "v"))
    assert r.returncode == 2 and "--wheelhouse" in r.stderr, r.stderr
    assert not (tmp_path / "v").exists()


def test_wheelhouse_rejects_a_malformed_python_version(tmp_path: pathlib.Path) -> None:
    r = _run([".ci/wheelhouse", str(tmp_path / "wh"), "--python", "3"], timeout=30)
    assert r.returncode == 2 and "X.Y" in r.stderr, r.stderr


def test_wheelhouse_exits_3_when_the_index_is_unreachable(tmp_path: pathlib.Path) -> None:
    # The contract the wheelhouse fixture's skip relies on: no index -> 3,
    # within seconds (one retry, short timeout), not a generic failure.
    r = _run([".ci/wheelhouse", str(tmp_path / "wh"), "--python", PYVER], timeout=120, **NO_NET)
    assert r.returncode == 3 and "index unreachable" in r.stderr, r.stderr


def test_setup_replaces_an_older_dependency_with_the_wheelhouse_one(
        venv: pathlib.Path, wheelhouse: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # What a GPU image's older system package (or a stale reused venv) looks
    # like to pip: a version that satisfies pyproject's floor but is older
    # than the wheelhouse's. The install must end on the wheelhouse's.
    old = tmp_path / "old"
    r = subprocess.run([sys.executable, "-m", "pip", "--isolated", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "-d", str(old), "prometheus_client==0.20.0"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"cannot fetch prometheus_client 0.20.0: {r.stderr.strip()[-300:]}")
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "--isolated", "install", "-q", "--no-index", "--no-deps",
                    "--find-links", str(old), "prometheus_client==0.20.0"], check=True, timeout=120)
    version = [py, "-c", "import importlib.metadata as m; print(m.version('prometheus_client'))"]
    assert subprocess.run(version, capture_output=True, text=True).stdout.strip() == "0.20.0"
    r = _run([".ci/setup", "--wheelhouse", str(wheelhouse), "--no-torch"], timeout=240,
             HWR_VENV=str(venv), **NO_NET)
    assert r.returncode == 0, r.stderr
    want = next(wheelhouse.glob("prometheus_client-*.whl")).name.split("-")[1]
    assert subprocess.run(version, capture_output=True, text=True).stdout.strip() == want != "0.20.0"


def test_wheelhouse_refuses_a_python_below_requires_python(tmp_path: pathlib.Path) -> None:
    # pyproject.toml: requires-python >= 3.11; refused before the downloads.
    r = _run([".ci/wheelhouse", str(tmp_path / "wh"), "--python", "3.10"], timeout=240)
    if r.returncode == 3:
        pytest.skip(f"package index unreachable: {r.stderr.strip()[-300:]}")
    assert r.returncode == 2 and "requires Python >=3.11" in r.stderr, r.stderr
    assert not list((tmp_path / "wh").glob("grpcio-*.whl"))
