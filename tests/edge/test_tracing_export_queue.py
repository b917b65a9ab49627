"""Spans the edge fails to export are counted in `quicedge_trace_spans_dropped_total`: past the
exporter's queue while a collector hangs (the SDK drops the oldest), and in batches a collector
refuses. The SDK itself logs the first loss of each 20 s only and counts them nowhere Prometheus
reads.

The edge's own tracer (`OTEL_TRACES_EXPORTER=otlp`), the real OTLP/HTTP exporter, and a real
socket as the collector: one that never answers, one that answers 400."""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import pytest

from tests.edge.conftest import (
    Recorded,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
    sse_reply,
)
from tests.helpers import wait_until

BODY = {"prompt": "x", "stream": True}
QUEUE = 8


def answer(recorded: Recorded) -> Any:
    return health_ok(recorded) or sse_reply(["hi"])


def dropped(registry: Any, reason: str = "queue_full") -> float:
    sample = registry.get_sample_value("quicedge_trace_spans_dropped_total", {"reason": reason})
    return sample or 0.0


async def test_spans_past_the_queue_of_a_hanging_collector_are_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held: list[asyncio.StreamWriter] = []

    async def hang(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing

    collector = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = collector.sockets[0].getsockname()[1]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", str(QUEUE))
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", str(QUEUE))
    try:
        async with TinyUpstream(answer) as up:
            async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
                for _ in range(12):  # some 8 spans each: past what the queue holds
                    response = await http.post("/v1/completions", json=BODY)
                    assert response.status_code == 200
                assert dropped(edge.registry) > 0
                scrape = await http.get(edge.admin_url + "/metrics")
                assert "quicedge_trace_spans_dropped_total" in scrape.text
                collector.close()  # the exports left fail at once: the stop is quick
                for writer in held:
                    writer.close()
    finally:
        for writer in held:
            writer.close()
        collector.close()


async def test_spans_a_collector_refuses_are_counted_as_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:  # each export: read whole, refused (400: not retried)
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        writer.close()

    collector = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = collector.sockets[0].getsockname()[1]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}/v1/traces")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")
    try:
        async with TinyUpstream(answer) as up:
            async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
                for _ in range(2):
                    response = await http.post("/v1/completions", json=BODY)
                    assert response.status_code == 200
                await wait_until(lambda: dropped(edge.registry, "failed") >= 4)
                assert dropped(edge.registry, "queue_full") == 0
                # the stop's flush blocks this loop, which runs the collector: gone, it fails fast
                collector.close()
    finally:
        collector.close()
