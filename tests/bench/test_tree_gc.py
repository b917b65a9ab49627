"""`bench.tree_gc`: it fills a tree past its budget and reports what the collector did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tree_gc


def test_a_small_run_fills_the_tree_and_writes_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tree_gc.json"
    argv = ["--requests", "400", "--max-chars", "30000", "--groups", "4", "--json", str(out)]
    assert tree_gc.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 400
    assert 0 < result["tree_chars"] <= 30000 and result["evicted_chars"] > 0
    assert result["nodes"] > 0 and result["tree_us_per_request"] > 0
    assert result["tracked_objects"] < 100  # the tree's layout keeps it out of the collector
    for part in ("collections", "collections_last_quarter"):
        assert set(result[part]) == {"0", "1", "2"}
    printed = capsys.readouterr().out
    assert "400 requests; tree" in printed and "| last quarter | 2 |" in printed


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        tree_gc.main(["--requests", "0"])
    assert exited.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err
