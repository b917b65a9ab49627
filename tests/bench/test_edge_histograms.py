"""The edge's own histograms, read back from an exposition as Prometheus would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bench.edge_histograms import ADDED, RELAY_DELAY, delta, parse, quantile, summary
from edge.light_metrics import LightHistogram
from transport.metrics import TransportMetrics

BUCKETS = (0.001, 0.002, 0.005)


def exposition(added: list[float], relay: dict[str, list[float]]) -> str:
    registry = CollectorRegistry()
    a = LightHistogram(ADDED, "doc", ["transport"], buckets=BUCKETS, registry=registry)
    r = LightHistogram(RELAY_DELAY, "doc", ["transport"], buckets=BUCKETS, registry=registry)
    a.labels("h1").observe_many(added)
    for transport, values in relay.items():
        r.labels(transport).observe_many(values)
    return generate_latest(registry).decode()


def test_quantiles_interpolate_within_buckets() -> None:
    # 10 observations: 4 in (0, 1 ms], 4 in (1, 2 ms], 2 in (2, 5 ms]
    buckets = parse(exposition([0.0005] * 4 + [0.0015] * 4 + [0.003] * 2, {}))[ADDED]
    assert quantile(buckets, 0.5) == pytest.approx(0.00125)  # rank 5: a quarter into (1, 2]
    assert quantile(buckets, 0.2) == pytest.approx(0.0005)
    assert quantile(buckets, 1.0) == pytest.approx(0.005)
    assert quantile({}, 0.5) is None


def test_beyond_the_last_bound_is_that_bound() -> None:
    buckets = parse(exposition([0.5, 0.5], {}))[ADDED]
    assert quantile(buckets, 0.99) == pytest.approx(0.005)


def test_label_sets_are_summed_and_a_run_is_the_difference() -> None:
    before = parse(exposition([0.0005], {"h1": [0.0005], "h3": [0.004]}))
    after = parse(exposition([0.0005, 0.0015, 0.0015], {"h1": [0.0005, 0.0015], "h3": [0.004]}))
    run = summary(delta(after, before))
    assert run["requests"] == 2 and run["chunks"] == 1
    assert run["added_p50"] == pytest.approx(1.5)  # ms: both in (1, 2 ms], rank 1 of 2
    assert run["relay_delay_p99"] == pytest.approx(1.99)
    empty = summary(delta(before, before))
    assert empty["added_p50"] is None and empty["requests"] == 0


def test_the_loops_read_delay_is_read_from_the_transport_metrics() -> None:
    registry = CollectorRegistry()
    metrics = TransportMetrics(registry)
    for value in (0.0002, 0.0002, 0.004):
        metrics.read_delay.observe(value)
    run = summary(parse(generate_latest(registry).decode()))
    assert run["read_delay_p50"] == pytest.approx(0.1 + 0.15 * (1.5 / 2))  # ms, in (0.1, 0.25]
    assert run["read_delay_p99"] is not None and run["read_delay_p99"] > 3
    assert run["added_p50"] is None  # no requests in this exposition


def test_garbage_collections_are_counted_with_the_longest() -> None:
    registry = CollectorRegistry()
    metrics = TransportMetrics(registry)
    for generation, value in (("0", 0.00004), ("0", 0.0002), ("2", 0.03)):
        metrics.gc_pauses.labels(generation).observe(value)
    run = summary(parse(generate_latest(registry).decode()))
    assert run["gc_pauses"] == 3
    assert run["gc_pause_max"] == pytest.approx(50.0)  # ms: the bound of the (25, 50 ms] bucket
    assert summary(parse(""))["gc_pauses"] == 0
