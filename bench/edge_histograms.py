"""The edge's own view of what it adds, from the histograms on its admin `/metrics`.

A client can only see the edge's contribution as a difference of two measurements (through the
edge minus direct), and on a small machine both carry the noise of the client and the backend
sharing cores. The edge also times itself from its own socket reads to its own writes:
`quicedge_edge_added_seconds` per request (the request's read to its upstream send, plus the
first token's read from the backend to its hand-over to the client) and
`quicedge_relay_delay_seconds` per streamed content chunk. Scraping them before and after a run
gives that run's distribution; quantiles are interpolated within buckets, as Prometheus'
`histogram_quantile` does. Outside these numbers: the kernel's loopback hops, and the time a
request or a token waits in the kernel before the edge reads it, which grows while the edge's
event loop is busy. `quicedge_loop_read_delay_seconds` samples that wait (a probe byte on a
socket, ~10 a second), and `bench.legs` measures it per request from the client's and the
stand-in's stamps. `quicedge_gc_pause_seconds` times each garbage collection: a long one stalls
every request in flight.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

ADDED = "quicedge_edge_added_seconds"
RELAY_DELAY = "quicedge_relay_delay_seconds"
READ_DELAY = "quicedge_loop_read_delay_seconds"
GC_PAUSE = "quicedge_gc_pause_seconds"

Buckets = dict[float, float]
"""Cumulative count per upper bound (`le`), summed over every label set."""


def parse(
    text: str, names: tuple[str, ...] = (ADDED, RELAY_DELAY, READ_DELAY, GC_PAUSE)
) -> dict[str, Buckets]:
    out: dict[str, Buckets] = {name: {} for name in names}
    for family in text_string_to_metric_families(text):
        if family.name not in out:
            continue
        buckets = out[family.name]
        for s in family.samples:
            if s.name == family.name + "_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return out


def scrape(url: str, timeout: float = 5.0) -> dict[str, Buckets]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse(response.read().decode())


def delta(after: Mapping[str, Buckets], before: Mapping[str, Buckets]) -> dict[str, Buckets]:
    return {
        name: {le: count - before.get(name, {}).get(le, 0.0) for le, count in buckets.items()}
        for name, buckets in after.items()
    }


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile (0..1), linear within its bucket; None when there are no observations.
    Past the last finite bound it is that bound (Prometheus does the same)."""
    bounds = sorted(buckets)
    total = buckets.get(float("inf"), buckets[bounds[-1]] if bounds else 0.0)
    if total <= 0:
        return None
    rank = q * total
    low, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return low
            inside = count - below
            return low + (le - low) * ((rank - below) / inside if inside else 1.0)
        low, below = le, count
    return low


def summary(d: Mapping[str, Buckets]) -> dict[str, float | None]:
    """Milliseconds: the added TTFT, the relay delay and the read delay at p50 and p99, and
    their counts; the garbage collections, and the bucket bound of the longest (`gc_pause_max`)."""

    def ms(name: str, q: float) -> float | None:
        value = quantile(d.get(name, {}), q)
        return None if value is None else value * 1e3

    return {
        "added_p50": ms(ADDED, 0.5),
        "added_p99": ms(ADDED, 0.99),
        "relay_delay_p50": ms(RELAY_DELAY, 0.5),
        "relay_delay_p99": ms(RELAY_DELAY, 0.99),
        "read_delay_p50": ms(READ_DELAY, 0.5),
        "read_delay_p99": ms(READ_DELAY, 0.99),
        "requests": d.get(ADDED, {}).get(float("inf"), 0.0),
        "chunks": d.get(RELAY_DELAY, {}).get(float("inf"), 0.0),
        "gc_pauses": d.get(GC_PAUSE, {}).get(float("inf"), 0.0),
        "gc_pause_max": ms(GC_PAUSE, 1.0),
    }
