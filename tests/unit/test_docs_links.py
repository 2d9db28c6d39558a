"""The documentation a reader follows: every relative link in the docs and the README reaches a file
and a heading, every `docs/design.md#section` the code cites exists, and nothing sends a reader to
the design documents the project came from, which are not in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    REPO / "README.md",
    REPO / "sdk/python/README.md",
    REPO / "sdk/typescript/README.md",
    *sorted((REPO / "docs").glob("*.md")),
]
# Generated or installed code: the stubs and the TypeScript SDK's dependencies (thousands of files).
_NOT_OURS = {"gen", "_proto", "node_modules", "dist"}
CODE = [
    p
    for root in ("services", "libs", "tools", "sdk", "protos", "bench", "tests")
    for p in sorted((REPO / root).rglob("*"))
    if p.suffix in (".py", ".proto", ".ts") and not _NOT_OURS & set(p.relative_to(REPO).parts)
    if p != Path(__file__).resolve()  # it names what it looks for
]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_DESIGN_REF = re.compile(r"docs/design\.md#([a-z0-9-]+)")
_SEED = re.compile(r"\bseeds?\s+00\d|\bseed 000\b|seeds/", re.IGNORECASE)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_heading(doc):
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        path = (doc.parent / file) if file else doc
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(target)
    assert not broken, f"{doc.name}: {broken}"


def test_the_codes_design_references_name_existing_sections():
    sections = anchors(REPO / "docs/design.md")
    cited = {(p.relative_to(REPO).as_posix(), a) for p in CODE for a in _DESIGN_REF.findall(p.read_text())}
    assert cited, "the code cites docs/design.md"
    assert not [c for c in cited if c[1] not in sections]


@pytest.mark.parametrize("path", DOCS + CODE, ids=lambda p: p.relative_to(REPO).as_posix())
def test_nothing_sends_a_reader_to_the_original_design_documents(path):
    lines = [
        i + 1 for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()) if _SEED.search(line)
    ]
    assert not lines, f"{path.relative_to(REPO)} lines {lines}"
