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


def test_scale_out_with_an_instance_per_process_runs_every_session(
    tmp_path: Path, redis_url: str
) -> None:
    argv = ["--out", str(tmp_path), "--parts", "scaleout", "--redis", redis_url, "--duration",
            "1", "--instances", "2", "--workloads", "zipf", "--processes"]  # fmt: skip
    assert main(argv) == 0
    runs = json.loads((tmp_path / "fleet.json").read_text())["scaleout"]
    assert [(r["instances"], r["shared"], r["processes"]) for r in runs] == [
        (2, False, True),
        (2, True, True),
    ]
    # Both children's requests came back: every arrival after the warm-up (a fifth of the run),
    # give or take one at its edge, not the half that one child made.
    from bench.routing import INITIAL_RATE, make_workload

    sessions = make_workload("zipf", INITIAL_RATE["zipf"], 1.0, 1)
    expected = sum(len(p.turns) for p in sessions if p.start >= 0.2)
    for r in runs:
        assert r["errors"] == 0 and abs(r["requests"] - expected) <= 2, (r, expected)
    assert "2 processes" in (tmp_path / "fleet.md").read_text()
