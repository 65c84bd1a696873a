"""The docs a user reads: every relative link of README.md, docs/*.md and the result files they quote
(bench/results/*.md) reaches a file of the repository (and a heading of it, for an #anchor), and every `make` target,
repository path (stages/, src/, bench/, scripts/, ...) and `python -m` module they name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench/results").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings."""
    headings = (line.lstrip("#").strip().lower() for line in page.read_text().splitlines() if line.startswith("#"))
    return {re.sub(r"[^\w\- ]", "", heading).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_reaches_a_file_and_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_every_make_target_the_docs_name_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))
    named = {name for page in PAGES for name in re.findall(r"`make ([\w-]+)", page.read_text())}
    assert named - targets == set(), "named in the docs but not in the Makefile"


# A file or folder of the repository as the docs name it (outputs of a run, such as data/ or models/, are not checked;
# nor are patterns, paths with a <placeholder>, * or {).
REPO_PATH = re.compile(r"(?<![\w./-])((?:stages|src|bench|scripts|tests|docs|profiles|\.ci)/[\w./-]*)(?![\w./<*{-])")
MODULE = re.compile(r"python -m (coarse2fine(?:\.\w+)*)")


def test_every_repository_path_and_module_the_docs_name_exists():
    missing = set()
    for page in PAGES:
        text = page.read_text()
        for path in REPO_PATH.findall(text):
            if not (ROOT / path.rstrip(".")).exists():
                missing.add(f"{page.relative_to(ROOT)}: {path}")
        for module in MODULE.findall(text):
            file = ROOT / "src" / module.replace(".", "/")
            if not (file.with_suffix(".py").is_file() or (file / "__main__.py").is_file()):
                missing.add(f"{page.relative_to(ROOT)}: python -m {module}")
    assert not missing, sorted(missing)
