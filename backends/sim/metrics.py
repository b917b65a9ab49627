"""`/metrics` in Prometheus text format with SGLang's metric names (`sglang:*`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from backends.sim.scheduler import Scheduler
from backends.sim.stats import Histogram


class SimCollector(Collector):
    """Reads the scheduler's state at scrape time; nothing is updated per token here."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self._scheduler = scheduler
        self._labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        metric = GaugeMetricFamily(name, doc, labels=list(self._labels))
        metric.add_metric(list(self._labels.values()), value)
        return metric

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        metric = CounterMetricFamily(name, doc, labels=list(self._labels))
        metric.add_metric(list(self._labels.values()), value)
        return metric

    def _histogram(self, name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
        metric = HistogramMetricFamily(name, doc, labels=list(self._labels))
        metric.add_metric(list(self._labels.values()), hist.cumulative(), hist.total)
        return metric

    def collect(self) -> Iterator[Metric]:
        s = self._scheduler
        st = s.stats
        yield self._gauge(
            "sglang:num_running_reqs", "The number of running requests", s.num_running
        )
        yield self._gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue", s.num_waiting
        )
        yield self._gauge("sglang:num_used_tokens", "The number of used tokens", s.in_use_tokens)
        yield self._gauge("sglang:token_usage", "The token usage", round(s.token_usage, 2))
        yield self._gauge(
            "sglang:gen_throughput", "The generation throughput (token/s)", s.gen_throughput()
        )
        yield self._gauge(
            "sglang:cache_hit_rate", "The prefix cache hit rate", st.last_cache_hit_rate
        )
        yield self._gauge(
            "sglang:max_total_num_tokens", "Maximum total number of tokens", s.max_total_tokens
        )
        yield self._counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed", st.prompt_tokens_total
        )
        yield self._counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed",
            st.generation_tokens_total,
        )
        yield self._counter(
            "sglang:cached_tokens", "Number of cached prompt tokens", st.cached_tokens_total
        )
        yield self._counter(
            "sglang:num_requests", "Number of requests processed", st.num_requests_total
        )
        yield self._counter(
            "sglang:num_aborted_requests",
            "Number of requests aborted",
            st.num_aborted_requests_total,
        )
        yield self._gauge(
            "sglang:num_retracted_reqs",
            "Requests retracted since start for lack of KV room (cumulative in the stand-in)",
            st.num_retracted_reqs_total,
        )
        yield self._histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            st.ttft,
        )
        yield self._histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            st.itl,
        )
        yield self._histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            st.e2e,
        )
        yield self._histogram(
            "sglang:queue_time_seconds", "Histogram of queueing time in seconds.", st.queue_time
        )


class SimMetrics:
    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SimCollector(scheduler, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
