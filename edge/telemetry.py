"""Telemetry: Prometheus metrics on the registry passed in, OpenTelemetry spans per request stage.

Nothing here is global: `edge.serve` creates the one `CollectorRegistry`, and the tracer comes from
`tracer_from_env()` (the standard `OTEL_*` variables) or from a test. Tracing is decided once per
request: with no tracer the app creates no span objects at all, and a request costs only the
`time.perf_counter()` reads that the metrics need anyway. Stage spans are emitted when the request
ends, with the start and end times recorded as it ran, so the hot path does no span bookkeeping.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge.light_metrics import LightCounter, LightHistogram

# TTFT spans ~1 ms (cached, idle) to tens of seconds (long prompt, deep queue).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)  # fmt: skip
# What the edge itself adds is meant to be well under a millisecond.
EDGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 1.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

HIT_RATIO = 0.9
"""cached/prompt at or above which a request counts as a cache `hit` (else `partial`, or `miss`
when nothing was cached)."""


def cache_label(prompt_tokens: int | None, cached_tokens: int | None) -> str:
    """`hit`, `partial`, `miss`, or `unknown` when the backend did not report cached tokens."""
    if cached_tokens is None or not prompt_tokens:
        return "unknown"
    if cached_tokens <= 0:
        return "miss"
    return "hit" if cached_tokens >= HIT_RATIO * prompt_tokens else "partial"


class Metrics:
    """The app's metrics (transport registers its own on the same registry).

    Lock-free (`edge.light_metrics`): they are updated a dozen times per request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.ttft = LightHistogram(
            "quicedge_ttft_seconds",
            "Time to first token seen by the edge: request arrival (plus any deferred-0-RTT "
            "handshake wait) to the first content chunk handed to the client transport",
            ["transport", "early_data", "cache", "backend", "model"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.upstream_ttft = LightHistogram(
            "quicedge_upstream_ttft_seconds",
            "Request sent upstream to the first content chunk received from the backend",
            ["backend"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.edge_added = LightHistogram(
            "quicedge_edge_added_seconds",
            "TTFT the edge adds: the request's read to its upstream send, plus the first token's"
            " read from the backend to its hand-over to the client",
            ["transport"],
            buckets=EDGE_BUCKETS,
            registry=registry,
        )
        self.relay_delay = LightHistogram(
            "quicedge_relay_delay_seconds",
            "Per content chunk: the socket read that brought it from the backend to its hand-over"
            " to the client transport",
            ["transport"],
            buckets=EDGE_BUCKETS,
            registry=registry,
        )
        self.itl = LightHistogram(
            "quicedge_inter_token_seconds",
            "Gap between content chunks as handed to the client",
            ["backend"],
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.requests = LightCounter(
            "quicedge_requests",
            "Requests by route, the status the client got and the model asked for (a model the"
            " fleet does not serve counts as `other`; none before the body is read)",
            ["route", "status", "model"],
            registry=registry,
        )
        self.decisions = LightCounter(
            "quicedge_routing_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=registry,
        )
        self.prefix_hit = LightHistogram(
            "quicedge_prefix_hit_ratio",
            "Share of the prompt cached on the chosen backend: predicted by routing, reported "
            "by the backend",
            ["kind"],
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        self.upstream_requests = LightCounter(
            "quicedge_upstream_requests",
            "Upstream requests by backend and whether a warm connection was reused",
            ["backend", "reused"],
            registry=registry,
        )
        self.upstream_errors = LightCounter(
            "quicedge_upstream_errors",
            "Failed upstream attempts by backend and kind",
            ["backend", "kind"],
            registry=registry,
        )
        self.retries = LightCounter(
            "quicedge_retries",
            "Attempts retried on another backend, by the reason",
            ["reason"],
            registry=registry,
        )
        self.disconnects = LightCounter(
            "quicedge_client_disconnects",
            "Clients that went away before their answer was complete (upstream aborted)",
            registry=registry,
        )
        self.tenant_requests = LightCounter(
            "quicedge_tenant_requests",
            "Requests admitted, by tenant and tier",
            ["tenant", "tier"],
            registry=registry,
        )
        self.tenant_tokens = LightCounter(
            "quicedge_tenant_tokens",
            "Tokens charged to each tenant: prompt (estimated at admission) and completion "
            "(reported by the backend)",
            ["tenant", "kind"],
            registry=registry,
        )
        self.admission_rejections = LightCounter(
            "quicedge_admission_rejections",
            "Requests refused by admission, by tenant (`-` when unknown) and reason "
            "(unauthorized, requests, tokens, concurrency)",
            ["tenant", "reason"],
            registry=registry,
        )
        self.admission_local = LightCounter(
            "quicedge_admission_local_decisions",
            "Rate-limit decisions taken by this process's fallback buckets while Redis was "
            "unavailable, by tenant",
            ["tenant"],
            registry=registry,
        )
        self.admission_queue_wait = LightHistogram(
            "quicedge_admission_queue_wait_seconds",
            "Time requests spent in the admission queue, by tier and outcome (placed, refused)",
            ["tier", "outcome"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.redis_state = Gauge(
            "quicedge_redis_breaker_state",
            "Breaker of a Redis-backed feature: 0 closed (in use), 1 half-open (probing), "
            "2 open (local fallback)",
            ["store"],
            registry=registry,
        )
        self.redis_trips = LightCounter(
            "quicedge_redis_breaker_trips",
            "Times a Redis-backed feature's breaker opened",
            ["store"],
            registry=registry,
        )
        self.stage = LightHistogram(
            "quicedge_stage_seconds",
            "Time spent in each edge stage (parse, admit, route)",
            ["stage"],
            buckets=EDGE_BUCKETS,
            registry=registry,
        )
        self.handshake_wait = LightHistogram(
            "quicedge_early_data_handshake_wait_seconds",
            "How long deferred 0-RTT requests waited for the handshake to complete",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.policy_decisions = LightCounter(
            "quicedge_policy_decisions",
            "Policy gateway decisions by rule (or module) and outcome: allow, redact, deny, "
            "filtered (stream cut), error, allow_on_error; rule `-`: a request no rule matched",
            ["rule", "outcome"],
            registry=registry,
        )
        self.policy_failures = LightCounter(
            "quicedge_policy_module_failures",
            "WebAssembly policy module failures by module and kind (trap, fuel, memory, abi, load)",
            ["module", "kind"],
            registry=registry,
        )
        self.policy_judge = LightHistogram(
            "quicedge_policy_judge_seconds",
            "Time the guard model took to answer, by verdict (safe, unsafe, error)",
            ["verdict"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        # children created once: a dict lookup less per request
        self.stage_parse = self.stage.labels("parse")
        self.stage_admit = self.stage.labels("admit")
        self.stage_route = self.stage.labels("route")


class FleetCollector(Collector):
    """Read-at-scrape gauges: in-flight per backend, health, and upstream connection reuse.

    Computed from the registry and pool when Prometheus scrapes, so requests pay nothing for them.
    """

    def __init__(self, backends: Sequence[Any], pool_stats: Callable[[], Any]) -> None:
        self._backends = backends
        self._pool_stats = pool_stats

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "quicedge_backend_in_flight", "Requests the edge has in flight", labels=["backend"]
        )
        prefill = GaugeMetricFamily(
            "quicedge_backend_in_flight_prefill_tokens",
            "Predicted uncached prompt tokens of requests not yet past their first token",
            labels=["backend"],
        )
        healthy = GaugeMetricFamily(
            "quicedge_backend_healthy", "1 when the backend passes its checks", labels=["backend"]
        )
        degraded = GaugeMetricFamily(
            "quicedge_backend_degraded", "1 when the backend is degraded", labels=["backend"]
        )
        for b in self._backends:
            in_flight.add_metric([b.name], b.in_flight)
            prefill.add_metric([b.name], b.in_flight_prefill_tokens)
            healthy.add_metric([b.name], 1.0 if b.healthy else 0.0)
            degraded.add_metric([b.name], 1.0 if b.degraded else 0.0)
        yield from (in_flight, prefill, healthy, degraded)
        stats = self._pool_stats()
        reuse = GaugeMetricFamily(
            "quicedge_upstream_reuse_ratio",
            "Share of upstream requests sent on an already open keep-alive connection",
        )
        reuse.add_metric([], stats.reuse_ratio)
        connects = CounterMetricFamily(
            "quicedge_upstream_connects", "TCP connections the pool has opened"
        )
        connects.add_metric([], stats.connects)
        urgent = CounterMetricFamily(
            "quicedge_upstream_urgent_reads",
            "First tokens read between request starts, because the event loop had read no"
            " upstream socket for 0.5 ms (a sign of long loop turns)",
        )
        urgent.add_metric([], stats.urgent_reads)
        conns = GaugeMetricFamily(
            "quicedge_upstream_connections",
            "Upstream connections by backend and state",
            labels=["backend", "state"],
        )
        # `backend` is the backend's name here too, as on every other metric
        names = {b.url: b.name for b in self._backends}
        for url, host in stats.backends.items():
            name = names.get(url, url)
            conns.add_metric([name, "idle"], host.idle)
            conns.add_metric([name, "active"], host.active)
        yield from (reuse, connects, urgent, conns)


class AuditCollector(Collector):
    """Read-at-scrape audit log gauges and counters: queue depth, lines written, drops."""

    def __init__(self, audit: Any) -> None:
        self._audit = audit

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "quicedge_audit_queue_depth", "Audit records waiting to be written"
        )
        depth.add_metric([], self._audit.depth)
        written = CounterMetricFamily("quicedge_audit_written", "Audit lines written")
        written.add_metric([], self._audit.written)
        dropped = CounterMetricFamily(
            "quicedge_audit_dropped",
            'Audit records dropped: the queue was full (`when_full = "drop"`) or a write failed',
        )
        dropped.add_metric([], self._audit.dropped)
        yield from (depth, written, dropped)


# -- tracing ---------------------------------------------------------------------------------


@dataclass(slots=True)
class TracingSetup:
    """A tracer and the provider to flush at shutdown (None when this module built neither)."""

    tracer: Tracer | None
    provider: TracerProvider | None = None

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def tracer_from_env(*, force: bool = False, environ: dict[str, str] | None = None) -> TracingSetup:
    """A tracer whose exporters follow `OTEL_TRACES_EXPORTER` (none by default; console; otlp).

    `force` (the `tracing` setting) turns tracing on with the console exporter when the variable
    names none. Sampling follows `OTEL_TRACES_SAMPLER`, resource attributes `OTEL_SERVICE_NAME` /
    `OTEL_RESOURCE_ATTRIBUTES`, and the OTLP exporter its own `OTEL_EXPORTER_OTLP_*` variables:
    the SDK reads them itself.
    """
    env = os.environ if environ is None else environ
    names = exporter_names(env, force=force)
    if not names:
        return TracingSetup(None)
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "quicedge")})
    provider = TracerProvider(resource=resource)
    for name in names:
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()()))
    return TracingSetup(provider.get_tracer("quicedge.edge"), provider)


def exporter_names(env: Mapping[str, str], *, force: bool = False) -> list[str]:
    """The span exporters `OTEL_TRACES_EXPORTER` names (`console` when only `force`d); a
    ValueError, one line, for a name this build cannot export to."""
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",")]
    names = [n for n in names if n and n != "none"]
    if not names and force:
        names = ["console"]
    for name in names:
        if name == "otlp":
            _otlp_exporter()
        elif name != "console":
            raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (console, otlp)")
    return names


def _otlp_exporter() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ValueError(
            "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install 'quicedge[otlp]'"
        ) from None
    return OTLPSpanExporter


_PROPAGATOR = TraceContextTextMapPropagator()

# OpenTelemetry semantic conventions: HTTP (stable) and GenAI (development; the names of
# semconv 1.37+, where `gen_ai.system` became `gen_ai.provider.name`).
GENAI_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/generate": "generate_content",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
GENAI_PROVIDER = "sglang"
_PROTOCOL_VERSIONS = {"h3": "3", "h2": "2", "h1": "1.1"}


def server_attributes(scope: Mapping[str, Any], route: str, transport: str) -> dict[str, Any]:
    """The HTTP server span's attributes (semconv names) and the GenAI operation."""
    attributes: dict[str, Any] = {
        "http.request.method": scope.get("method", "POST"),
        "http.route": route,
        "url.path": scope.get("path", route),
        "url.scheme": scope.get("scheme", "http"),
        "network.protocol.version": _PROTOCOL_VERSIONS.get(transport, "1.1"),
        "gen_ai.operation.name": GENAI_OPERATIONS.get(route, route),
        "gen_ai.provider.name": GENAI_PROVIDER,
    }
    server = scope.get("server")
    if server:
        attributes["server.address"] = server[0]
        if server[1] is not None:
            attributes["server.port"] = server[1]
    client = scope.get("client")
    if client:
        attributes["client.address"] = client[0]
    return attributes


def genai_request_attributes(body: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """`gen_ai.request.*` from a request body (OpenAI fields, or SGLang's `sampling_params`)."""
    params = body.get("sampling_params")
    sampling: Mapping[str, Any] = params if isinstance(params, Mapping) else body
    model = body.get("model")
    if isinstance(model, str):
        yield "gen_ai.request.model", model
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None:
        limit = sampling.get("max_new_tokens")
    for key, value in (
        ("gen_ai.request.max_tokens", limit),
        ("gen_ai.request.temperature", sampling.get("temperature")),
        ("gen_ai.request.top_p", sampling.get("top_p")),
        ("gen_ai.request.seed", sampling.get("seed")),
    ):
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield key, value


class RequestTrace:
    """The spans of one traced request: a SERVER root span and one child per stage.

    Times are `time.perf_counter()` seconds, converted to the epoch nanoseconds OpenTelemetry
    wants by one offset taken at the start. Stage spans are made when the request ends, so
    tracing adds nothing between the request's arrival and its first token but the root span.
    """

    __slots__ = ("_ctx", "_offset_ns", "_root", "_stages", "_tracer")

    def __init__(
        self,
        tracer: Tracer,
        *,
        start: float,
        traceparent: bytes | None,
        tracestate: bytes | None,
        attributes: dict[str, Any],
    ) -> None:
        self._tracer = tracer
        self._stages: list[tuple[str, float, float, dict[str, Any] | None]] = []
        self._offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)
        carrier: dict[str, str] = {}
        if traceparent is not None:  # W3C Trace Context: continue the client's trace
            carrier["traceparent"] = traceparent.decode("latin-1")
            if tracestate is not None:
                carrier["tracestate"] = tracestate.decode("latin-1")
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        self._root = tracer.start_span(
            "quicedge.request",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self._ns(start),
            attributes=attributes,
        )
        self._ctx = trace.set_span_in_context(self._root)

    def _ns(self, t: float) -> int:
        return self._offset_ns + int(t * 1e9)

    def upstream_context(self) -> tuple[bytes | None, bytes | None]:
        """`traceparent`/`tracestate` for the backend: this request's span as the parent."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=self._ctx)
        parent = carrier.get("traceparent")
        state = carrier.get("tracestate")
        return (
            parent.encode() if parent else None,
            state.encode() if state else None,
        )

    def stage(
        self, name: str, start: float, end: float, attributes: dict[str, Any] | None = None
    ) -> None:
        """Record a stage; its span is created in `end()`, off the path to the first token."""
        self._stages.append((name, start, end, attributes))

    def set(self, key: str, value: Any) -> None:
        if value is not None:
            self._root.set_attribute(key, value)

    def upstream(
        self, url: str, route: str, backend: str, start: float, headers: list[tuple[bytes, bytes]]
    ) -> tuple[Any, list[tuple[bytes, bytes]]]:
        """A CLIENT span for one upstream attempt, started at `start`, and `headers` with its
        `traceparent`, so the backend's spans hang under this attempt; end it with
        `end_upstream`."""
        parts = urlsplit(url)
        span = self._tracer.start_span(
            f"POST {route}",
            context=self._ctx,
            kind=SpanKind.CLIENT,
            start_time=self._ns(start),
            attributes={
                "http.request.method": "POST",
                "server.address": parts.hostname or "",
                "server.port": parts.port or 80,
                "url.full": url.rstrip("/") + route,
                "network.protocol.version": "1.1",
                "quicedge.backend": backend,
            },
        )
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        out = [(k, v) for k, v in headers if k not in (b"traceparent", b"tracestate")]
        out.extend((k.encode(), v.encode()) for k, v in carrier.items())
        return span, out

    def end_upstream(self, span: Any, end: float, status: int | None, error: str | None) -> None:
        if status:
            span.set_attribute("http.response.status_code", status)
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._ns(end))

    def end(self, end: float, error: str | None = None) -> None:
        tracer, ctx, ns = self._tracer, self._ctx, self._ns
        for name, start, stop, attributes in self._stages:
            span = tracer.start_span(name, context=ctx, start_time=ns(start), attributes=attributes)
            span.end(end_time=ns(stop))
        self._stages.clear()
        if error is not None:
            self._root.set_status(Status(StatusCode.ERROR, error))
        self._root.end(end_time=ns(end))


__all__ = [
    "AuditCollector",
    "GENAI_OPERATIONS",
    "FleetCollector",
    "Metrics",
    "RequestTrace",
    "TracingSetup",
    "cache_label",
    "exporter_names",
    "genai_request_attributes",
    "server_attributes",
    "tracer_from_env",
]
