"""LightHistogram exposes exactly what prometheus_client's Histogram would for the same data."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge.telemetry import LightHistogram

BUCKETS = (0.001, 0.01, 0.1)
VALUES = [0.0005, 0.001, 0.002, 0.01, 0.5, 0.05, 0.05]


def samples(registry: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    out = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out.add((s.name, tuple(sorted(s.labels.items())), round(s.value, 9)))
    return out


def test_same_exposition_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    light = LightHistogram("x_seconds", "doc", "backend", BUCKETS)
    ours.register(light)
    reference = Histogram("x_seconds", "doc", ["backend"], buckets=BUCKETS, registry=theirs)
    light.labels("b1").observe_many(VALUES[:4])
    for v in VALUES[4:]:
        light.labels("b1").observe(v)
    light.labels("b2").observe(2.0)
    for v in VALUES:
        reference.labels("b1").observe(v)
    reference.labels("b2").observe(2.0)
    assert samples(ours) == samples(theirs)
