"""The `ttft` policy's online least squares: the written-out four-feature update against the
general one."""

from __future__ import annotations

import random

import pytest

from edge.routing.ttft import PRIOR, RecursiveLeastSquares, default_bounds


def model() -> RecursiveLeastSquares:
    return RecursiveLeastSquares(
        PRIOR, forgetting=0.995, prior_scale=1.0, noise_s=0.01, bounds=default_bounds(PRIOR)
    )


@pytest.mark.parametrize("varied", [True, False], ids=["varied features", "constant features"])
def test_the_four_feature_update_gives_what_the_general_one_gives(varied: bool) -> None:
    """Varied features excite every direction; constant ones let P wind up to its cap, so the
    rescaling runs too. Outliers exercise the clipping and the bounds."""
    rng = random.Random(7)
    fast, general = model(), model()
    for i in range(3000):
        if varied or i == 0:
            x = [1.0, rng.uniform(0, 20), rng.uniform(0, 5), rng.uniform(0, 3)]
        y = 0.015 + 0.033 * x[1] + 0.001 * x[2] + rng.gauss(0, 0.002)
        if i % 97 == 0:
            y *= 50  # a request stuck behind a burst
        fast.update(x, y)
        general._update_any(x, y)
        assert fast.theta == general.theta and fast._p == general._p, f"after {i + 1}"
    assert fast.updates == general.updates == 3000
    if varied:  # it learned the line it was shown
        assert fast.theta[1] == pytest.approx(0.033, rel=0.05)


def test_other_sizes_take_the_general_update() -> None:
    rls = RecursiveLeastSquares([1.0, 1.0], forgetting=1.0, prior_scale=10.0, noise_s=1.0)
    for i in range(500):
        rls.update([1.0, float(i % 10)], 2.0 + 3.0 * (i % 10))
    assert rls.theta == pytest.approx([2.0, 3.0], abs=0.05) and rls.updates == 500
