"""Every relative link in README.md and docs/*.md leads somewhere: the file exists and, for a
``#anchor``, the target page has a heading with that anchor under GitHub's rules. Sections
move between pages; a link left pointing at the old page fails here, not in a reader's
browser. The tests cite the documentation the same way, as ``docs/page.md "Section"`` in
comments and docstrings: each such section must exist too. Pure Python: no process, no build.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
TEST_SOURCES = sorted(p for p in (REPO_ROOT / "tests").rglob("*.py") if p != Path(__file__).resolve())

FENCE = re.compile(r"^\s*(```|~~~)")
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) or ![alt](target), with an optional "title"; text may hold `code`.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (code spans, links and emphasis
    reduced to their text), lowercased, every character but letters, digits, ``-``, ``_``
    and spaces dropped, each space a ``-``."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub gives the page: one per heading, duplicates numbered -1, -2, ..."""
    seen: Counter[str] = Counter()
    found = set()
    for _, line in prose_lines(page.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        match = ATX_HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link outside code."""
    found = []
    for number, line in prose_lines(page.read_text()):
        line = INLINE_CODE.sub("", line)
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # https:, mailto:, ...
            found.append((number, target))
    return found


def test_slug_follows_githubs_rules() -> None:
    assert slug("Store fields (cluster mode)") == "store-fields-cluster-mode"
    assert slug("Recipes: keys from the request itself") == "recipes-keys-from-the-request-itself"
    assert slug("Configuration pushes, restarts and drains") == "configuration-pushes-restarts-and-drains"
    assert slug("Istio's Envoy versions") == "istios-envoy-versions"
    assert slug("The `record` command") == "the-record-command"
    assert slug("A -- B") == "a----b"


def test_the_pages_have_links_to_check() -> None:
    assert README in PAGES and len(PAGES) >= 5
    assert sum(len(links(page)) for page in PAGES) > 50


def test_the_readme_is_a_front_page_that_links_every_docs_page() -> None:
    """The reference lives under docs/; the README stays short and names every page of it."""
    assert len(README.read_text().splitlines()) < 300
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in links(README)}
    unlisted = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlisted, f"README.md does not link these docs pages: {unlisted}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for number, target in links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(REPO_ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where}: no such file")
        elif anchor:
            if dest.suffix != ".md":
                broken.append(f"{where}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(dest):
                broken.append(f"{where}: {dest.relative_to(REPO_ROOT)} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


# docs/guarantees.md "Unknown outcomes", or README "Try it", in a comment or docstring that
# may wrap the section's name over two lines.
SECTION_REFERENCE = re.compile(r'\b(docs/[\w-]+\.md|README(?:\.md)?)(?:\'s)?,? "([^"]+)"')


def section_references(source: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", source.read_text())
    return SECTION_REFERENCE.findall(text)


def test_sections_the_tests_cite_exist() -> None:
    cited, missing = 0, []
    for source in TEST_SOURCES:
        for page, section in section_references(source):
            cited += 1
            target = README if page.startswith("README") else REPO_ROOT / page
            if not target.exists() or slug(section) not in anchors(target):
                missing.append(f"{source.relative_to(REPO_ROOT)}: {page} \"{section}\"")
    assert cited > 20
    assert not missing, "no such section:\n" + "\n".join(missing)
