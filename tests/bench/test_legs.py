"""`bench.legs`: joining the client's stamps with the stand-in's, per request."""

from __future__ import annotations

import pytest

from bench.legs import added, legs


def test_each_request_splits_into_its_two_legs() -> None:
    sent = [("a", 10.000, 10.010), ("b", 20.000, 20.030), ("gone", 30.0, 30.1)]
    stamps = {"a": (10.002, 10.007), "b": (20.004, None), "other": (1.0, 2.0)}
    out = legs(sent, stamps)
    assert out["joined"] == 2  # "gone" was never recorded by the stand-in
    request, response = out["request_leg_ms"], out["response_leg_ms"]
    assert request["p50"] == pytest.approx(2.0) and request["p99"] == pytest.approx(4.0)
    assert sorted(request) == ["p50", "p90", "p99"]
    # "b" produced no first token: it has a request leg only
    assert response == dict.fromkeys(("p50", "p90", "p99"), pytest.approx(3.0))
    assert out["both_legs_ms"] == dict.fromkeys(("p50", "p90", "p99"), pytest.approx(5.0))


def test_both_legs_are_summed_per_request_not_per_percentile() -> None:
    # one request slow on the way in, another on the way out: no request is slow on both
    sent = [("in", 0.0, 0.012), ("out", 1.0, 1.012)]
    stamps = {"in": (0.010, 0.011), "out": (1.001, 1.002)}
    out = legs(sent, stamps)
    assert out["request_leg_ms"]["p99"] == pytest.approx(10.0)
    assert out["response_leg_ms"]["p99"] == pytest.approx(10.0)
    assert out["both_legs_ms"]["p99"] == pytest.approx(11.0)  # not 20


def test_added_is_the_difference_per_leg_and_percentile() -> None:
    base = {
        "request_leg_ms": {"p50": 1.0, "p99": 2.0}, "response_leg_ms": {"p50": 0.5, "p99": 1.0},
        "both_legs_ms": {"p50": 1.5, "p99": 2.5},
    }  # fmt: skip
    edge = {
        "request_leg_ms": {"p50": 1.5, "p99": 4.0}, "response_leg_ms": None,
        "both_legs_ms": {"p50": 2.0, "p99": 3.0},
    }  # fmt: skip
    assert added(edge, base) == {
        "request_p50": 0.5, "request_p99": 2.0, "response_p50": None, "response_p99": None,
        "both_p50": 0.5, "both_p99": 0.5,
    }  # fmt: skip


def test_nothing_joined_gives_no_percentiles() -> None:
    assert legs([("x", 1.0, 2.0)], {}) == {
        "joined": 0, "request_leg_ms": None, "response_leg_ms": None, "both_legs_ms": None,
    }  # fmt: skip
