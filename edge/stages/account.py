"""Account stage: after a request, its metrics (TTFT by transport/early data/cache/backend,
upstream TTFT, edge-added time, ITL, prefix-hit ratios) and its trace attributes."""

from __future__ import annotations

from backends.registry import Backend
from edge.exchange import Exchange
from edge.relay import RelayResult
from edge.routing.base import Decision
from edge.sse import Usage
from edge.telemetry import Metrics, cache_label


def account_stream(
    metrics: Metrics,
    ex: Exchange,
    backend: Backend,
    result: RelayResult,
    t_send: float,
    upstream_ttft: float | None,
) -> None:
    """Metrics of a relayed stream: TTFT (edge and upstream), edge-added time, ITL."""
    if result.first_client is None or result.first_upstream is None or upstream_ttft is None:
        return
    usage = result.usage
    ttft = result.first_client - ex.t0 + ex.handshake_wait
    ex.ttft = ttft
    m = metrics
    m.ttft.labels(
        ex.transport,
        "0rtt" if ex.early_data else "1rtt",
        cache_label(usage.prompt_tokens, usage.cached_tokens),
        backend.name,
        ex.model,
    ).observe(ttft)
    m.upstream_ttft.labels(backend.name).observe(upstream_ttft)
    added = (t_send - ex.t0) + (result.first_client - result.first_upstream)
    m.edge_added.labels(ex.transport).observe(added)
    if result.gaps:
        m.itl.labels(backend.name).observe_many(result.gaps)
    if result.delays:
        m.relay_delay.labels(ex.transport).observe_many(result.delays)
    if ex.trace is not None:
        ex.trace.set("quicedge.ttft_ms", round(ttft * 1000, 3))


def account_cache(metrics: Metrics, ex: Exchange, decision: Decision, usage: Usage) -> None:
    """Predicted and reported prefix-hit ratios; the answer's counts on the trace."""
    assert ex.view is not None
    ex.usage = usage
    hit = metrics.prefix_hit
    if ex.view.approx_tokens > 0:
        predicted = min(decision.predicted_cached_tokens / ex.view.approx_tokens, 1.0)
        hit.labels("predicted").observe(predicted)
    if usage.prompt_tokens and usage.cached_tokens is not None:
        hit.labels("reported").observe(min(usage.cached_tokens / usage.prompt_tokens, 1.0))
    trace = ex.trace
    if trace is not None:
        trace.set("quicedge.backend", decision.backend.name)
        trace.set("quicedge.reason", decision.reason)
        trace.set("gen_ai.usage.input_tokens", usage.prompt_tokens)
        trace.set("gen_ai.usage.output_tokens", usage.completion_tokens)
        trace.set("quicedge.cached_tokens", usage.cached_tokens)
