"""Output-drift detection between a pool's stable and canary version.

Each version's outputs (from shadow pairs, `edge.models.shadow`) fill a window per metric: the
answer's mean top-1 probability and mean token entropy (where logprobs came back), its length in
tokens, and whether it ended by itself (`finish_reason == "stop"`). When both windows of a metric
hold `window` samples, a two-sample test runs and the windows start again (tumbling windows: the
tests of successive windows use disjoint samples, so they are independent). A version's window
that is full while the other's is not (its answers lack the metric: no logprobs came back) keeps
its newest `window` samples.

The test is Welch's t-test (unequal variances) for the means, its statistic read against
Student's t at the Welch-Satterthwaite degrees of freedom (`student_p`), and a two-proportion
z-test for the finish share (windows of at least 30). Read against the normal distribution
instead, Welch's p comes out too small where alarms are decided (at the level of one metric,
p 2.5e-4 by the normal is 6.6e-4 at 29 degrees of freedom, 3.0e-4 at 199), and identical
versions would be flagged more often than `alpha` says. Each
window's family of tests shares `alpha` (Bonferroni: each metric is tested at alpha / metrics), so
the chance that one window raises any false alarm is at most `alpha`, and over N windows at most
N * alpha (10,000 identical pairs in windows of 200 at alpha 0.001: at most 0.05 expected).

A significant difference acts only when it is also large: the mean top-1 probability shifting by
more than `confidence_shift` (0.08) pauses the ramp; the entropy or the length changing by more
than `entropy_change` (15 %) / `length_change`, or the finish share by more than 0.1, holds it
for review. A significant difference below those sizes is reported but changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from edge.models.config import DriftConfig

Action = Literal["none", "hold", "pause"]
METRICS = ("top1", "entropy", "length", "stopped")
FINISH_CHANGE = 0.1
"""Absolute change of the share of answers that stopped by themselves that holds the ramp."""


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


@dataclass(frozen=True, slots=True)
class TestResult:
    metric: str
    stable_mean: float
    canary_mean: float
    statistic: float
    p_value: float
    significant: bool
    action: Action
    reason: str


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz),
    which converges fast for x < (a + 1) / (a + b + 2)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for aa in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # fmt: skip
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))  # fmt: skip
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def student_p(t: float, df: float) -> float:
    """P(|T| > |t|) for Student's t with `df` degrees of freedom."""
    return beta_inc(df / 2, 0.5, df / (df + t * t))


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """Welch's t statistic of mean(b) - mean(a) and its two-sided p (Student's t at the
    Welch-Satterthwaite degrees of freedom)."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    qa = sum((x - ma) ** 2 for x in a) / (na - 1) / na
    qb = sum((x - mb) ** 2 for x in b) / (nb - 1) / nb
    se = math.sqrt(qa + qb)
    if se == 0:
        return (0.0, 1.0) if ma == mb else (math.copysign(math.inf, mb - ma), 0.0)
    t = (mb - ma) / se
    df = (qa + qb) ** 2 / (qa * qa / (na - 1) + qb * qb / (nb - 1))
    return t, student_p(t, df)


def two_proportions(a: list[float], b: list[float]) -> tuple[float, float]:
    """z statistic of the share of ones in b minus in a (pooled), and its two-sided p."""
    na, nb = len(a), len(b)
    pa, pb = sum(a) / na, sum(b) / nb
    pooled = (sum(a) + sum(b)) / (na + nb)
    se = math.sqrt(pooled * (1 - pooled) * (1 / na + 1 / nb))
    if se == 0:
        return (0.0, 1.0) if pa == pb else (math.copysign(math.inf, pb - pa), 0.0)
    z = (pb - pa) / se
    return z, 2 * normal_sf(abs(z))


@dataclass(slots=True)
class Sample:
    """One answer's summary (None where it did not carry the value)."""

    length: float
    stopped: bool
    top1: float | None = None
    entropy: float | None = None


@dataclass(slots=True)
class DriftDetector:
    """Tumbling windows per metric and version; `add` returns the tests a full window ran."""

    config: DriftConfig
    _windows: dict[tuple[str, bool], list[float]] = field(default_factory=dict)
    windows_tested: int = 0
    alarms: int = 0

    def add(self, sample: Sample, *, canary: bool) -> list[TestResult]:
        values = {
            "length": sample.length,
            "stopped": 1.0 if sample.stopped else 0.0,
            "top1": sample.top1,
            "entropy": sample.entropy,
        }
        results: list[TestResult] = []
        for metric, value in values.items():
            if value is None:
                continue
            window = self._windows.setdefault((metric, canary), [])
            window.append(value)
            other = self._windows.get((metric, not canary), [])
            n = self.config.window
            if len(window) >= n and len(other) >= n:
                stable, cand = (other, window) if canary else (window, other)
                results.append(self.test(metric, stable[:n], cand[:n]))
                del stable[:n], cand[:n]
            elif len(window) > n:
                # The other version's answers do not carry this metric (no logprobs came
                # back): keep the newest window's worth, not one more sample per pair for good.
                del window[0]
        return results

    def test(self, metric: str, stable: list[float], canary: list[float]) -> TestResult:
        """One metric's test of one window pair, at alpha / len(METRICS)."""
        cfg = self.config
        level = cfg.alpha / len(METRICS)
        if metric == "stopped":
            stat, p = two_proportions(stable, canary)
        else:
            stat, p = welch(stable, canary)
        ms, mc = sum(stable) / len(stable), sum(canary) / len(canary)
        significant = p < level
        action: Action = "none"
        reason = ""
        if significant:
            if metric == "top1" and abs(mc - ms) > cfg.confidence_shift:
                action = "pause"
                reason = f"mean top-1 probability {ms:.3f} -> {mc:.3f} (p={p:.2g})"
            elif metric in ("entropy", "length"):
                limit = cfg.entropy_change if metric == "entropy" else cfg.length_change
                change = (mc - ms) / ms if ms else math.inf
                if abs(change) > limit:
                    action = "hold"
                    reason = f"mean {metric} {ms:.3f} -> {mc:.3f} ({change:+.0%}, p={p:.2g})"
            elif metric == "stopped" and abs(mc - ms) > FINISH_CHANGE:
                action = "hold"
                reason = f"share stopped by itself {ms:.2f} -> {mc:.2f} (p={p:.2g})"
        self.windows_tested += 1
        if action != "none":
            self.alarms += 1
        return TestResult(metric, ms, mc, stat, p, significant, action, reason)


__all__ = [
    "METRICS",
    "Action",
    "DriftDetector",
    "Sample",
    "TestResult",
    "beta_inc",
    "normal_sf",
    "student_p",
    "welch",
]
