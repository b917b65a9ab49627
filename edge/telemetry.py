"""Telemetry: the Prometheus metrics, on the registry passed in (spans are `edge.tracing`).

Nothing here is global: `edge.serve` creates the one `CollectorRegistry`, and the tracer comes from
`edge.tracing.tracer_from_env()` (the standard `OTEL_*` variables) or from a test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.labels import name_for
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


REDIS_STATES = {"closed": 0, "half_open": 1, "open": 2}
"""A `RedisGuard` state → the value of `quicedge_redis_breaker_state`."""


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
        self.retry_budget_exhausted = LightCounter(
            "quicedge_retry_budget_exhausted",
            "Failed attempts answered as they failed, not retried: the retry budget was spent",
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
        self.config_reloads = LightCounter(
            "quicedge_config_reloads",
            "Reloads of the config file (SIGHUP, POST /config/reload, or a change seen with"
            " config_poll_interval) this worker ran, by outcome: applied (a live section"
            " changed), unchanged, refused (the file did not load or validate; nothing changed)",
            ["outcome"],
            registry=registry,
        )
        self.pending_body_bytes = Gauge(
            "quicedge_pending_request_body_bytes",
            "Request-body bytes this process holds for bodies still arriving; past"
            " max_pending_body_bytes a request is refused with 503 overloaded",
            registry=registry,
        )
        self.pending_body_bytes_limit = Gauge(
            "quicedge_pending_request_body_bytes_limit",
            "max_pending_body_bytes: what bodies still arriving may hold in this process"
            " (0: no cap)",
            registry=registry,
        )
        self.pending_answer_bytes = Gauge(
            "quicedge_pending_answer_bytes",
            "Bytes of non-streamed backend answers this process holds while they arrive and"
            " are passed on; past max_pending_answer_bytes an answer is refused with 503"
            " overloaded",
            registry=registry,
        )
        self.pending_answer_bytes_limit = Gauge(
            "quicedge_pending_answer_bytes_limit",
            "max_pending_answer_bytes: what non-streamed answers may hold in this process"
            " (0: no cap)",
            registry=registry,
        )
        self.config_reload_ok = Gauge(
            "quicedge_config_last_reload_successful",
            "0 when the last reload of the config file was refused (the running settings"
            " stayed), else 1",
            registry=registry,
        )
        self.config_reload_ok.set(1)
        self.config_restart_pending = Gauge(
            "quicedge_config_restart_pending",
            "1 while the config file, as last reloaded, differs from the running settings in a"
            " section that takes effect only on a restart",
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

    def bound_backends(self, backends: Sequence[Any]) -> None:
        """The per-request series labelled `backend` name only the backends of `backends` (the
        registry's live list) when scraped: a backend that left the fleet (discovery, a reload)
        leaves them too. Backends come and go for the edge's whole life (a rescheduled pod has
        a new address, hence a new name); their series would pile up in memory and scrapes."""

        def names() -> set[str]:
            return {b.name for b in backends}

        for metric in (
            self.ttft, self.upstream_ttft, self.itl, self.upstream_requests, self.upstream_errors
        ):  # fmt: skip
            metric.bound("backend", names)

    def redis_breaker(self, store: str, old: str, state: str) -> None:
        """A `RedisGuard`'s state change (its `on_state`): the gauge, and a trip when it opens.
        (closed → closed only sets the gauge, so that it shows before the first trouble.)"""
        self.redis_state.labels(store).set(REDIS_STATES[state])
        if old == "closed" and state != "closed":
            self.redis_trips.labels(store).inc()


class FleetCollector(Collector):
    """Read-at-scrape gauges: in-flight per backend, health, and upstream connection reuse.

    Computed from the registry and pool when Prometheus scrapes, so requests pay nothing for them.
    """

    def __init__(self, backends: Sequence[Any], pool_stats: Callable[[], Any]) -> None:
        self._backends = backends
        self._pool_stats = pool_stats
        self._names: dict[str, str] = {}
        """URL → name of the backends seen, while the pool holds their connections: a removed
        backend's idle ones stay until they time out, and keep its name as their label."""

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
        held = GaugeMetricFamily(
            "quicedge_backend_held",
            "1 while an operator holds the backend out of routing (POST /backends/NAME/drain)",
            labels=["backend"],
        )
        load_polls = CounterMetricFamily(
            "quicedge_backend_load_poll_failures",
            "/v1/loads polls that failed (an error, a timeout, an answer that would not parse);"
            " routing keeps the backend's last known load meanwhile",
            labels=["backend"],
        )
        for b in self._backends:
            load_polls.add_metric([b.name], b.load_polls_failed)
            in_flight.add_metric([b.name], b.in_flight)
            prefill.add_metric([b.name], b.in_flight_prefill_tokens)
            healthy.add_metric([b.name], 1.0 if b.healthy else 0.0)
            degraded.add_metric([b.name], 1.0 if b.degraded else 0.0)
            held.add_metric([b.name], 1.0 if b.held else 0.0)
        yield from (in_flight, prefill, healthy, degraded, held, load_polls)
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
        resends = CounterMetricFamily(
            "quicedge_upstream_stale_resends",
            "Requests sent again on a fresh connection because the backend had closed the"
            " reused one as they went out (its keep-alive timeout raced the request)",
        )
        resends.add_metric([], stats.stale_resends)
        conns = GaugeMetricFamily(
            "quicedge_upstream_connections",
            "Upstream connections by backend and state",
            labels=["backend", "state"],
        )
        # `backend` is the backend's name here too, as on every other metric
        seen = self._names
        seen.update((b.url, b.name) for b in self._backends)
        for url, host in stats.backends.items():
            name = seen.get(url) or name_for(url)
            conns.add_metric([name, "idle"], host.idle)
            conns.add_metric([name, "active"], host.active)
        kept = stats.backends.keys() | {b.url for b in self._backends}
        self._names = {url: name for url, name in seen.items() if url in kept}
        yield from (reuse, connects, urgent, resends, conns)


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
            'Audit records dropped: the queue was full (`when_full = "drop"`), a write failed or'
            " the log was closed",
        )
        dropped.add_metric([], self._audit.dropped)
        yield from (depth, written, dropped)


class AccessLogCollector(Collector):
    """Read-at-scrape access log figures: lines waiting for the writer, lines dropped."""

    def __init__(self, source: Callable[[], Any]) -> None:
        self._source = source
        """The access log now (a reload may start or stop one); None: no figures."""

    def collect(self) -> Iterator[Metric]:
        log = self._source()
        if log is None:
            return
        pending = GaugeMetricFamily(
            "quicedge_access_log_pending", "Access log lines waiting for the writer thread"
        )
        pending.add_metric([], log.pending)
        dropped = CounterMetricFamily(
            "quicedge_access_log_dropped",
            "Access log lines dropped: `max_pending` lines were waiting (a stalled stderr)",
        )
        dropped.add_metric([], log.dropped)
        yield from (pending, dropped)


class TracingCollector(Collector):
    """Read-at-scrape span export figures: spans not exported, by reason."""

    def __init__(self, tracing: Any) -> None:
        self._tracing = tracing
        """The `edge.tracing.TracingSetup` (no exporters: 0)."""

    def collect(self) -> Iterator[Metric]:
        dropped = CounterMetricFamily(
            "quicedge_trace_spans_dropped",
            "Spans not exported, by reason: queue_full (the exporter's queue was full: a"
            " collector that is down or slow; OTEL_BSP_MAX_QUEUE_SIZE), failed (the collector"
            " did not take their batch)",
            labels=["reason"],
        )
        for reason, count in self._tracing.dropped.items():
            dropped.add_metric([reason], count)
        yield dropped


__all__ = [
    "AccessLogCollector",
    "AuditCollector",
    "FleetCollector",
    "Metrics",
    "TracingCollector",
    "cache_label",
]
