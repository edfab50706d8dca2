"""Building the project prints no setuptools deprecation (`.ci/setup` used to
print "project.license as a TOML table is deprecated" four times): the wheel
is built for real from a copy of the checkout, with the installed setuptools
(no index), and its metadata carries the SPDX license."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

from tests.support.paths import REPO_DIR


def test_pyproject_asks_for_a_setuptools_that_reads_the_spdx_license():
    with open(os.path.join(REPO_DIR, "pyproject.toml"), "rb") as f:
        doc = tomllib.load(f)
    assert doc["project"]["license"] == "Apache-2.0"
    assert doc["build-system"]["requires"] == ["setuptools>=77"]
    installed = tuple(int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    assert installed >= (77, 0), "the dev environment's setuptools is older than pyproject asks"


def test_wheel_build_warns_of_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO_DIR, name), src / name)
    for pkg in ("hwr_client", "hwr_server", "dlo_runtime"):
        shutil.copytree(os.path.join(REPO_DIR, pkg), src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "BuildBackendWarning" not in log and "deprecated" not in log.lower(), \
        [ln for ln in log.splitlines() if "eprecat" in ln or "Warning" in ln][:10]
    (wheel,) = (tmp_path / "dist").glob("hwr-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta.splitlines()
