"""The layering rules of DESIGN §11, checked in fresh interpreters: the
daemon and the shared core never import torch or the worker client, and the
client never imports the daemon or the runtime."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from tests.support.paths import REPO_DIR

REPO = pathlib.Path(REPO_DIR)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
        check=True, capture_output=True, text=True, cwd=REPO,
    ).stdout
    return set(out.split())


def test_daemon_imports_neither_torch_nor_client():
    mods = _modules_after("import hwr_server.daemon, hwr_server.cli")
    assert "torch" not in mods
    client = {m for m in mods if m.startswith("hwr_client.") and not m.startswith("hwr_client.core")}
    assert client == set(), client


def test_hwr_serve_parser_is_light():
    # `hwr serve` goes through the whole CLI parser: no command module may
    # import torch at module level.
    mods = _modules_after("import hwr_client.cli as c\nc.build_parser()")
    assert "torch" not in mods


def test_package_init_is_lazy():
    mods = _modules_after("import hwr_client.core.errors")
    assert "torch" not in mods and "hwr_client.client" not in mods
    mods = _modules_after("import hwr_client")
    assert "grpc" not in mods and "torch" not in mods
    mods = _modules_after("from hwr_client import NotFound, Lease")
    assert "hwr_client.lease" in mods


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_static_layering():
    problems = []
    for path in sorted(REPO.glob("hwr_client/**/*.py")):
        rel = path.relative_to(REPO).as_posix()
        for name in _imports(path):
            top = name.split(".")[0]
            if rel.startswith("hwr_client/core/"):
                if top == "torch" or (top == "hwr_client" and not name.startswith("hwr_client.core")):
                    problems.append(f"{rel}: imports {name} (the core imports neither torch nor the client)")
            elif not rel.startswith("hwr_client/cli/") and top in ("hwr_server", "dlo_runtime"):
                problems.append(f"{rel}: imports {name} (only the CLI may import the daemon or the runtime)")
    for path in sorted(REPO.glob("hwr_server/**/*.py")):
        rel = path.relative_to(REPO).as_posix()
        for name in _imports(path):
            if name.split(".")[0] in ("torch", "dlo_runtime") or (
                name.startswith("hwr_client") and not name.startswith("hwr_client.core") and rel != "hwr_server/__main__.py"
            ):
                problems.append(f"{rel}: imports {name} (the daemon imports only hwr_client.core)")
    assert problems == []
