"""The settings the docs state are the code's: docs/configuration.md's `[proxy]` table against
`ProxyConfig` and the `serve` flags, and every "`key` (default)" the docs write elsewhere."""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from edge.config import ProxyConfig
from edge.wiring import add_arguments

DOCS = Path(__file__).resolve().parent.parent / "docs"
UNITS = {"s": 1.0, "ms": 1e-3, "KiB": 1024, "MiB": 1024 * 1024}
_VALUE = re.compile(r"(?P<number>-?\d+(?:\.\d+)?)(?: (?P<unit>s|ms|KiB|MiB))?")


def parse_default(text: str) -> Any:
    """A default as the docs write it: `2 s`, `8 MiB`, `0.95`, `none`, `false`, `` `ttft` ``."""
    text = text.strip()
    if text in ("none", "off"):
        return None
    if text in ("true", "false"):
        return text == "true"
    if text == "`[]`":
        return []
    if text == "`{}`":
        return {}
    if text.startswith("`") and text.endswith("`"):
        return text[1:-1]
    match = _VALUE.fullmatch(text)
    assert match is not None, f"not a default the docs may write: {text!r}"
    unit = match["unit"]
    if unit is None:
        return float(match["number"]) if "." in match["number"] else int(match["number"])
    number = float(match["number"]) * UNITS[unit]
    return int(number) if unit in ("KiB", "MiB") else number


def proxy_table() -> list[dict[str, str]]:
    """The rows of docs/configuration.md's table whose first header is the `[proxy]` key."""
    lines = (DOCS / "configuration.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| `[proxy]` key |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def code_defaults() -> dict[str, Any]:
    out = {}
    for f in fields(ProxyConfig):
        if not f.metadata.get("load", True):
            continue  # a feature section carried on ProxyConfig, documented with its feature
        out[f.name] = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
    return out


def test_the_table_names_every_setting_once_with_the_codes_default() -> None:
    rows = proxy_table()
    keys = [row["`[proxy]` key"].strip("`") for row in rows]
    defaults = code_defaults()
    assert sorted(keys) == sorted(defaults), "the table and ProxyConfig list different settings"
    for row, key in zip(rows, keys, strict=True):
        stated = parse_default(row["default"])
        assert stated == defaults[key], f"{key}: docs {stated!r}, code {defaults[key]!r}"


def test_the_tables_flags_set_their_keys() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # The settings loader names each flag's destination after its section: `proxy.backends`.
    dest_of = {
        flag: action.dest.removeprefix("proxy.")
        for action in parser._actions
        for flag in action.option_strings
    }
    for row in proxy_table():
        key = row["`[proxy]` key"].strip("`")
        flags = re.findall(r"`(--[a-z0-9-]+)", row["flag"])
        if row["flag"] == "(TOML only)":
            assert key not in dest_of.values(), f"{key} has a flag the table does not name"
            continue
        assert flags, f"{key}: no flag named"
        for flag in flags:
            assert dest_of.get(flag) == key, f"{flag} does not set {key}"


@pytest.mark.parametrize("doc", sorted(p.name for p in DOCS.glob("*.md")))
def test_defaults_quoted_in_prose_are_the_codes(doc: str) -> None:
    """Where a doc writes a setting and its default, "`health_interval` (2 s)", it is the code's."""
    defaults = code_defaults()
    text = (DOCS / doc).read_text()
    for key, stated in re.findall(r"`(\w+)` \((-?\d[^)]*|none|off|true|false)\)", text):
        if key in defaults:
            assert parse_default(stated) == defaults[key], f"{doc}: `{key}` ({stated})"


def test_a_wrong_default_is_caught() -> None:
    """The comparison can fail: units and numbers are read, not matched as text."""
    assert parse_default("2 s") == 2.0 != parse_default("5 s")
    assert parse_default("8 MiB") == 8 * 1024 * 1024
    assert parse_default("0.95") == 0.95 and parse_default("128") == 128
    assert parse_default("none") is None and parse_default("`ttft`") == "ttft"
    with pytest.raises(AssertionError):
        parse_default("two seconds")
