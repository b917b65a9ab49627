"""The light metrics expose exactly what prometheus_client's would for the same data."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge.light_metrics import LightCounter, LightHistogram

BUCKETS = (0.001, 0.01, 0.1)
VALUES = [0.0005, 0.001, 0.002, 0.01, 0.5, 0.05, 0.05]


def samples(registry: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    out = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out.add((s.name, tuple(sorted(s.labels.items())), round(s.value, 9)))
    return out


def test_histogram_same_exposition_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    light = LightHistogram("x_seconds", "doc", ["backend", "kind"], buckets=BUCKETS, registry=ours)
    reference = Histogram("x_seconds", "doc", ["backend", "kind"], buckets=BUCKETS, registry=theirs)
    light.labels("b1", "a").observe_many(VALUES[:4])
    for v in VALUES[4:]:
        light.labels("b1", "a").observe(v)
    light.labels("b2", "z").observe(2.0)
    for v in VALUES:
        reference.labels("b1", "a").observe(v)
    reference.labels("b2", "z").observe(2.0)
    assert samples(ours) == samples(theirs)


def test_unlabelled_metrics_are_exposed_before_any_update() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    LightHistogram("h_seconds", "doc", buckets=BUCKETS, registry=ours)
    LightCounter("c", "doc", registry=ours).inc(0)
    Histogram("h_seconds", "doc", buckets=BUCKETS, registry=theirs)
    Counter("c", "doc", registry=theirs)
    assert samples(ours) == samples(theirs)


def test_counter_same_exposition_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    light = LightCounter("reqs", "doc", ["route", "status"], registry=ours)
    reference = Counter("reqs", "doc", ["route", "status"], registry=theirs)
    for counter in (light, reference):
        counter.labels("/a", "200").inc()
        counter.labels("/a", "200").inc(2)
        counter.labels("/b", "500").inc()
    plain, plain_ref = (
        LightCounter("gone", "doc", registry=ours),
        Counter("gone", "doc", registry=theirs),
    )
    plain.inc()
    plain_ref.inc()
    assert samples(ours) == samples(theirs)


def test_wrong_label_count_and_duplicate_names_are_refused() -> None:
    registry = CollectorRegistry()
    light = LightCounter("reqs", "doc", ["route"], registry=registry)
    with pytest.raises(ValueError, match="takes labels"):
        light.labels("/a", "200")
    with pytest.raises(ValueError):
        LightCounter("reqs", "doc", ["route"], registry=registry)


def test_a_bound_label_keeps_only_the_children_its_values_name_at_each_scrape() -> None:
    registry = CollectorRegistry()
    live = {"b1", "b2"}
    counter = LightCounter("y", "doc", ["backend", "kind"], registry=registry)
    histogram = LightHistogram("z_seconds", "doc", ["backend"], buckets=BUCKETS, registry=registry)
    for metric in (counter, histogram):
        metric.bound("backend", lambda: live)
    for name in ("b1", "b2"):
        counter.labels(name, "a").inc()
        histogram.labels(name).observe(0.05)
    live = {"b2"}
    names = {(s[0], dict(s[1]).get("backend")) for s in samples(registry)}
    assert names == {("y_total", "b2"), ("z_seconds_bucket", "b2"), ("z_seconds_count", "b2"),
                     ("z_seconds_sum", "b2")}  # fmt: skip
    live = {"b1", "b2"}  # back in the fleet: its series start again from nothing
    counter.labels("b1", "a").inc()
    assert ("y_total", (("backend", "b1"), ("kind", "a")), 1.0) in samples(registry)
