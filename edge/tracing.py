"""OpenTelemetry spans per request stage, and the tracer `serve` builds from `OTEL_*` variables.

Tracing is decided once per request: with no tracer the app creates no span objects at all, and a
request costs only the `time.perf_counter()` reads that the metrics need anyway. Stage spans are
emitted when the request ends, with the start and end times recorded as it ran, so the hot path
does no span bookkeeping.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("quicedge.tracing")


SHUTDOWN_TIMEOUT_S = 3.0
"""How long the stop waits for the spans still queued to go out."""


class _CountingExporter(SpanExporter):
    """Wraps an exporter to count the spans of the batches it fails to send."""

    def __init__(self, inner: SpanExporter) -> None:
        self._inner = inner
        self.failed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:
            self.failed += len(spans)
            raise  # the SDK logs it
        if result is not SpanExportResult.SUCCESS:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._inner.force_flush(timeout_millis)


class CountingSpanProcessor(BatchSpanProcessor):
    """The SDK's batch processor, counting the spans it loses: dropped from its full queue
    (a collector that is down or hangs), or in a batch the exporter failed to send. The SDK
    logs the first of each 20 s and counts them nowhere Prometheus reads."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._counting = _CountingExporter(exporter)
        super().__init__(self._counting)
        self.queue_full = 0
        self._queue: Any = getattr(getattr(self, "_batch_processor", None), "_queue", None)

    @property
    def failed(self) -> int:
        return self._counting.failed

    def on_end(self, span: ReadableSpan) -> None:
        queue = self._queue
        if (
            queue is not None
            and queue.maxlen is not None
            and len(queue) >= queue.maxlen
            and span.context is not None
            and span.context.trace_flags.sampled
        ):
            self.queue_full += 1  # the SDK drops the oldest one waiting for this one
        super().on_end(span)


@dataclass(slots=True)
class TracingSetup:
    """A tracer and the provider to flush at shutdown (None when this module built neither)."""

    tracer: Tracer | None
    provider: TracerProvider | None = None
    processors: list[CountingSpanProcessor] = field(default_factory=list)

    @property
    def dropped(self) -> dict[str, int]:
        """Spans lost, by reason: `queue_full` (an exporter's queue), `failed` (an export)."""
        return {
            "queue_full": sum(p.queue_full for p in self.processors),
            "failed": sum(p.failed for p in self.processors),
        }

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Flush and stop the exporters, waiting `timeout` s at most: the SDK waits for the
        export in progress and then sends every batch left, each up to the exporter's timeout
        (10 s), which a collector that hangs turns into 30 s, past a pod's grace period. What
        is not out by then is dropped; the export left waiting ends in its own (daemon)
        thread."""
        provider = self.provider
        if provider is None:
            return
        self.provider = None
        stop = threading.Thread(target=provider.shutdown, name="quicedge-tracing-stop", daemon=True)
        stop.start()
        stop.join(timeout)
        if stop.is_alive():
            log.warning(
                "spans not exported within %.0f s of the stop are dropped (the collector does"
                " not answer)",
                timeout,
            )


def tracer_from_env(
    *,
    force: bool = False,
    trust_client_sampling: bool = False,
    environ: dict[str, str] | None = None,
) -> TracingSetup:
    """A tracer whose exporters follow `OTEL_TRACES_EXPORTER` (none by default; console; otlp).

    `force` (the `tracing` setting) turns tracing on with the console exporter when the variable
    names none. Sampling follows `OTEL_TRACES_SAMPLER` (`edge_sampler`), resource attributes
    `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES`, and the OTLP exporter its own
    `OTEL_EXPORTER_OTLP_*` variables: the SDK reads them itself.
    """
    env = os.environ if environ is None else environ
    names = exporter_names(env, force=force)
    if not names:
        return TracingSetup(None)
    provider = TracerProvider(
        resource=service_resource(env),
        sampler=edge_sampler(env, trust_client_sampling=trust_client_sampling),
    )
    processors = [
        CountingSpanProcessor(ConsoleSpanExporter() if name == "console" else _otlp_exporter()())
        for name in names
    ]
    for processor in processors:
        provider.add_span_processor(processor)
    return TracingSetup(provider.get_tracer("quicedge.edge"), provider, processors)


def edge_sampler(env: Mapping[str, str], *, trust_client_sampling: bool = False) -> Sampler:
    """The sampler `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` name, as the SDK reads
    them, where the client is trusted; else the edge decides a request with a `traceparent` as
    it decides one without: the named sampler's own (root) part, given an id of the edge's
    instead of the client's trace id (which `traceidratio` would read, and a client choose
    low). The trace id goes on either way; the request's own spans follow the request's."""
    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    base = name.removeprefix("parentbased_")
    root: Sampler
    if base == "always_off":
        root = ALWAYS_OFF
    elif base == "traceidratio":
        try:
            root = TraceIdRatioBased(float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")))
        except (ValueError, TypeError):
            log.warning("OTEL_TRACES_SAMPLER_ARG is no ratio in 0..1: 1.0 it is")
            root = TraceIdRatioBased(1.0)
    else:
        if base != "always_on":
            log.warning("OTEL_TRACES_SAMPLER=%s is unknown: parentbased_always_on it is", name)
            name = "parentbased_always_on"
        root = ALWAYS_ON
    if trust_client_sampling:
        return ParentBased(root) if name.startswith("parentbased_") else root
    edge = _EdgeIdSampler(root)
    return ParentBased(root, remote_parent_sampled=edge, remote_parent_not_sampled=edge)


class _EdgeIdSampler(Sampler):
    """`sampler` deciding on a random id of the edge's, not the trace id the client sent."""

    def __init__(self, sampler: Sampler) -> None:
        self._sampler = sampler
        self._ids = RandomIdGenerator()

    def should_sample(
        self, parent_context: Any, trace_id: int, *args: Any, **kwargs: Any
    ) -> SamplingResult:
        own = self._ids.generate_trace_id()
        return self._sampler.should_sample(parent_context, own, *args, **kwargs)

    def get_description(self) -> str:
        return f"EdgeId{{{self._sampler.get_description()}}}"


def service_resource(env: Mapping[str, str]) -> Resource:
    """The SDK's resource (`OTEL_RESOURCE_ATTRIBUTES`, then `OTEL_SERVICE_NAME` over its
    `service.name`), named `quicedge` only where neither names the service."""
    name = env.get("OTEL_SERVICE_NAME")
    resource = Resource.create({"service.name": name} if name else {})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "quicedge"}))
    return resource


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
            check_otlp_protocol(env, "TRACES")
        elif name != "console":
            raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (console, otlp)")
    return names


OTLP_PROTOCOL = "http/protobuf"
"""The one OTLP protocol the exporter speaks (opentelemetry-exporter-otlp-proto-http)."""


def check_otlp_protocol(env: Mapping[str, str], signal: str) -> None:
    """A ValueError, one line, when the variables ask for another OTLP protocol for `signal`
    (`TRACES`, `LOGS`): the exporter would post HTTP to a gRPC port (4317) and lose every
    span or log record."""
    for variable in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(variable, "").strip().lower()
        if protocol:  # the signal's own variable first, as the SDK reads them
            if protocol != OTLP_PROTOCOL:
                raise ValueError(
                    f"{variable}={protocol}: the OTLP exporter speaks {OTLP_PROTOCOL} only"
                    " (a collector's OTLP/HTTP receiver, port 4318)"
                )
            return


def _otlp_exporter() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ValueError(
            "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install 'quicedge[otlp]'"
        ) from None
    return OTLPSpanExporter


_PROPAGATOR = TraceContextTextMapPropagator()

TRACEPARENT_MAX = 512
"""The longest `traceparent` the edge reads (OpenTelemetry's own bound; a version-00 one is 55)."""
TRACESTATE_MAX = 512
"""The longest `tracestate` the edge continues: the length W3C Trace Context asks every hop to
carry; a longer one is dropped whole (the trace itself goes on)."""
STATUS_MAX = 512
"""Characters of an error message the request span's status keeps."""
ATTRIBUTE_MAX = 256
"""Characters of a string the client chose (the request's `model`) a span attribute keeps."""


def cut(text: str, limit: int = ATTRIBUTE_MAX) -> str:
    """`text` as a span attribute, a log line or an audit record keeps a string the client
    chose: its first `limit` characters, and `...` where it was longer."""
    return text if len(text) <= limit else text[:limit] + "..."


TRACESTATE_MEMBERS = 32
"""The most list members a `tracestate` may have (W3C Trace Context)."""
_TRACESTATE_MEMBER = re.compile(
    rb"(?:[a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
    rb"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)


def _client_context(traceparent: bytes | None, tracestate: bytes | None) -> dict[str, str]:
    """The client's W3C trace context as the propagator's carrier, with what it would refuse
    left out here, silently: OpenTelemetry logs a warning for each oversized `traceparent` and
    each oversized or malformed `tracestate` (quoting the client's text), so any client could
    write one application-log line per request of its choosing."""
    carrier: dict[str, str] = {}
    if traceparent is None or len(traceparent) > TRACEPARENT_MAX:
        return carrier
    carrier["traceparent"] = traceparent.decode("latin-1")
    if tracestate is not None and len(tracestate) <= TRACESTATE_MAX:
        members = [m for m in (m.strip(b" \t") for m in tracestate.split(b",")) if m]
        if len(members) <= TRACESTATE_MEMBERS and all(
            _TRACESTATE_MEMBER.fullmatch(m) for m in members
        ):
            carrier["tracestate"] = tracestate.decode("latin-1")
    return carrier


def forwarded_context(
    traceparent: bytes | None, tracestate: bytes | None
) -> tuple[bytes | None, bytes | None]:
    """The client's W3C trace context as the backend gets it where the edge does not trace:
    as it came, within the bounds the edge's own tracing applies (`_client_context`), and the
    `traceparent` only where OpenTelemetry reads it as one (a backend's SDK would log a
    warning quoting each that is not)."""
    carrier = _client_context(traceparent, tracestate)
    if not carrier:
        return None, None
    parent = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    if not parent.is_valid:
        return None, None
    return traceparent, tracestate if "tracestate" in carrier else None


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
        # Only the body limit bounds it where the route serves any name (`/generate`): cut,
        # or every span waiting in the export queue could hold megabytes.
        yield "gen_ai.request.model", cut(model)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None:
        limit = sampling.get("max_new_tokens")
    for key, value in (
        ("gen_ai.request.max_tokens", limit),
        ("gen_ai.request.temperature", sampling.get("temperature")),
        ("gen_ai.request.top_p", sampling.get("top_p")),
        ("gen_ai.request.seed", sampling.get("seed")),
    ):
        # a bool is no number here (`True` is no `max_tokens`)
        if type(value) is float or (type(value) is int and _int64(value)):
            yield key, value


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The integers OTLP carries: the exporter leaves one past them out of its span, logging an
ERROR with a traceback each time (a client's `max_tokens` of 2**64 would write one per request)."""


def _int64(value: int) -> bool:
    """An integer OTLP can carry."""
    return INT64_MIN <= value <= INT64_MAX


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
        # W3C Trace Context: continue the client's trace
        carrier = _client_context(traceparent, tracestate)
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
        """Set an attribute of the request span; None, and an integer past OTLP's 64 bits (a
        backend's usage, say), are left out."""
        if value is not None and (type(value) is not int or _int64(value)):
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
            # The message may quote the client's model name or path, which only the body and
            # header limits bound: cut, as the access log's `error`.
            if len(error) > STATUS_MAX:
                error = error[:STATUS_MAX] + "..."
            self._root.set_status(Status(StatusCode.ERROR, error))
        self._root.end(end_time=ns(end))


__all__ = [
    "ATTRIBUTE_MAX",
    "CountingSpanProcessor",
    "GENAI_OPERATIONS",
    "SHUTDOWN_TIMEOUT_S",
    "RequestTrace",
    "TracingSetup",
    "check_otlp_protocol",
    "cut",
    "edge_sampler",
    "exporter_names",
    "forwarded_context",
    "genai_request_attributes",
    "server_attributes",
    "service_resource",
    "tracer_from_env",
]
