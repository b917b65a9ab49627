"""Every `page.md, "Section"` a doc or a test cites names a heading that page has, so a
citation cannot outlive the section it points to."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CITATION = re.compile(r"(\w+\.md), \"([^\"]+)\"")


def headings(page: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in page.read_text().splitlines() if line[:1] == "#"}


def citations(path: Path) -> list[tuple[str, str]]:
    """The (page, section) pairs cited in a file; a citation may wrap across lines."""
    text = re.sub(r"\s*\n\s*(#\s*)?", " ", path.read_text())
    return CITATION.findall(text)


def test_cited_sections_exist() -> None:
    pages = {page.name: headings(page) for page in DOCS.glob("*.md")}
    sources = [*DOCS.glob("*.md"), ROOT / "README.md", *(ROOT / "tests").rglob("*.py")]
    missing = [
        f"{source.relative_to(ROOT)}: {page}, {section!r}"
        for source in sources
        for page, section in citations(source)
        if page in pages and section not in pages[page]
    ]
    assert missing == []


def test_a_stale_citation_is_found(tmp_path: Path) -> None:
    cited = tmp_path / "x.md"
    cited.write_text('as measured (benchmarks.md,\n"Seventh pass")\n')
    assert citations(cited) == [("benchmarks.md", "Seventh pass")]
    assert "Seventh pass" not in headings(DOCS / "benchmarks.md")
