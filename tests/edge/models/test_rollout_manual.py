"""A ramp the operator moves (`auto = false`): it never advances by itself, but its SLO checks
still stop it (docs/models.md, "Drift detection": pauses, holds and rollbacks still happen),
the canary's TTFT p99 over `max_ttft_p99` included."""

from __future__ import annotations

from bench.rollout import FakeClock
from edge.models.config import DriftConfig, RolloutConfig
from edge.models.ramp import Ramp


def _ramp(*, auto: bool) -> tuple[Ramp, FakeClock]:
    clock = FakeClock()
    config = RolloutConfig(model="m", stable="v1", canary="v2", auto=auto, step_requests=50,
                           step_seconds=1.0, max_ttft_p99=0.5,
                           drift=DriftConfig(window=40))  # fmt: skip
    return Ramp(config, clock=clock), clock


def test_a_manual_ramp_pauses_on_a_slow_canary_and_does_not_advance() -> None:
    ramp, clock = _ramp(auto=False)
    for _ in range(120):
        clock.now += 0.1
        ramp.observe(canary=True, error=False, ttft_s=2.0)
    assert ramp.rollout.state == "paused", ramp.snapshot()
    assert ramp.rollout.reason == "canary TTFT p99 2000 ms > 500 ms"
    assert ramp.step == 0 and [t.action for t in ramp.history] == ["pause"]
    ramp.promote()  # the operator's promote resumes it at its step first
    assert (ramp.rollout.state, ramp.step) == ("ramping", 0)


def test_a_manual_ramp_with_a_fast_canary_waits_for_the_operator() -> None:
    ramp, clock = _ramp(auto=False)
    for _ in range(400):
        clock.now += 0.1
        ramp.observe(canary=True, error=False, ttft_s=0.1)
    assert (ramp.rollout.state, ramp.step, list(ramp.history)) == ("ramping", 0, [])
    ramp.promote()
    assert (ramp.rollout.state, ramp.step, ramp.rollout.percent) == ("ramping", 1, 5.0)


def test_an_automatic_ramp_pauses_on_a_slow_canary_at_the_steps_end() -> None:
    ramp, clock = _ramp(auto=True)
    for _ in range(120):
        clock.now += 0.1
        ramp.observe(canary=True, error=False, ttft_s=2.0)
    assert ramp.rollout.state == "paused" and ramp.step == 0
