"""With tracing off (the default) the client's W3C trace context still goes to the backend, so
that a backend which traces joins the client's trace, but with the bounds the edge applies when
it traces itself: an oversized or malformed `traceparent` is not forwarded, nor an oversized or
malformed `tracestate` (a backend's OpenTelemetry SDK would log a warning quoting each)."""

from __future__ import annotations

import logging
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

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
BODY = {"prompt": "x", "stream": True}


def answer(recorded: Recorded) -> Any:
    return health_ok(recorded) or sse_reply(["hi"])


async def test_the_client_trace_context_goes_to_the_backend_within_bounds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent: list[dict[str, str]] = [
        {"traceparent": "00-" + "a" * 4000},
        {"traceparent": "not a traceparent"},
        {"traceparent": TRACEPARENT, "tracestate": "a=" + "b" * 4000},
        {"traceparent": TRACEPARENT, "tracestate": "BAD KEY=x"},
        {"traceparent": TRACEPARENT, "tracestate": "ven@dor=v1,other=x y"},
    ]
    async with TinyUpstream(answer) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            assert edge.wiring.tracing.tracer is None  # tracing is off
            with caplog.at_level(logging.WARNING):
                for headers in sent:
                    response = await http.post("/v1/completions", json=BODY, headers=headers)
                    assert response.status_code == 200
            assert [r.getMessage() for r in caplog.records] == []
    got = [
        (r.headers.get("traceparent"), r.headers.get("tracestate"))
        for r in up.requests
        if r.path == "/v1/completions"
    ]
    assert got == [
        (None, None),
        (None, None),
        (TRACEPARENT, None),
        (TRACEPARENT, None),
        (TRACEPARENT, "ven@dor=v1,other=x y"),
    ]
