"""Runs the code blocks of a Markdown page that are marked for it, as
written, in fresh processes (tests/docs/test_doc_blocks.py runs them against
a real daemon).

The marker is an HTML comment (invisible on GitHub) on the line right above
the opening fence::

    <!-- test: run -->
    ```python
    import hwr_client
    ...
    ```

Options, after ``run``, separated by spaces (shell quoting):

- ``continue``: this block and the marked block before it are one program
  (the page's later block uses names the earlier one defined); they run
  together, once, the earlier one not on its own.
- ``repeat=N``: run the program N times in a row (a page that says "run
  this twice": a miss, then a hit).
- ``expect=TEXT`` (repeatable): TEXT must appear in the output of the runs,
  each after the previous one (``expect=CANONICAL_FALLBACK expect=LOCAL_HIT``).
- ``NAME=FIXTURE``: a tiny model the harness builds (with ``save_pretrained``,
  random weights, nothing downloaded): :data:`FIXTURES`. NAME is either a
  Python / shell variable the block uses (set before it runs), or a path
  written in the block (``/models/my-model=tiny-transformers``), replaced by
  the fixture's path, so a page can show a realistic path.
- ``needs=cuda``: skipped where no CUDA device is visible.
- ``timeout=SECONDS``: per run (default 300).

Languages: ``python`` / ``py`` (run with the test's interpreter), ``bash``,
``sh``, ``shell`` or none (``bash -euo pipefail``), ``console`` (its ``$ ``
lines are the commands; the rest is output). The environment names the
harness's daemon (``HWR_SOCKET``, ``HWR_ADMIN_SOCKET``), puts the
interpreter's ``bin`` (``hwr``) first on PATH, and points HOME, HF_HOME and
the working directory into a temporary folder (offline: nothing reaches the
network). A program passes when every run exits 0 and the expected texts
appear.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from typing import Callable

from tests.support import markdown as md

MARKER = re.compile(r"^\s*<!--\s*test:\s*run\b(.*?)-->\s*$")
_NAME = re.compile(r"^[A-Za-z_]\w*$")
_LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "": "bash",
          "console": "console"}
DEFAULT_TIMEOUT_S = 300.0


def _tiny(name: str) -> Callable[[str], str]:
    def build(directory: str) -> str:
        from tests.support.real_models import save_model

        return save_model(name, directory)

    return build


def _tiny_pipeline(directory: str) -> str:
    from tests.support.real_models import save_flux_pipeline

    return save_flux_pipeline(directory)


#: Fixture name -> builder(directory) -> the path a block gets.
FIXTURES: dict[str, Callable[[str], str]] = {
    "tiny-transformers": _tiny("bert"),       # a transformers BertModel directory
    "tiny-causal-lm": _tiny("llama"),         # a transformers LlamaForCausalLM directory
    "tiny-diffusers": _tiny("flux"),          # a diffusers FluxTransformer2DModel directory
    "tiny-pipeline": _tiny_pipeline,          # a diffusers FluxPipeline folder (model_index.json)
}


class MarkerError(ValueError):
    """A marker the harness cannot follow (names the page and line)."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One marked block and its options (see the module doc)."""

    page: str
    line: int
    lang: str
    code: str
    joins: bool = False
    repeat: int = 1
    expect: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    bind: tuple[tuple[str, str], ...] = ()
    timeout: float = DEFAULT_TIMEOUT_S


def marked_blocks(path: str, *, page: str | None = None) -> list[Block]:
    """The marked blocks of the page at ``path``, in order.

    Raises:
        MarkerError: a marker not right above a fence, an unknown option,
            fixture or language.
    """
    page = page or path
    with open(path, encoding="utf-8") as f:
        text = f.read()
    prose, fences = md.split_fences(text)
    fence_at = {f.line: f for f in fences}
    out = []
    for number, line in prose:
        m = MARKER.match(line)
        if not m:
            continue
        where = f"{page}:{number}"
        fence = fence_at.get(number + 1)
        if fence is None:
            raise MarkerError(f"{where}: `<!-- test: run -->` must be on the line right above a fenced code block")
        if fence.lang not in _LANGS:
            raise MarkerError(f"{where}: cannot run a ```{fence.lang} block; expected one of {sorted(_LANGS)}")
        out.append(_parse(where, page, fence, m.group(1)))
    return out


def _parse(where: str, page: str, fence: md.Fence, options: str) -> Block:
    fields: dict = {"joins": False, "repeat": 1, "expect": [], "needs": [], "bind": [], "timeout": DEFAULT_TIMEOUT_S}
    try:
        words = shlex.split(options)
    except ValueError as exc:
        raise MarkerError(f"{where}: options {options.strip()!r}: {exc}") from None
    for word in words:
        key, eq, value = word.partition("=")
        if word == "continue":
            fields["joins"] = True
        elif key in ("repeat", "timeout") and eq:
            try:
                fields[key] = int(value) if key == "repeat" else float(value)
            except ValueError:
                raise MarkerError(f"{where}: {word!r}: expected a number") from None
        elif key == "expect" and eq:
            fields["expect"].append(value)
        elif key == "needs" and value == "cuda":
            fields["needs"].append(value)
        elif eq and value in FIXTURES and (_NAME.match(key) or key.startswith("/")):
            fields["bind"].append((key, value))
        else:
            raise MarkerError(f"{where}: unknown option {word!r}; expected continue, repeat=N, expect=TEXT, "
                              f"needs=cuda, timeout=S or NAME=FIXTURE with a fixture of {sorted(FIXTURES)}")
    return Block(page, fence.line, _LANGS[fence.lang], fence.body, fields["joins"], fields["repeat"],
                 tuple(fields["expect"]), tuple(fields["needs"]), tuple(fields["bind"]), fields["timeout"])


def programs(blocks: list[Block]) -> list[list[Block]]:
    """The blocks grouped into programs (``continue`` joins the one before).

    Raises:
        MarkerError: ``continue`` on a page's first marked block, or across
            languages.
    """
    out: list[list[Block]] = []
    for b in blocks:
        if b.joins:
            if not out or out[-1][-1].page != b.page or out[-1][-1].lang != b.lang:
                raise MarkerError(f"{b.page}:{b.line}: `continue` needs a marked {b.lang} block before it")
            out[-1].append(b)
        else:
            out.append([b])
    return out


class Fixtures:
    """Builds each fixture once, under ``root``, when a block first asks."""

    def __init__(self, root: str, builders: dict[str, Callable[[str], str]] | None = None):
        self.root = root
        self.builders = FIXTURES if builders is None else builders
        self._built: dict[str, str] = {}

    def path(self, name: str) -> str:
        if name not in self._built:
            self._built[name] = self.builders[name](os.path.join(self.root, name))
        return self._built[name]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the runs of one program gave: ``ok`` and, when not, why."""

    ok: bool
    why: str
    output: str


def source(program: list[Block], fixtures: Fixtures) -> str:
    """The program's text: bindings first, then each block as written (a
    bound path replaced by its fixture's)."""
    lang = program[0].lang
    lines, body = [], []
    for block in program:
        code = block.code
        for key, fixture in block.bind:
            if key.startswith("/"):
                code = code.replace(key, fixtures.path(fixture))
            else:
                value = fixtures.path(fixture)
                lines.append(f"{key} = {value!r}" if lang == "python" else f"export {key}={shlex.quote(value)}")
        if lang == "console":
            code = "\n".join(ln[2:] for ln in code.split("\n") if ln.startswith("$ ")) + "\n"
        body.append(code)
    return "\n".join(lines + body)


def run(program: list[Block], *, fixtures: Fixtures, cwd: str, env: dict[str, str]) -> Outcome:
    """Runs ``program`` as its options say (see the module doc)."""
    first = program[0]
    script = os.path.join(cwd, f"block-{os.path.basename(first.page).replace('.', '_')}-{first.line}"
                               + (".py" if first.lang == "python" else ".sh"))
    with open(script, "w") as f:
        f.write(source(program, fixtures))
    argv = [sys.executable, script] if first.lang == "python" else ["bash", "-euo", "pipefail", script]
    timeout = max(b.timeout for b in program)
    output = ""
    for n in range(max(b.repeat for b in program)):
        try:
            out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Outcome(False, f"run {n + 1} did not end within {timeout:g} s", output)
        output += out.stdout + out.stderr
        if out.returncode != 0:
            return Outcome(False, f"run {n + 1} exited {out.returncode}", output)
    at = 0
    for text in (t for b in program for t in b.expect):
        found = output.find(text, at)
        if found < 0:
            return Outcome(False, f"expected {text!r} in the output (after what was expected before it)", output)
        at = found + len(text)
    return Outcome(True, "", output)
