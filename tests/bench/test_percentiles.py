"""The percentiles every benchmark reports: one nearest-rank definition, p(q) being the smallest
value with at least q % of the samples at or below it."""

from __future__ import annotations

import pytest

from bench import admission, edge_latency, legs, relay_cli
from bench.summary import nearest_rank
from bench.turns import by_turn
from tools import tracing_overhead

HUNDRED = [float(v) for v in range(1, 101)]


def test_nearest_rank_is_the_smallest_value_covering_q_percent() -> None:
    assert nearest_rank([], 50) is None
    assert nearest_rank([7.0], 99) == 7.0
    assert nearest_rank([2.0, 1.0], 50) == 1.0  # half the samples are at or below 1
    assert nearest_rank(HUNDRED, 50) == 50.0
    assert nearest_rank(HUNDRED, 99) == 99.0  # not the maximum: one sample in 100 lies above
    assert nearest_rank(HUNDRED, 100) == 100.0
    assert nearest_rank([float(v) for v in range(1, 11)], 99) == 10.0  # of 10, the slowest


def test_edge_latency_percentiles_are_nearest_rank() -> None:
    assert edge_latency._pcts(HUNDRED, (50, 90, 99)) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert edge_latency._pcts([1.0, 2.0], (50,)) == {"p50": 1.0}


def test_legs_percentiles_are_nearest_rank() -> None:
    sent = [(f"r{i}", 0.0, 1.0) for i in range(100)]
    stamps = {f"r{i}": ((i + 1) / 1e3, 0.5) for i in range(100)}
    out = legs.legs(sent, stamps)
    assert out["request_leg_ms"] == {
        "p50": pytest.approx(50.0), "p90": pytest.approx(90.0), "p99": pytest.approx(99.0)
    }  # fmt: skip


def test_admission_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 151)]
    assert admission.percentile(values, 0.99) == 149.0  # ceil(148.5): rank 149, not 148


def test_tracing_overhead_percentile_is_nearest_rank() -> None:
    assert tracing_overhead._pct(HUNDRED, 0.99) == 99.0
    assert tracing_overhead._pct(HUNDRED, 0.5) == 50.0


def _turn_records(ttfts: list[float]) -> list[dict[str, object]]:
    return [
        {"config": "c", "turn": 9, "error": None, "ttft_ms": t, "request_bytes": 100} for t in ttfts
    ]


@pytest.mark.parametrize(
    ("ttfts", "p50", "p99"),
    [
        ([float(v) for v in range(1, 11)], 5.0, 10.0),  # was the 6th of 10: round(5.5) == 6
        ([1.0, 2.0], 1.0, 2.0),  # was 2.0: round(1.5) == 2
        (HUNDRED, 50.0, 99.0),  # p99 was the maximum: round(99.5) == 100
    ],
)
def test_turn_percentiles_do_not_round_half_to_even(
    ttfts: list[float], p50: float, p99: float
) -> None:
    (row,) = by_turn(_turn_records(ttfts), [10])
    assert (row["ttft_p50_ms"], row["ttft_p99_ms"]) == (p50, p99)


def test_relay_selftest_percentiles_are_nearest_rank() -> None:
    stats = relay_cli._stats([v / 1000 for v in HUNDRED])  # seconds in, ms out
    assert (stats["p50_ms"], stats["p99_ms"], stats["max_ms"]) == (50.0, 99.0, 100.0)
