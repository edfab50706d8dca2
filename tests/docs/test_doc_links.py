"""Every relative link in README.md and docs/**/*.md resolves: the file or
folder exists inside the repository, and a #anchor names a heading (GitHub's
anchor rules, tests/support/markdown.py) or an HTML anchor of the target."""

from __future__ import annotations

import os

import pytest

from tests.support import markdown as md
from tests.support.paths import REPO_DIR


@pytest.mark.parametrize("page", md.pages(REPO_DIR))
def test_relative_links_resolve(page):
    assert md.broken_links(os.path.join(REPO_DIR, page), root=REPO_DIR) == []


def test_readme_links_are_checked():
    # The check sees the README's table of contents (the test above cannot
    # pass by finding no links).
    with open(os.path.join(REPO_DIR, "README.md"), encoding="utf-8") as f:
        targets = [link.target for link in md.links(f.read())]
    assert any(t.startswith("#") for t in targets)


def test_readme_links_every_docs_page():
    # The README is the front door: a page it does not link is a page
    # nobody finds.
    with open(os.path.join(REPO_DIR, "README.md"), encoding="utf-8") as f:
        linked = {os.path.normpath(link.target.partition("#")[0]) for link in md.links(f.read())}
    docs = [p for p in md.pages(REPO_DIR) if p != "README.md"]
    assert docs, "no page under docs/: the check would pass on nothing"
    assert sorted(p for p in docs if p not in linked) == []


def test_github_anchor_rules():
    cases = {
        "The daemon: `hwr serve`": "the-daemon-hwr-serve",
        "Source identity (canonical checkpoints → content ids)": "source-identity-canonical-checkpoints--content-ids",
        "DLO runtime: layerwise offload fed from leases (`dlo_runtime`)":
            "dlo-runtime-layerwise-offload-fed-from-leases-dlo_runtime",
        "Measured (CPU device, gloo on 127.0.0.1, 2 shared cores)": "measured-cpu-device-gloo-on-127001-2-shared-cores",
        "**Bold** and [a link](x.md) and <code>tag</code>": "bold-and-a-link-and-tag",
        "Ünïcode — 日本語": "ünïcode--日本語",
    }
    assert {k: md.slug(md.heading_text(k)) for k in cases} == cases


def test_broken_links_are_found(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "sub" / "ok.md").write_text("# Title\n\n## Same\n\n## Same\n\n<a name=\"custom\"></a>\n")
    (tmp_path / "README.md").write_text(
        "# Top\n\nSetext heading\n--------------\n\n"
        "[ok](docs/sub/ok.md#title) [dup](docs/sub/ok.md#same-1) [html](docs/sub/ok.md#custom)\n"
        "[self](#setext-heading) [dir](docs/) [web](https://example.com/x#y) [mail](mailto:a@b)\n"
        "[missing](docs/nope.md) [bad anchor](docs/sub/ok.md#same-2) [self bad](#nowhere)\n"
        "[outside](../elsewhere.md)\n"
        "```\n[in code](not-checked.md)\n# not a heading\n```\n"
        "`[in a span](not-checked.md)`\n"
        "[ref]: docs/also-missing.md\n"
        "<img src=\"docs/missing.png\">\n")
    problems = md.broken_links(str(tmp_path / "README.md"), root=str(tmp_path))
    assert [p.split(": ", 1)[1] for p in problems] == [
        "docs/nope.md: no such file",
        "docs/sub/ok.md#same-2: no heading or anchor #same-2 in docs/sub/ok.md",
        "#nowhere: no heading or anchor #nowhere in README.md",
        "../elsewhere.md: outside the repository (use a path relative to the page)",
        "docs/also-missing.md: no such file",
        "docs/missing.png: no such file",
    ]
    assert "not-a-heading" not in md.anchors((tmp_path / "README.md").read_text())
