"""The carried wheel set of the first GPU run: build it here, install only
what the image lacks there (issue 23, finding 2).

    python bench/gpu/wheels.py build DIR           # pip download, cp312 manylinux x86-64
    python bench/gpu/wheels.py plan                # what this interpreter would install
    python bench/gpu/wheels.py install DIR TARGET  # pip install --no-index --no-deps --target TARGET

The lock (``bench/gpu/wheels.lock``) names each package at the exact
version the tests here run against, with the requirement the code has.
``install`` picks a package only when this interpreter's own copy is missing
or fails that requirement, and installs those wheels with
``pip install --no-index --no-deps --target``; run.sh then puts TARGET on
PYTHONPATH after the repository (so it wins over the image's site-packages
for exactly those packages). Standard library + pip (+ ``packaging``, which
pip's own environment and the GPU image both have) only.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.metadata
import os
import re
import subprocess
import sys
from typing import Callable, Sequence

from packaging.specifiers import SpecifierSet
from packaging.version import Version

HERE = os.path.dirname(os.path.abspath(__file__))
LOCK = os.path.join(HERE, "wheels.lock")
#: What the GPU image runs: CPython 3.12 on x86-64 Linux (glibc >= 2.28).
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
#: The device tool carries at most this much (wheels and working tree together).
CARRY_LIMIT = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Locked:
    """One lock line: the exact version carried and what the code needs."""

    name: str
    version: str
    need: str

    def satisfied_by(self, installed: str | None) -> bool:
        """Whether an installed version (None: absent) meets ``need``."""
        return installed is not None and Version(installed) in SpecifierSet(self.need)

    @property
    def wheel_prefix(self) -> str:
        """How the wheel's file name starts (names normalized as in wheels)."""
        return f"{re.sub(r'[-_.]+', '_', self.name).lower()}-{self.version}-"


def parse_lock(text: str) -> list[Locked]:
    """The lock's lines; a bad line raises ValueError naming it."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or "==" not in parts[0]:
            raise ValueError(f"wheels.lock line {n}: {line!r}: expected 'NAME==VERSION REQUIREMENT'")
        name, version = parts[0].split("==", 1)
        SpecifierSet(parts[1])  # a malformed requirement fails here, naming itself
        out.append(Locked(name, version, parts[1]))
    return out


def read_lock(path: str = LOCK) -> list[Locked]:
    with open(path) as f:
        return parse_lock(f.read())


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def plan(locked: Sequence[Locked], installed: Callable[[str], str | None] = installed_version) -> list[dict]:
    """Per package: what is installed here, what is needed, and whether the
    carried wheel must be installed."""
    rows = []
    for lk in locked:
        have = installed(lk.name)
        rows.append({"name": lk.name, "installed": have, "need": lk.need, "carried": lk.version,
                     "install": not lk.satisfied_by(have)})
    return rows


def wheel_files(locked: Sequence[Locked], directory: str) -> dict[str, str]:
    """Each locked package's one wheel in ``directory``.

    Raises:
        FileNotFoundError: a package without a wheel, or with several.
    """
    files = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    out = {}
    for lk in locked:
        found = [f for f in files if f.lower().startswith(lk.wheel_prefix) and f.endswith(".whl")]
        if len(found) != 1:
            raise FileNotFoundError(f"{directory}: {len(found)} wheels of {lk.name}=={lk.version}, expected one "
                                    f"(build them: python bench/gpu/wheels.py build {directory})")
        out[lk.name] = os.path.join(directory, found[0])
    return out


def download_argv(locked: Sequence[Locked], directory: str, python: str = sys.executable) -> list[str]:
    """The pip command that builds the set: binary wheels only, for CPython
    3.12 on manylinux x86-64, no dependencies (each needed one is locked)."""
    argv = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_VERSION,
            "--implementation", "cp", "-d", directory]
    for p in PLATFORMS:
        argv += ["--platform", p]
    return argv + [f"{lk.name}=={lk.version}" for lk in locked]


def build(directory: str) -> int:
    locked = read_lock()
    os.makedirs(directory, exist_ok=True)
    proc = subprocess.run(download_argv(locked, directory))
    if proc.returncode != 0:
        return proc.returncode
    files = wheel_files(locked, directory)
    total = sum(os.path.getsize(f) for f in files.values())
    for name, f in files.items():
        print(f"{os.path.getsize(f) / 2**20:7.2f} MiB  {os.path.basename(f)}")
    print(f"{total / 2**20:7.2f} MiB in {len(files)} wheels (the device tool carries {CARRY_LIMIT // 2**20} MiB "
          f"with the working tree)")
    return 0


def install(directory: str, target: str) -> int:
    locked = read_lock()
    rows = plan(locked)
    for r in rows:
        print(f"wheels: {r['name']}: here {r['installed'] or 'absent'}, need {r['need']}: "
              + (f"installing {r['carried']}" if r["install"] else "kept"))
    wanted = [lk for lk, r in zip(locked, rows) if r["install"]]
    if not wanted:
        return 0
    files = wheel_files(wanted, directory)
    os.makedirs(target, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--upgrade", "--target", target, *files.values()]
    return subprocess.run(argv).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build").add_argument("dir")
    sub.add_parser("plan")
    p = sub.add_parser("install")
    p.add_argument("dir")
    p.add_argument("target")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        return build(args.dir)
    if args.cmd == "install":
        return install(args.dir, args.target)
    for r in plan(read_lock()):
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
