"""The code blocks of README.md and docs/**/*.md marked ``<!-- test: run -->``
run as written against a real daemon (``hwr serve`` on a temporary root and
socket, which HWR_SOCKET names), with tiny models built by the harness
(tests/support/doc_blocks.py says how to mark a block); and the harness
itself fails a block that fails."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from tests.support import doc_blocks
from tests.support.daemon import cleanup, make_daemon
from tests.support.markdown import pages
from tests.support.paths import REPO_DIR


def _programs() -> list[list[doc_blocks.Block]]:
    out = []
    for page in pages(REPO_DIR):
        try:
            out += doc_blocks.programs(doc_blocks.marked_blocks(os.path.join(REPO_DIR, page), page=page))
        except doc_blocks.MarkerError:
            continue  # reported by test_markers_are_well_formed
    return out


PROGRAMS = _programs()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The daemon the blocks talk to, and the folder they run in."""
    base = tmp_path_factory.mktemp("doc-blocks")
    d = make_daemon(base).start()
    work = base / "work"
    for sub in ("work", "home", "hf", "fixtures"):
        (base / sub).mkdir()
    env = dict(os.environ, PYTHONPATH=REPO_DIR, HWR_SOCKET=d.socket, HWR_ADMIN_SOCKET=d.admin_socket,
               HOME=str(base / "home"), HF_HOME=str(base / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    yield doc_blocks.Fixtures(str(base / "fixtures")), str(work), env
    cleanup(d)


def test_markers_are_well_formed():
    for page in pages(REPO_DIR):
        doc_blocks.programs(doc_blocks.marked_blocks(os.path.join(REPO_DIR, page), page=page))


def test_readme_has_blocks_that_run():
    # The quick start's worker example at least; a README that lost every
    # marker would leave the test below with nothing to run.
    assert any(p[0].page == "README.md" for p in PROGRAMS)


@pytest.mark.parametrize("program", PROGRAMS, ids=[f"{p[0].page}:{p[0].line}" for p in PROGRAMS])
def test_marked_block_runs_as_written(program, node):
    if any("cuda" in b.needs for b in program) and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fixtures, work, env = node
    outcome = doc_blocks.run(program, fixtures=fixtures, cwd=work, env=env)
    assert outcome.ok, f"{program[0].page}:{program[0].line}: {outcome.why}\n{outcome.output[-4000:]}"


# -- the harness fails what fails -----------------------------------------------------


def _page(tmp_path, text: str) -> list[list[doc_blocks.Block]]:
    path = tmp_path / "page.md"
    path.write_text(text)
    return doc_blocks.programs(doc_blocks.marked_blocks(str(path), page="page.md"))


def _fixtures(tmp_path, built: list[str] | None = None) -> doc_blocks.Fixtures:
    def folder(directory: str) -> str:
        (built if built is not None else []).append(directory)
        os.makedirs(directory)
        with open(os.path.join(directory, "config.json"), "w") as f:
            f.write("{}")
        return directory

    return doc_blocks.Fixtures(str(tmp_path / "fixtures"), builders={"tiny-transformers": folder})


def _run(tmp_path, program, fixtures: doc_blocks.Fixtures | None = None) -> doc_blocks.Outcome:
    return doc_blocks.run(program, fixtures=fixtures or _fixtures(tmp_path), cwd=str(tmp_path), env=dict(os.environ))


def test_harness_runs_programs_binds_fixtures_and_checks_output(tmp_path):
    programs = _page(tmp_path, (
        "Text.\n\n<!-- test: run model_dir=tiny-transformers -->\n```python\nimport os\nx = 41\n```\n\n"
        "More text.\n<!-- test: run continue repeat=2 expect=\"is 42\" expect=config -->\n```python\n"
        "print('x is', x + 1, os.listdir(model_dir))\n```\n\n"
        "```python\nraise SystemExit('unmarked: never runs')\n```\n\n"
        "<!-- test: run /models/my-model=tiny-transformers -->\n```console\n$ ls /models/my-model\nconfig.json\n```\n"
        "<!-- test: run -->\n```bash\ntest \"$HOME\" = \"$HOME\" && echo shell\n```\n"))
    assert [[b.line for b in p] for p in programs] == [[4, 11], [20], [25]]
    built: list[str] = []
    fixtures = _fixtures(tmp_path, built)
    outcomes = [_run(tmp_path, p, fixtures) for p in programs]
    assert [o.ok for o in outcomes] == [True, True, True], outcomes
    assert built == [str(tmp_path / "fixtures" / "tiny-transformers")]  # built once, for both blocks
    assert outcomes[0].output.count("x is 42") == 2 and outcomes[1].output == "config.json\n"


@pytest.mark.parametrize("text, why", [
    ("<!-- test: run -->\n```python\nraise ValueError('broken example')\n```\n", "run 1 exited 1"),
    ("<!-- test: run repeat=2 -->\n```python\nimport os, sys\nopen('seen', 'a').close() if not os.path.exists("
     "'seen') else sys.exit(3)\n```\n", "run 2 exited 3"),
    ("<!-- test: run expect=LOCAL_HIT -->\n```python\nprint('CANONICAL_FALLBACK')\n```\n", "expected 'LOCAL_HIT'"),
    ("<!-- test: run expect=b expect=a -->\n```python\nprint('a b')\n```\n", "expected 'a'"),
    ("<!-- test: run -->\n```sh\nfalse\necho unreachable\n```\n", "run 1 exited 1"),
], ids=["raises", "second-run-fails", "expected-text-missing", "expected-out-of-order", "shell-stops-at-error"])
def test_harness_fails_a_block_that_fails(tmp_path, text, why):
    (program,) = _page(tmp_path, text)
    outcome = _run(tmp_path, program)
    assert not outcome.ok and outcome.why.startswith(why), outcome


@pytest.mark.parametrize("text, message", [
    ("<!-- test: run -->\n\n```python\npass\n```\n", "page.md:1: `<!-- test: run -->` must be on the line right"),
    ("<!-- test: run fast -->\n```python\npass\n```\n", "page.md:1: unknown option 'fast'"),
    ("<!-- test: run model=huge-model -->\n```python\npass\n```\n", "unknown option 'model=huge-model'"),
    ("<!-- test: run -->\n```rust\nfn main() {}\n```\n", "cannot run a ```rust block"),
    ("<!-- test: run continue -->\n```python\npass\n```\n", "page.md:2: `continue` needs a marked python block"),
], ids=["not-above-a-fence", "unknown-word", "unknown-fixture", "unknown-language", "continue-first"])
def test_harness_refuses_a_marker_it_cannot_follow(tmp_path, text, message):
    with pytest.raises(doc_blocks.MarkerError, match=re.escape(message)):
        _page(tmp_path, text)
