"""A client's W3C trace context at the edge: a well-formed one is continued with its
`tracestate`; an oversized `traceparent` or an oversized or malformed `tracestate` is left out
without a word in the application log (the client chooses how many requests carry one); an
error that quotes the client is cut in the span status."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from edge.tracing import ATTRIBUTE_MAX, STATUS_MAX
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


async def test_hostile_trace_context_is_dropped_without_logging(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hostile: list[dict[str, str]] = [
        {"traceparent": "00-" + "a" * 600},
        {"traceparent": TRACEPARENT, "tracestate": "BAD KEY=" + "x" * 300},
        {"traceparent": TRACEPARENT, "tracestate": ",".join(f"k{i}=v" for i in range(33))},
        {"traceparent": TRACEPARENT, "tracestate": "a=" + "b" * 600},
    ]
    async with TinyUpstream(answer) as up:
        async with run_edge(fast_config([up.url]), trace=True) as edge, client(edge) as http:
            with caplog.at_level(logging.WARNING):
                for headers in hostile:
                    response = await http.post("/v1/completions", json=BODY, headers=headers)
                    assert response.status_code == 200
            assert [r.getMessage() for r in caplog.records] == []
            good = {"traceparent": TRACEPARENT, "tracestate": "ven@dor=v1, other=x y"}
            response = await http.post("/v1/completions", json=BODY, headers=good)
            assert response.status_code == 200
    sent = [r.headers for r in up.requests if r.path == "/v1/completions"]
    assert len(sent) == 5
    assert TRACE_ID not in sent[0]["traceparent"]  # not continued: a trace of the edge's own
    for headers in sent[1:4]:  # the trace goes on; the state does not
        assert TRACE_ID in headers["traceparent"] and "tracestate" not in headers
    assert TRACE_ID in sent[4]["traceparent"]
    assert sent[4]["tracestate"] == "ven@dor=v1,other=x y"


async def test_an_error_quoting_the_client_is_cut_in_the_span_status() -> None:
    async with TinyUpstream(answer) as up:
        async with run_edge(fast_config([up.url]), trace=True) as edge, client(edge) as http:
            huge = {"model": "M" * 100_000, "messages": [{"role": "user", "content": "hi"}]}
            response = await http.post("/v1/chat/completions", json=huge)
            assert response.status_code == 404
    assert edge.spans is not None
    (root,) = [s for s in edge.spans.get_finished_spans() if s.name == "quicedge.request"]
    description = root.status.description or ""
    assert description.startswith("The model `MMM")
    assert len(description) == STATUS_MAX + len("...")


async def test_a_model_name_the_client_makes_huge_is_cut_in_the_span() -> None:
    """`/generate` serves whatever `model` says: a body of megabytes may name one, and each
    span the queue holds would carry it (2,048 spans waiting on a slow collector)."""
    async with TinyUpstream(answer) as up:
        async with run_edge(fast_config([up.url]), trace=True) as edge, client(edge) as http:
            body = {"text": "hi", "model": "M" * 100_000, "sampling_params": {"max_new_tokens": 2}}
            assert (await http.post("/generate", json=body)).status_code == 200
    assert edge.spans is not None
    (root,) = [s for s in edge.spans.get_finished_spans() if s.name == "quicedge.request"]
    model = str((root.attributes or {})["gen_ai.request.model"])
    assert model == "M" * ATTRIBUTE_MAX + "..."


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2**63, "seed": 2**63}}),
        ("/v1/completions", {**BODY, "max_tokens": 2**64 - 1, "seed": 2**64 - 1}),
    ],
)
async def test_an_integer_otlp_cannot_carry_is_left_out_of_the_span(
    route: str, body: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """OTLP's integers are 64-bit: the exporter's encoding leaves a number past them out of the
    span with an ERROR and its traceback in the application log, one per attribute, so any
    client could write two tracebacks into the log with each of its requests."""
    async with TinyUpstream(answer) as up:
        async with run_edge(fast_config([up.url]), trace=True) as edge, client(edge) as http:
            await http.post(route, json=body)
            assert (await http.post("/v1/completions", json=BODY)).status_code == 200
    assert edge.spans is not None
    spans = edge.spans.get_finished_spans()
    with caplog.at_level(logging.WARNING):
        encode_spans(spans).SerializePartialToString()  # what the OTLP exporter sends
    assert [r.getMessage() for r in caplog.records] == []
    root = next(s for s in spans if s.name == "quicedge.request")
    attributes = root.attributes or {}
    assert "gen_ai.request.max_tokens" not in attributes
    assert "gen_ai.request.seed" not in attributes
