"""The routing benchmark's command line and its target checks (no timing is asserted here)."""

from __future__ import annotations

import pytest

from bench.routing import RunResult, make_workload, parse_args, targets


def test_bad_arguments_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--out", "x", "--workloads", "uniform,nope"],
        ["--out", "x", "--policies", "fastest"],
        ["--out", "x", "--duration", "0"],
        ["--out", "x", "--rate", "-1"],
        [],
    ):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2
    assert "unknown ['nope']" in capsys.readouterr().err


def test_workloads_are_deterministic_and_shaped() -> None:
    a = make_workload("zipf", 50.0, 4.0, seed=3)
    assert a == make_workload("zipf", 50.0, 4.0, seed=3)
    assert 120 < len(a) < 280  # about rate x duration Poisson arrivals
    hot = sum(1 for p in a if p.group == 0) / len(a)
    assert 0.45 < hot < 0.8  # Zipf(2) over 32 groups: the hottest carries ~62 %
    chat = make_workload("multiturn", 5.0, 4.0, seed=3)
    assert all(4 <= len(p.turns) <= 6 and p.key for p in chat)
    assert len({p.system for p in chat}) == 1  # one shared system prompt
    with pytest.raises(ValueError):
        make_workload("nope", 1.0, 1.0, seed=0)


def result(workload: str, policy: str, p99: float, hit: float) -> RunResult:
    return RunResult(workload=workload, policy=policy, rate=1.0, requests=10, errors=0,
                     hit_rate=hit, ttft_p50_ms=1.0, ttft_p90_ms=1.0, ttft_p99_ms=p99,
                     ttft_mean_ms=1.0, throughput_rps=1.0, output_tok_s=1.0, busy=0.7,
                     active=0.9, share={}, reasons={}, wall_s=1.0)  # fmt: skip


def test_targets_follow_the_issue() -> None:
    checks = targets([
        result("zipf", "ttft", 100, 0.80), result("zipf", "cache_aware", 150, 0.82),
        result("unique", "ttft", 100, 0.0), result("unique", "round_robin", 99, 0.0),
        result("uniform", "ttft", 100, 0.90), result("uniform", "cache_aware", 90, 0.95),
    ])  # fmt: skip
    met = {(c["workload"], c["target"]): c["met"] for c in checks}
    assert met[("zipf", "p99 >= 30 % lower")] is True  # 33 % lower
    assert met[("zipf", "hit rate at most 3 points lower")] is True
    assert met[("unique", "p99 no worse")] is True  # within the 5 % allowance
    assert met[("uniform", "p99 no worse")] is False
    assert met[("uniform", "hit rate at most 3 points lower")] is False
