"""Prometheus metrics of model pools, rollouts, shadow pairs and drift tests."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0, 1.01, 1.1, 1.5, 2.0, 4.0)


class ModelMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "quicedge_model_requests",
            "Attempts per model pool and version, by outcome (ok or a failure kind).",
            ["model", "version", "outcome"],
            registry=registry,
        )
        self.ttft = Histogram(
            "quicedge_model_ttft_seconds",
            "Backend TTFT per version of a pool with a rollout, s.",
            ["model", "version"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.canary_percent = Gauge(
            "quicedge_rollout_canary_percent",
            "The canary's share of a pool's traffic, percent.",
            ["model"],
            registry=registry,
        )
        self.transitions = Counter(
            "quicedge_rollout_transitions",
            "Rollout transitions (advance, promoted, pause, hold, rollback, resume, restart).",
            ["model", "action"],
            registry=registry,
        )
        self.sync_catch_up_failures = Counter(
            "quicedge_rollout_sync_catch_up_failures",
            "Reads of the shared rollout transitions' log (after a lost Redis subscription) that"
            " failed or timed out; each is retried, with a longer wait, while the subscription"
            " stays (`[models] share_stops`, `share_advances`).",
            registry=registry,
        )
        self.shadow = Counter(
            "quicedge_shadow_requests",
            "Shadow pairs by result: compared, error, unreadable, dropped_full, dropped_rate, "
            "canary_busy.",
            ["model", "result"],
            registry=registry,
        )
        self.shadow_cancelled = Counter(
            "quicedge_shadow_cancelled",
            "Shadow requests cancelled in flight, by reason: degraded, queue, breaker (the "
            "canary became overloaded) or rollout (paused, rolled back or promoted).",
            ["model", "reason"],
            registry=registry,
        )
        self.shadow_agree = Counter(
            "quicedge_shadow_agreement",
            "Shadow pair checks (exact: greedy requests only; finish) by whether both agreed.",
            ["model", "check", "agree"],
            registry=registry,
        )
        self.shadow_similarity = Histogram(
            "quicedge_shadow_similarity",
            "Shadow pair measures (token_overlap, edit_similarity, length_ratio, top1_agreement).",
            ["model", "measure"],
            buckets=_RATIO_BUCKETS,
            registry=registry,
        )
        self.drift_tests = Counter(
            "quicedge_drift_tests",
            "Drift tests run per metric, by action (none, hold, pause).",
            ["model", "metric", "action"],
            registry=registry,
        )
        # Children by labels: `labels()` on every attempt costs more than the rest of it.
        self._attempts: dict[tuple[str | None, str | None, str | None], Any] = {}
        self._ttfts: dict[tuple[str | None, str | None], Any] = {}

    def attempt(
        self, model: str | None, version: str | None, error: str | None, ttft_s: float | None
    ) -> None:
        """One attempt of a pool's version (model and version None: not known yet)."""
        key = (model, version, error)
        child = self._attempts.get(key)
        if child is None:
            child = self._attempts[key] = self.requests.labels(
                model or "unknown", version or "unknown", error or "ok"
            )
        child.inc()
        if ttft_s is not None:
            hist = self._ttfts.get((model, version))
            if hist is None:
                hist = self._ttfts[(model, version)] = self.ttft.labels(
                    model or "unknown", version or "unknown"
                )
            hist.observe(ttft_s)


__all__ = ["ModelMetrics"]
