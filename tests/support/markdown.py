"""Just enough Markdown for the docs tests: fenced blocks, headings and their
GitHub anchors, and the relative links of a page.

Anchors follow GitHub (its github-slugger): the heading's rendered text
(code spans, emphasis and links reduced to their text, HTML tags dropped),
lower-cased, every character that is not a letter, mark, number, ``_``,
space or ``-`` removed, spaces turned into ``-``; a repeated slug gets
``-1``, ``-2``... Explicit ``<a name=...>`` / ``id=...`` anchors count too.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import unicodedata
import urllib.parse

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']*)[\"']", re.I)
_HTML_ANCHOR = re.compile(r"<[a-z][^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


@dataclasses.dataclass(frozen=True)
class Fence:
    """One fenced code block: ``line`` is the 1-based line of its opening
    fence; ``body`` its text without the fences."""

    line: int
    lang: str
    body: str


@dataclasses.dataclass(frozen=True)
class Link:
    """A link in a page: its target as written and the line it is on."""

    line: int
    target: str


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[Fence]]:
    """The lines outside fenced blocks (1-based number, text), and the blocks."""
    prose: list[tuple[int, str]] = []
    fences: list[Fence] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        marker, start, body = m.group(1), i, []
        i += 1
        while i < len(lines) and not re.match(rf"^ {{0,3}}{marker[0]}{{{len(marker)},}}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        fences.append(Fence(start + 1, m.group(2).lower(), "\n".join(body) + ("\n" if body else "")))
        i += 1  # the closing fence (or the end of the page)
    return prose, fences


def heading_text(markdown: str) -> str:
    """A heading's text as GitHub renders it (no markup)."""
    text = _CODE_SPAN.sub(lambda m: m.group(2).strip(), markdown)
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(\*{1,3}|_{1,3})(\S(?:.*?\S)?)\1", r"\2", text)
    return text.strip()


def slug(text: str) -> str:
    """GitHub's anchor of a heading whose rendered text is ``text``."""
    kept = [c for c in text.lower()
            if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc"]
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page defines: heading slugs (repeats numbered as
    GitHub does) and explicit HTML ids / names."""
    prose, _ = split_fences(text)
    seen: dict[str, int] = {}
    out: set[str] = set()
    previous = ""
    for _, line in prose:
        m = _ATX.match(line)
        setext = _SETEXT.match(line) if previous.strip() and not _ATX.match(previous) else None
        title: str | None = None
        if m:
            title = m.group(2) or ""
        elif setext:
            title = previous
        if title is not None:
            base = slug(heading_text(title))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(a for a in _HTML_ANCHOR.findall(line))
        previous = "" if setext else line
    return out


def links(text: str) -> list[Link]:
    """Links outside code: inline, reference definitions and HTML."""
    prose, _ = split_fences(text)
    out = []
    for number, line in prose:
        plain = _CODE_SPAN.sub("", line)
        for rx in (_INLINE_LINK, _HTML_LINK):
            for m in rx.finditer(plain):
                out.append(Link(number, m.group(m.lastindex or 1)))
        ref = _REF_DEF.match(plain)
        if ref:
            out.append(Link(number, ref.group(1)))
    return out


def is_relative(target: str) -> bool:
    """A link into this repository (not ``https:``, ``mailto:``, ``//host``)."""
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("//")


def broken_links(path: str, *, root: str) -> list[str]:
    """The relative links of page ``path`` that do not resolve: a missing
    file or folder, a path outside ``root``, or a ``#anchor`` the target
    page does not define. One line per problem, ``page:line: why``."""
    path, root = os.path.abspath(path), os.path.abspath(root)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    here = os.path.dirname(path)
    problems = []
    for link in links(text):
        if not is_relative(link.target) or not link.target:
            continue
        target, _, anchor = (urllib.parse.unquote(part) for part in link.target.partition("#"))
        where = f"{os.path.relpath(path, root)}:{link.line}: {link.target}"
        resolved = os.path.normpath(os.path.join(here, target)) if target else path
        if target.startswith("/") or not resolved.startswith(root + os.sep):
            problems.append(f"{where}: outside the repository (use a path relative to the page)")
        elif not os.path.exists(resolved):
            problems.append(f"{where}: no such file")
        elif anchor and resolved.endswith(".md"):
            with open(resolved, encoding="utf-8") as f:
                if anchor not in anchors(f.read()):
                    problems.append(f"{where}: no heading or anchor #{anchor} in {os.path.relpath(resolved, root)}")
    return problems


def pages(root: str) -> list[str]:
    """README.md and every page under docs/, relative to ``root``."""
    found = glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True)
    return ["README.md", *sorted(os.path.relpath(p, root) for p in found)]
