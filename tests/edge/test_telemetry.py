"""Spans reach an in-memory exporter with the stage structure and attributes; W3C trace context
flows from the client through the edge to the backend; deferred 0-RTT waits become a span."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

from opentelemetry.trace import SpanKind

from backends.sim import SimConfig, SimServer
from edge.tracing import SHUTDOWN_TIMEOUT_S, tracer_from_env
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

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
STAGES = {
    "parse",
    "admit",
    "route",
    "upstream_connect",
    "upstream_first_byte",
    "first_byte_to_client",
    "stream_end",
    "POST /v1/chat/completions",  # the upstream attempt, a CLIENT span
}


def roots_of(spans: Any) -> list[Any]:
    """The finished request spans of an in-memory exporter."""
    return [s for s in spans.get_finished_spans() if s.name == "quicedge.request"]


async def test_a_streamed_request_has_a_span_per_stage_with_attributes() -> None:
    config = SimConfig(name="b1", port=0, profile="instant", enable_cache_report=True)
    async with SimServer(config) as server:
        async with run_edge(fast_config([server.url]), trace=True) as edge, client(edge) as http:
            body = {
                "model": "default",
                "messages": [{"role": "user", "content": "trace me"}],
                "stream": True,
                "max_tokens": 4,
                "stream_options": {"include_usage": True},
            }
            for _ in range(2):  # the second finds its prompt cached
                response = await http.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={
                        "traceparent": TRACEPARENT,
                        "x-request-id": "t-1",
                        "x-tenant-id": "acme",
                    },
                )
                assert response.status_code == 200
            # the root span ends right after the last byte
            assert edge.spans is not None
            await wait_until(lambda: len(roots_of(edge.spans)) == 2)
    spans = edge.spans.get_finished_spans()
    roots = roots_of(edge.spans)
    root = roots[1]
    children = [
        s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id
    ]
    assert {s.name for s in children} == STAGES
    assert root.kind is SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID
    for span in children:
        assert span.parent is not None and span.parent.span_id == root.context.span_id
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time
    attrs = dict(root.attributes or {})
    backend = edge.wiring.registry.backends[0].name
    assert attrs["quicedge.transport"] == "h1"
    assert attrs["quicedge.early_data"] is False
    assert attrs["quicedge.backend"] == backend
    assert attrs["quicedge.policy"] == "round_robin"
    assert attrs["quicedge.request_id"] == "t-1"
    assert attrs["quicedge.tenant"] == "anonymous"  # the admitted tenant, not x-tenant-id
    prompt = attrs["gen_ai.usage.input_tokens"]
    assert isinstance(prompt, int) and prompt > 0
    assert 0 < attrs["quicedge.cached_tokens"] < prompt
    assert attrs["gen_ai.usage.output_tokens"] == 4
    # OpenTelemetry's HTTP and GenAI semantic conventions
    assert attrs["http.response.status_code"] == 200
    assert attrs["http.request.method"] == "POST"
    assert attrs["http.route"] == attrs["url.path"] == "/v1/chat/completions"
    assert attrs["network.protocol.version"] == "1.1"
    assert attrs["server.address"] == "127.0.0.1" and isinstance(attrs["server.port"], int)
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "sglang"
    assert attrs["gen_ai.request.model"] == "default"
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.response.model"] == config.model_name
    assert "http.status_code" not in attrs
    by_name = {s.name: s for s in children}
    upstream = by_name["POST /v1/chat/completions"]
    assert upstream.kind is SpanKind.CLIENT
    up = dict(upstream.attributes or {})
    assert up["http.response.status_code"] == 200
    assert up["server.address"] == "127.0.0.1" and up["server.port"] == server.port
    assert up["url.full"] == f"{server.url}/v1/chat/completions"
    assert upstream.start_time <= by_name["upstream_connect"].end_time
    assert dict(by_name["upstream_connect"].attributes or {})["quicedge.reused"] in (True, False)
    assert dict(by_name["route"].attributes or {})["quicedge.backend"] == backend


async def test_traceparent_sent_upstream_continues_the_clients_trace() -> None:
    def answer(recorded: Recorded) -> Any:
        return health_ok(recorded) or sse_reply(["hi"])

    async with TinyUpstream(answer) as up:
        async with run_edge(fast_config([up.url]), trace=True) as edge, client(edge) as http:
            body = {"prompt": "x", "stream": True}
            response = await http.post(
                "/v1/completions", json=body, headers={"traceparent": TRACEPARENT}
            )
            assert response.status_code == 200
            assert edge.spans is not None
            await wait_until(lambda: len(roots_of(edge.spans)) == 1)
    (sent,) = [r for r in up.requests if r.path == "/v1/completions"]
    version, trace_id, span_id, flags = sent.headers["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert edge.spans is not None
    (root,) = [s for s in edge.spans.get_finished_spans() if s.name == "quicedge.request"]
    (attempt,) = [s for s in edge.spans.get_finished_spans() if s.kind is SpanKind.CLIENT]
    # the backend's parent is the edge's attempt, itself a child of the request
    assert span_id == format(attempt.context.span_id, "016x") != PARENT_ID
    assert attempt.parent is not None and attempt.parent.span_id == root.context.span_id


async def test_deferred_early_data_wait_is_a_span_and_a_metric() -> None:
    async with TinyUpstream(lambda r: health_ok(r) or sse_reply(["ok"])) as up:
        async with run_edge(fast_config([up.url]), trace=True) as edge:
            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/completions",
                "http_version": "3",
                "headers": [(b"content-type", b"application/json")],
                "extensions": {"transport": "h3", "early_data": False, "handshake_wait_s": 0.05},
            }
            messages = [{"type": "http.request", "body": json.dumps({"prompt": "x"}).encode()}]
            sent: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop(0)
                await asyncio.Event().wait()
                raise AssertionError("unreachable")

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            await edge.wiring.app(scope, receive, send)
            assert sent[0]["status"] == 200
            samples = edge.registry.get_sample_value(
                "quicedge_early_data_handshake_wait_seconds_count"
            )
            assert samples == 1.0
    assert edge.spans is not None
    spans = {s.name: s for s in edge.spans.get_finished_spans()}
    wait = spans["handshake_wait"]
    # Span times are integer nanoseconds converted from float seconds: allow rounding.
    assert abs((wait.end_time - wait.start_time) - 50_000_000) <= 1_000
    assert wait.end_time <= spans["parse"].start_time


async def test_no_tracer_when_tracing_is_off(monkeypatch: Any) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    async with TinyUpstream(lambda r: health_ok(r) or sse_reply(["ok"])) as up:
        async with run_edge(fast_config([up.url]), start=False) as edge:
            assert edge.wiring.tracing.tracer is None
            assert edge.wiring.app.tracer is None  # type: ignore[attr-defined]


def test_a_collector_that_hangs_does_not_hold_the_stop(monkeypatch: Any) -> None:
    """The SDK's shutdown waits for the export in progress (up to its 10 s timeout), then
    exports every batch left, each as long, up to 30 s in all: past the pod's grace period.
    The stop waits SHUTDOWN_TIMEOUT_S (here 0.2 s) for it; the spans not out by then are
    dropped."""
    listener = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{listener.getsockname()[1]}"
    )
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "60")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")  # ms: the first export starts at once
    setup = tracer_from_env(environ={"OTEL_TRACES_EXPORTER": "otlp"})
    try:
        assert setup.tracer is not None
        for _ in range(3):
            setup.tracer.start_span("quicedge.request").end()
        deadline = time.monotonic() + 10
        while not held:  # the export is under way, and waits on the collector
            assert time.monotonic() < deadline, "the exporter never connected"
            time.sleep(0.01)
        stop = threading.Thread(target=setup.shutdown, args=(0.2,), daemon=True)
        stop.start()
        stop.join(SHUTDOWN_TIMEOUT_S + 10)  # the export waits 60 s
        assert not stop.is_alive(), "the stop waited for the collector"
    finally:
        # The collector answers at last: the export left behind ends, and logs nothing later.
        for conn in held:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        for thread in threading.enumerate():
            if thread.name == "quicedge-tracing-stop":
                thread.join(10)
        for conn in held:
            conn.close()
        listener.close()
