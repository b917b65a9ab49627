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


def test_pooled_figures_take_every_seed_and_compare_on_the_seeds_both_ran() -> None:
    from bench.fleet import ScaleResult, pooled

    def result(instances: int, shared: bool, seed: int, ttfts: list[float]) -> ScaleResult:
        return ScaleResult(
            workload="multiturn", instances=instances, shared=shared, rate=15.0,
            requests=len(ttfts), errors=0, hit_rate=0.5, ttft_p50_ms=0.0, ttft_p99_ms=0.0,
            max_loop_lag_ms=0.0, seed=seed, ttfts_ms=ttfts, cached_tokens=seed,
            prompt_tokens=10,
        )  # fmt: skip

    one = [result(1, False, s, [float(t) for t in range(1, 101)]) for s in (1, 2, 3)]
    # Seed 1's two slowest requests take 300 ms; seed 4 has no one-instance run to compare.
    four = [
        result(4, True, 1, [float(t) for t in range(1, 99)] + [300.0, 300.0]),
        result(4, True, 2, [float(t) for t in range(1, 101)]),
        result(4, True, 4, [1000.0] * 100),
    ]
    rows = {(r["instances"], r["shared"]): r for r in pooled(one + four, resamples=200)}
    alone = rows[(1, False)]
    assert alone["seeds"] == [1, 2, 3] and alone["ttft_p99_ms"] == 99.0
    assert "ratio" not in alone and alone["hit_rate"] == 6 / 30
    shared = rows[(4, True)]
    assert shared["seeds"] == [1, 2, 4] and shared["ttft_p99_ms"] == 1000.0
    # Seeds 1 and 2 together: 200 requests, p99 the third slowest (100 ms against one's 99).
    assert shared["ratio"] == pytest.approx(100 / 99)
    # Resampled, seed 2 twice gives 99 against 99, and seed 1 twice puts 300 ms at p99.
    assert shared["ratio_low"] == pytest.approx(1.0)
    assert shared["ratio_high"] == pytest.approx(300 / 99)


def test_views_choose_the_runs_of_more_than_one_instance(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--out", "x", "--parts", "scaleout", "--redis", "redis://127.0.0.1:1/0"]
    assert parse_args(base).views == [False, True]
    assert parse_args([*base, "--views", "shared"]).views == [True]
    with pytest.raises(SystemExit):
        parse_args([*base, "--views", "both"])
    assert "--views: none, shared or both" in capsys.readouterr().err
