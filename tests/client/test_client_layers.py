"""The worker client's layers (DESIGN §11): channel at the bottom, no import
cycle (function-local imports included), typed verbs, and a session the
Client owns."""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys

from hwr_client.client import Client
from tests.conftest import identity, sample_tensors
from tests.support.paths import REPO_DIR

REPO = pathlib.Path(REPO_DIR)
VERBS = ("lookup", "publish", "acquire", "resolve", "publish_after_load", "resolve_sources")


def _client_imports() -> dict[str, set[str]]:
    """module -> the hwr_client modules it imports anywhere (top level or in
    a function); the package itself (lazy, PEP 562) is not an edge."""
    graph: dict[str, set[str]] = {}
    for path in sorted((REPO / "hwr_client").glob("**/*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
        graph[name] = {d for d in deps if d.startswith("hwr_client.") and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (as a path back to its start), or []."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_no_import_cycle_in_the_client():
    graph = _client_imports()
    assert "hwr_client.channel" in graph
    assert _cycle(graph) == []
    # The bottom imports nothing of the client but the core.
    assert {d for d in graph["hwr_client.channel"] if not d.startswith("hwr_client.core")} == set()
    for below in ("hwr_client.channel", "hwr_client.session", "hwr_client.lease", "hwr_client.publish",
                  "hwr_client.sources", "hwr_client.resolve"):
        assert "hwr_client.client" not in graph[below], below


def test_verbs_have_real_signatures():
    for name in VERBS:
        sig = inspect.signature(getattr(Client, name))
        assert not [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD], f"Client.{name} takes **kwargs"
        # Annotations are strings (PEP 563); the torch-side ones resolve only
        # under TYPE_CHECKING, so the text is what is checked.
        assert sig.return_annotation not in (sig.empty, "Any"), f"Client.{name} returns Any"
    publish = inspect.signature(Client.publish).parameters.values()
    assert {"blocks", "ordered", "file_target_bytes", "progress", "seed"} <= {
        p.name for p in publish if p.kind is p.KEYWORD_ONLY}
    assert inspect.signature(Client.acquire).return_annotation == "Lease"
    assert inspect.signature(Client.acquire).parameters["verify"].kind is inspect.Parameter.KEYWORD_ONLY


def test_client_import_is_torch_free():
    # The verbs that need torch import it on use: `hwr ls` never loads it.
    out = subprocess.run([sys.executable, "-c", "import sys, hwr_client.client; print('torch' in sys.modules)"],
                         check=True, capture_output=True, text=True, cwd=REPO).stdout
    assert out.strip() == "False"


def test_the_client_owns_its_session(daemon):
    with daemon.client() as c:
        key = c.publish(identity(test="owned-session"), sample_tensors()).key
        with c.acquire(key) as lease:
            session = c.session()
            assert c.session() is session and session.usable
            assert session.held == [lease.lease_id]
        assert session.held == []
    assert session.closed and not session.usable  # the client's close ends it
