"""docs/configuration.md's `[cors]` and `[access_log]` tables name every field of their
sections, and the scalar defaults they state are the code's."""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from edge.access_log import AccessLogConfig
from edge.cors import CorsConfig
from tests.test_docs_defaults import parse_default

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def table(section: str) -> dict[str, str]:
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| `[{section}]` key |"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1]
    return rows


@pytest.mark.parametrize(
    ("section", "kind"), [("cors", CorsConfig), ("access_log", AccessLogConfig)]
)
def test_the_table_is_the_section(section: str, kind: type) -> None:
    rows = table(section)
    assert sorted(rows) == sorted(f.name for f in fields(kind))
    for f in fields(kind):
        default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
        if isinstance(default, bool | int | float) or default == []:
            assert parse_default(rows[f.name]) == default, f"{section}.{f.name}"
