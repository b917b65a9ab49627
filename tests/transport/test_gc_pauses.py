"""`transport.gc_pauses`: each garbage collection's pause, by generation."""

from __future__ import annotations

import contextlib
import gc
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry

from tests.helpers import free_port
from tests.transport.conftest import ServeProcess
from transport.gc_pauses import GcPauseProbe
from transport.metrics import TransportMetrics


class Cycle:
    def __init__(self) -> None:
        self.me = self
        self.payload = [object() for _ in range(100)]


def count(registry: CollectorRegistry, generation: str) -> float:
    value = registry.get_sample_value("quicedge_gc_pause_seconds_count", {"generation": generation})
    return value or 0.0


def test_a_full_collection_is_timed_under_generation_2() -> None:
    registry = CollectorRegistry()
    probe = GcPauseProbe(TransportMetrics(registry).gc_pauses)
    enabled = gc.isenabled()
    gc.disable()  # only the collection below: none set off by the allocations
    probe.start()
    try:
        garbage = [Cycle() for _ in range(20000)]  # tracked objects a collection must walk
        del garbage
        gc.collect()
    finally:
        probe.stop()
        probe.stop()  # idempotent
        if enabled:
            gc.enable()
    assert count(registry, "2") == 1
    total = registry.get_sample_value("quicedge_gc_pause_seconds_sum", {"generation": "2"})
    assert total is not None and total > 0
    gc.collect()  # stopped: not counted
    assert count(registry, "2") == 1


def test_young_collections_are_timed_under_their_generation() -> None:
    registry = CollectorRegistry()
    probe = GcPauseProbe(TransportMetrics(registry).gc_pauses)
    probe.start()
    try:
        for _ in range(5):
            gc.collect(0)
    finally:
        probe.stop()
    assert count(registry, "0") >= 5


def test_serve_times_its_collections(serve_process) -> None:
    """`serve` sets a young threshold of 10,000 tracked objects, which steady serving does not
    reach; a request body that is 20,000 nested arrays (parsed before anything else looks at
    it) holds more than that at once, and sets off a collection that the histogram counts."""
    http_port = free_port()
    server: ServeProcess = serve_process(
        "--backend", "http://127.0.0.1:9", "--http", f"127.0.0.1:{http_port}"
    )
    assert server.metric('quicedge_gc_pause_seconds_count{generation="0"}') == 0
    body = b'{"model": "default", "prompt": "hi", "nested": [' + b",".join([b"[]"] * 20_000) + b"]}"
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    with contextlib.suppress(urllib.error.HTTPError):  # no backend: the answer is an error
        urllib.request.urlopen(request, timeout=10).close()
    server.wait_metric('quicedge_gc_pause_seconds_count{generation="0"}', 1)
    assert server.stop() == 0
