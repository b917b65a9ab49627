"""Who decides whether a request is traced: by default the edge's own sampler
(`OTEL_TRACES_SAMPLER`), not the client's `traceparent` (its sampled flag, or a trace id chosen
low for `traceidratio`), so no client can make the edge export spans at will, nor hide its
requests from tracing; the client's trace id is continued either way. `trust_client_sampling`
gives the decision back to the client (the SDK's parent-based samplers, as before).

The edge's own tracer from `tracer_from_env`, with the real SDK, and an in-memory exporter
added to its provider."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.edge.conftest import (
    Recorded,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
    sse_reply,
)

LOW_TRACE_ID = "00000000000000000000000000000001"
"""A trace id every `traceidratio` above 0 samples (its low 64 bits are under any bound)."""
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
BODY = {"prompt": "x", "stream": True}


def answer(recorded: Recorded) -> Any:
    return health_ok(recorded) or sse_reply(["hi"])


@asynccontextmanager
async def traced_edge(
    monkeypatch: pytest.MonkeyPatch, sampler: str, arg: str | None = None, **overrides: Any
) -> AsyncIterator[tuple[TinyUpstream, Any, InMemorySpanExporter]]:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)  # `tracing`: console
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is None:
        monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    else:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    exporter = InMemorySpanExporter()
    async with TinyUpstream(answer) as up:
        config = fast_config([up.url], tracing=True, **overrides)
        async with run_edge(config) as edge:
            provider = edge.wiring.tracing.provider
            assert provider is not None
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            async with client(edge) as http:
                yield up, http, exporter


def sent_traceparents(up: TinyUpstream) -> list[str]:
    return [r.headers["traceparent"] for r in up.requests if r.path == "/v1/completions"]


def roots(exporter: InMemorySpanExporter) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == "quicedge.request"]


async def test_a_client_sampled_flag_does_not_override_the_edges_sampler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with traced_edge(monkeypatch, "parentbased_traceidratio", "0") as (up, http, spans):
        for _ in range(3):
            headers = {"traceparent": f"00-{TRACE_ID}-b7ad6b7169203331-01"}
            assert (await http.post("/v1/completions", json=BODY, headers=headers)).is_success
    assert spans.get_finished_spans() == ()
    for parent in sent_traceparents(up):  # the trace goes on, unsampled, for correlation
        assert parent.startswith(f"00-{TRACE_ID}-") and parent.endswith("-00")


async def test_a_trace_id_chosen_low_does_not_override_the_edges_ratio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with traced_edge(monkeypatch, "traceidratio", "1e-12") as (up, http, spans):
        for _ in range(3):
            headers = {"traceparent": f"00-{LOW_TRACE_ID}-b7ad6b7169203331-01"}
            assert (await http.post("/v1/completions", json=BODY, headers=headers)).is_success
    assert spans.get_finished_spans() == ()
    assert all(p.startswith(f"00-{LOW_TRACE_ID}-") for p in sent_traceparents(up))


async def test_a_client_cannot_hide_its_requests_from_the_edges_sampler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with traced_edge(monkeypatch, "parentbased_always_on") as (up, http, spans):
        headers = {"traceparent": f"00-{TRACE_ID}-b7ad6b7169203331-00"}
        assert (await http.post("/v1/completions", json=BODY, headers=headers)).is_success
        assert (await http.post("/v1/completions", json=BODY)).is_success  # a trace of its own
    first, second = roots(spans)
    assert format(first.context.trace_id, "032x") == TRACE_ID  # continued
    assert format(second.context.trace_id, "032x") != TRACE_ID
    stages = {s.name for s in spans.get_finished_spans() if s.parent is not None}
    assert {"parse", "route"} <= stages  # the request's children follow it
    first_sent = sent_traceparents(up)[0]
    assert first_sent.startswith(f"00-{TRACE_ID}-") and first_sent.endswith("-01")


async def test_trusted_clients_decide_as_the_sdks_parent_based_sampler_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with traced_edge(
        monkeypatch, "parentbased_traceidratio", "0", trust_client_sampling=True
    ) as (up, http, spans):
        headers = {"traceparent": f"00-{TRACE_ID}-b7ad6b7169203331-01"}
        assert (await http.post("/v1/completions", json=BODY, headers=headers)).is_success
        assert (await http.post("/v1/completions", json=BODY)).is_success  # ratio 0: not traced
    (root,) = roots(spans)
    assert format(root.context.trace_id, "032x") == TRACE_ID
