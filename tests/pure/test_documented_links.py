"""Every relative link of the README, docs/, experiments/README.md and experiments/docs/ leads
somewhere: the file exists, and an anchor names a heading of the page it points into; and every
path of the repository those pages name in code exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.doc_commands import ROOT, pages

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCED = re.compile(r"```.*?```", flags=re.S)
CODE = re.compile(r"```.*?```|`[^`]*`", flags=re.S)
PATH = re.compile(r"\b(?:batcher|gateway|workers|tests|experiments|docs|examples)/[\w./-]*")
PLACEHOLDER = re.compile(r"\b(?:NAME|KIND|FILE|DIR)\b")  # batcher/NAME/mode.py, results/NAME.csv


def anchors(page: Path) -> set[str]:
    """The anchors a page's headings get, as GitHub makes them."""
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", FENCED.sub("", page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        found.add(slug if slug not in found else next(f"{slug}-{n}" for n in range(1, 99)))
    return found


def links() -> list[tuple[str, str]]:
    return [
        (str(page.relative_to(ROOT)), target)
        for page in pages()
        for target in LINK.findall(CODE.sub("", page.read_text()))
        if not re.match(r"[a-z]+:", target)
    ]


@pytest.mark.parametrize(("page", "target"), links())
def test_a_relative_link_leads_to_a_file_and_a_heading(page, target):
    path, _, anchor = target.partition("#")
    into = (ROOT / page).parent / path if path else ROOT / page
    assert into.exists(), f"{page}: {target} leads nowhere"
    if anchor and into.suffix == ".md":
        assert anchor in anchors(into), f"{page}: {target}: no such heading in {path or page}"


def paths() -> list[tuple[str, str]]:
    return sorted(
        {
            (str(page.relative_to(ROOT)), path.rstrip(".").split("::")[0])
            for page in pages()
            for code in re.findall(r"`([^`\n]+)`", page.read_text())
            for path in PATH.findall(code)
            if not PLACEHOLDER.search(path)
        }
    )


@pytest.mark.parametrize(("page", "path"), paths())
def test_a_path_the_documentation_names_exists(page, path):
    assert (ROOT / path).exists() or (ROOT / "experiments" / path).exists(), f"{page}: no {path}"
