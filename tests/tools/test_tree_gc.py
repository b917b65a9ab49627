"""`tools.tree_gc`: it fills a tree past its budget and reports what the collector did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools.conftest import FakeValgrind
from tools import tree_gc


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


def test_instructions_are_the_difference_of_a_run_with_the_tree_and_one_without(
    fake_valgrind: FakeValgrind, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_valgrind("--no-tree", 1_000_000, 5_000_000)
    assert tree_gc.main(["--requests", "200", "--instructions"]) == 0
    out = capsys.readouterr().out  # (5M - 1M) over 200 requests
    assert out.startswith("tree instructions per request: 20000 (match + 2 inserts, 200")


def test_instructions_need_valgrind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert tree_gc.main(["--instructions"]) == 1
    assert "needs valgrind" in capsys.readouterr().err


def test_without_the_tree_the_texts_are_made_but_nothing_is_learned(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert tree_gc.main(["--requests", "50", "--no-tree"]) == 0
    assert "50 requests; tree 0 of" in capsys.readouterr().out


def test_the_json_names_the_command_that_produced_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", ["pytest", "--something-else"])
    out = tmp_path / "a dir" / "tree gc.json"
    out.parent.mkdir()
    assert tree_gc.main(["--requests", "20", "--no-tree", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"] == f"python -m tools.tree_gc --requests 20 --no-tree --json '{out}'"
    assert result["requests"] == 20
