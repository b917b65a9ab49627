"""The drift windows' false-alarm bound (docs/models.md, "Drift detection"): a window of identical
versions raises an alarm with probability at most `drift.alpha`. Welch's statistic follows
Student's t with the Welch-Satterthwaite degrees of freedom; read against the normal
distribution, its p is too small at the windows the config allows (30 and up), and identical
versions are flagged more often than `alpha` says."""

from __future__ import annotations

import math
import random

import pytest

from edge.models.config import DriftConfig
from edge.models.drift import DriftDetector, welch


def _student_two_sided(t: float, df: float, steps: int = 20_000) -> float:
    """P(|T| > t) for Student's t with `df` degrees of freedom, by Simpson's rule over its
    density from 0 to t (an oracle independent of the code under test)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def pdf(x: float) -> float:
        return c * (1 + x * x / df) ** (-(df + 1) / 2)

    h = t / steps
    total = pdf(0.0) + pdf(t)
    total += sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, steps))
    return 1 - 2 * (total * h / 3)


def _welch_df(a: list[float], b: list[float]) -> float:
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    qa = sum((x - ma) ** 2 for x in a) / (na - 1) / na
    qb = sum((x - mb) ** 2 for x in b) / (nb - 1) / nb
    return (qa + qb) ** 2 / (qa**2 / (na - 1) + qb**2 / (nb - 1))


@pytest.mark.parametrize("n", [30, 60, 200])
def test_welchs_p_is_students_at_the_welch_satterthwaite_degrees_of_freedom(n: int) -> None:
    rng = random.Random(n)
    a = [rng.gauss(0.0, 1.0) for _ in range(n)]
    b = [rng.gauss(0.0, 2.0) for _ in range(n)]
    # shift b so that the statistic is near the level one metric is tested at (alpha / 4)
    t0, _ = welch(a, b)
    se = (sum(b) / n - sum(a) / n) / t0
    b = [x + (3.66 - t0) * se for x in b]
    t, p = welch(a, b)
    assert t == pytest.approx(3.66, rel=1e-9)
    assert p == pytest.approx(_student_two_sided(t, _welch_df(a, b)), rel=0.01)


def test_identical_versions_are_flagged_at_most_at_the_level() -> None:
    """Identical answers' lengths in windows of 30: the share of significant tests stays
    within the level each metric is tested at (`alpha` / 4)."""
    rng = random.Random(3)
    detector = DriftDetector(DriftConfig(window=30, alpha=0.04))
    level = 0.04 / 4
    tests = 8_000
    significant = 0
    for _ in range(tests):
        a = [rng.gauss(100.0, 50.0) for _ in range(30)]
        b = [rng.gauss(100.0, 50.0) for _ in range(30)]
        significant += detector.test("length", a, b).significant
    # expected: level * tests = 80 (sd 9); the normal reading gives about 1.4x that
    assert significant <= level * tests * 1.2
