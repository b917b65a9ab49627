"""Drift tests, the ramp controller and the traffic split, driven with generated samples (the
stand-in's logprob model, `bench.rollout.synthetic`) and a fake clock: deterministic seeds."""

from __future__ import annotations

import random

import pytest

from bench.rollout import FakeClock, false_alarms, pairs_until_pause, synthetic
from edge.models.config import DriftConfig, RolloutConfig
from edge.models.drift import DriftDetector, Sample, normal_sf, two_proportions, welch
from edge.models.ramp import MIN_ERROR_SAMPLES, Ramp
from edge.models.rollout import Rollout, session_point


def test_welch_and_the_normal_tail_match_known_values() -> None:
    assert normal_sf(1.959963985) == pytest.approx(0.025, abs=1e-6)
    t, p = welch([1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0, 5.0])
    assert t == pytest.approx(1 / (2 * 1.66667 / 4) ** 0.5, rel=1e-4)  # se: sqrt(va/na + vb/nb)
    assert 0 < p < 1
    assert welch([1.0, 1.0], [1.0, 1.0]) == (0.0, 1.0)
    z, p = two_proportions([1.0] * 50 + [0.0] * 50, [1.0] * 80 + [0.0] * 20)
    assert z > 4 and p < 1e-4


def test_identical_versions_raise_no_alarm_in_10000_pairs() -> None:
    assert false_alarms(random.Random(11), pairs=10_000, window=200) == 0


def test_identical_versions_ramp_to_100_percent() -> None:
    clock = FakeClock()
    config = RolloutConfig(model="m", stable="v1", canary="v2", step_requests=300,
                           step_seconds=30, drift=DriftConfig(window=200))  # fmt: skip
    ramp = Ramp(config, clock=clock)
    rng = random.Random(5)
    for _ in range(10_000):
        clock.now += 0.1
        ramp.add_pair(synthetic(rng), synthetic(rng))
        ramp.observe(canary=True, error=False, ttft_s=0.05)
        if ramp.rollout.state != "ramping":
            break
    assert ramp.rollout.state == "promoted", ramp.rollout.reason
    assert ramp.rollout.percent == 100
    actions = [t.action for t in ramp.history]
    assert actions == ["advance", "advance", "advance", "advance", "promoted"]
    assert ramp.drift.windows_tested > 0 and ramp.drift.alarms == 0


def test_a_top1_shift_of_008_pauses_at_the_first_step_with_the_reason() -> None:
    rng = random.Random(7)
    pairs = [pairs_until_pause(rng, shift=0.08, window=100, limit=3000) for _ in range(20)]
    assert all(p is not None for p in pairs)
    config = RolloutConfig(model="m", stable="v1", canary="v2", drift=DriftConfig(window=100))
    ramp = Ramp(config, clock=FakeClock())
    while ramp.rollout.state == "ramping":
        ramp.add_pair(synthetic(rng), synthetic(rng, shift=0.08))
    assert ramp.rollout.state == "paused" and ramp.step == 0 and ramp.rollout.percent == 1
    assert "top-1 probability" in ramp.rollout.reason
    # the pause holds: a shifted canary keeps it paused, and the share does not move
    for _ in range(300):
        ramp.add_pair(synthetic(rng), synthetic(rng, shift=0.08))
        ramp.observe(canary=True, error=False, ttft_s=0.01)
    assert ramp.rollout.state == "paused" and ramp.rollout.percent == 1


def test_an_entropy_change_holds_and_a_small_significant_shift_does_not() -> None:
    detector = DriftDetector(DriftConfig(window=100))
    rng = random.Random(3)
    results = []
    for _ in range(100):
        e = 1.0 + 0.1 * rng.random()
        results += detector.add(Sample(10, True, 0.7, e), canary=False)
        results += detector.add(Sample(10, True, 0.7, e * 1.3), canary=True)
    (entropy,) = [r for r in results if r.metric == "entropy"]
    assert entropy.action == "hold" and "+30%" in entropy.reason
    detector = DriftDetector(DriftConfig(window=100))
    results = []
    for _ in range(100):
        c = 0.7 + 0.01 * rng.random()
        results += detector.add(Sample(10, True, c, 1.0), canary=False)
        results += detector.add(Sample(10, True, c + 0.02, 1.0), canary=True)
    (top1,) = [r for r in results if r.metric == "top1"]
    assert top1.significant and top1.action == "none"  # 0.02 < 0.08: reported, not acted on


def test_a_canary_that_errors_is_rolled_back() -> None:
    config = RolloutConfig(model="m", stable="v1", canary="v2", max_error_rate=0.05)
    ramp = Ramp(config, clock=FakeClock())
    for i in range(MIN_ERROR_SAMPLES - 1):
        ramp.observe(canary=True, error=True, ttft_s=None)
        assert ramp.rollout.state == "ramping", i  # too few to be a rate
    ramp.observe(canary=True, error=True, ttft_s=None)
    assert ramp.rollout.state == "rolled_back" and ramp.rollout.percent == 0
    assert "error rate" in ramp.rollout.reason
    assert not ramp.rollout.to_canary(tenant=None, header=b"1", session=None, draw=lambda: 0)


def test_a_slow_canary_pauses_on_its_ttft_p99() -> None:
    clock = FakeClock()
    config = RolloutConfig(model="m", stable="v1", canary="v2", step_requests=50,
                           step_seconds=0, max_ttft_p99=0.5)  # fmt: skip
    ramp = Ramp(config, clock=clock)
    for _ in range(50):
        ramp.observe(canary=True, error=False, ttft_s=0.9)
    assert ramp.rollout.state == "paused" and "TTFT p99" in ramp.rollout.reason


def test_operator_actions() -> None:
    ramp = Ramp(RolloutConfig(model="m", stable="v1", canary="v2"), clock=FakeClock())
    ramp.promote()
    assert ramp.rollout.percent == 5 and ramp.rollout.state == "ramping"
    ramp.pause()
    assert ramp.rollout.state == "paused"
    ramp.promote()  # resumes at the same step
    assert ramp.rollout.state == "ramping" and ramp.rollout.percent == 5
    ramp.rollback()
    assert ramp.rollout.state == "rolled_back" and ramp.rollout.percent == 0
    with pytest.raises(ValueError, match="rolled back"):
        ramp.promote()
    assert [t.action for t in ramp.history] == ["advance", "pause", "resume", "rollback"]
    assert all(t.reason == "operator" for t in ramp.history)


def test_a_ramp_follows_a_step_another_process_reached_only_forward_and_while_ramping() -> None:
    config = RolloutConfig(model="m", stable="v1", canary="v2", steps=[1.0, 5.0, 25.0])
    leader, follower = Ramp(config, clock=FakeClock()), Ramp(config, clock=FakeClock())
    for _ in range(config.step_requests):
        follower.observe(canary=True, error=False, ttft_s=0.01)  # part of its step, then lost
    leader.promote()
    leader.promote()
    assert [t.step for t in leader.history] == [1, 2]
    follower.follow(2, "edge a: step done")
    assert follower.step == 2 and follower.rollout.percent == 25
    assert follower.step_requests == 0 and follower.rollout.reason == "edge a: step done"
    follower.follow(1, "late")  # heard out of order, or twice: nothing
    follower.follow(2, "twice")
    assert [(t.action, t.step) for t in follower.history] == [("advance", 2)]
    leader.promote()  # past the last step
    assert leader.history[-1].action == "promoted" and leader.history[-1].step == 3
    follower.follow(3, "edge a: promoted")
    assert follower.rollout.state == "promoted" and follower.rollout.percent == 100
    # A pause here is this process's own evidence; a rolled-back ramp stays rolled back.
    paused, rolled = Ramp(config, clock=FakeClock()), Ramp(config, clock=FakeClock())
    paused.pause()
    rolled.rollback()
    for ramp in (paused, rolled):
        ramp.follow(1, "edge a")
        assert ramp.step == 0 and len(ramp.history) == 1


def test_the_split_by_header_tenant_weight_and_session() -> None:
    r = Rollout("m", stable="v1", canary="v2", percent=25, tenants=frozenset({"beta"}))
    never, always = (lambda: 0.99), (lambda: 0.0)
    assert r.to_canary(tenant=None, header=b"1", session=None, draw=never)
    assert not r.to_canary(tenant=None, header=b"0", session=None, draw=always)
    assert r.to_canary(tenant="beta", header=None, session=None, draw=never)
    assert r.to_canary(tenant=None, header=None, session=None, draw=always)
    assert not r.to_canary(tenant=None, header=None, session=None, draw=never)
    sessions = [f"session-{i}".encode() for i in range(4000)]
    on = {s for s in sessions if r.to_canary(tenant=None, header=None, session=s, draw=never)}
    assert 0.2 < len(on) / len(sessions) < 0.3
    assert all(session_point(s) < 0.25 for s in on)  # the same in every process
    r.percent = 50  # a rising share only moves sessions to the canary
    later = {s for s in sessions if r.to_canary(tenant=None, header=None, session=s, draw=never)}
    assert on < later
