"""The fleet benchmark's command line and its report (no timing is asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fleet import main, parse_args


def test_bad_arguments_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--out", "x", "--parts", "cost,nope"], ["--out", "x", "--parts", "scaleout"], []):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown ['nope']" in err and "needs --redis" in err


def test_the_cost_part_writes_its_report(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "--parts", "cost"]) == 0
    cost = json.loads((tmp_path / "fleet.json").read_text())["cost"]
    assert cost["choose_with_hot_and_view_us"] > 0 and cost["block_hashes_us"] > 0
    assert "Request-path cost" in (tmp_path / "fleet.md").read_text()
