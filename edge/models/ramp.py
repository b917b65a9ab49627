"""The ramp controller: moves a rollout's canary share through the operator's steps.

A step is held until the canary has served `step_requests` requests there and `step_seconds`
have passed; it advances only while the canary's SLOs hold (error rate over its last `window`
requests at most `max_error_rate`, TTFT p99 at most `max_ttft_p99`) and the last drift tests
found nothing. The error rate is the canary's server errors (a 5xx, a failed connection or
stream) plus its client errors (a 4xx, a 429) in excess of stable's client-error rate over
stable's last `STABLE_WINDOWS` × `window` requests, less `CLIENT_ERROR_Z` standard errors of
that difference: clients that send bad requests send them to both versions, which says nothing
of the canary, but a canary that refuses requests stable takes is failing. Otherwise:

- the error rate over the limit (with at least 20 requests seen) rolls back: share 0, every
  request to stable;
- a TTFT p99 over the limit, or a top-1 confidence shift, pauses it (share kept, no advance);
  with `auto` off, the TTFT p99 is still checked once a step would be done (at every
  `window`th canary request of the step from then on), though only the operator advances it;
- an entropy, length or finish-share change holds it for review (share kept, no advance).

`promote`, `pause` and `rollback` do the same by hand (the admin API). Every transition is logged
with its reason, counted in `quicedge_rollout_transitions_total{model,action}`, and kept (the
last 50) for `GET /rollouts`.

Several processes (workers, edges) each run a ramp from the same configuration. `take` applies
a transition another one took: a rollback or pause (`STOPS`) as it is, an advance or promotion
(`ADVANCES`) by going to the step it reached if this ramp is still ramping and behind, so that
the processes ramp as one, at the pace of the first whose share of the canary's requests
completes a step.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge.models.config import RolloutConfig, entry_digest
from edge.models.drift import DriftDetector, Sample, TestResult
from edge.models.rollout import Rollout

log = logging.getLogger(__name__)

STOPS = frozenset({"rollback", "pause"})
ADVANCES = frozenset({"advance", "promoted"})
"""The transitions other processes take too (`Ramp.take`)."""

MIN_ERROR_SAMPLES = 20
"""Canary requests seen before its error rate may roll it back (one early error is not a rate);
stable requests seen before its client-error rate is the canary's baseline (until then every
canary client error counts)."""
STABLE_WINDOWS = 5
"""Stable's client-error baseline is over this many windows of its requests: at a canary share
of 50 % or less it has as many in a shorter time, and a steadier baseline is a less noisy
difference."""
CLIENT_ERROR_Z = 3.0
"""Standard errors of the difference between the two versions' client-error rates that are
taken as sampling noise, not counted: the check runs on every canary request, and with 10 % of
clients sending bad requests a bare difference of the two windows' rates crosses 5 % often."""


@dataclass(frozen=True, slots=True)
class Transition:
    at: float
    action: str
    """advance, promoted, pause, hold, rollback, resume, restart."""
    percent: float
    reason: str
    step: int = 0
    """The step the ramp is at after it; the number of steps once promoted."""


class Ramp:
    """One pool's rollout and the controller that moves it."""

    def __init__(
        self,
        config: RolloutConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[Rollout, Transition], None] | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._on_transition = on_transition
        self.rollout = Rollout(
            config.model, stable=config.stable, canary=config.canary, percent=config.steps[0],
            tenants=frozenset(config.tenants),
            header_rule=config.header is not None, entry=entry_digest(config),
        )  # fmt: skip
        self.drift = DriftDetector(config.drift)
        self.step = 0
        self.step_started = clock()
        self.step_requests = 0
        self._errors: deque[bool] = deque(maxlen=config.drift.window)
        self._error_count = 0
        """Errors in `_errors`, kept as it slides (the check runs on every canary request)."""
        self._client: deque[bool] = deque(maxlen=config.drift.window)
        """Of the same canary requests, those that answered a client error (4xx, 429)."""
        self._client_count = 0
        self._stable_client: deque[bool] = deque(maxlen=config.drift.window * STABLE_WINDOWS)
        """Stable's last requests: whether each answered a client error (the baseline)."""
        self._stable_client_count = 0
        self._ttfts: deque[float] = deque(maxlen=config.drift.window)
        self.history: deque[Transition] = deque(maxlen=50)
        self.last_tests: list[TestResult] = []

    # -- inputs ---------------------------------------------------------------------------
    def observe(
        self, *, canary: bool, error: bool, ttft_s: float | None, client_error: bool = False
    ) -> None:
        """One live request's outcome (O(1) but for the p99 at a step's end): `error` it failed,
        `client_error` with a client error (4xx, 429), which is judged against stable's."""
        if not canary:
            window = self._stable_client
            if len(window) == window.maxlen:
                self._stable_client_count -= window[0]
            window.append(client_error)
            self._stable_client_count += client_error
            return
        self.step_requests += 1
        if len(self._errors) == self._errors.maxlen:
            self._error_count -= self._errors[0]  # the one the append pushes out
            self._client_count -= self._client[0]
        self._errors.append(error and not client_error)
        self._error_count += error and not client_error
        self._client.append(client_error)
        self._client_count += client_error
        if ttft_s is not None:
            self._ttfts.append(ttft_s)
        self.check()

    def add_pair(self, stable: Sample, canary: Sample) -> list[TestResult]:
        """One shadow pair; applies what a full window's tests found."""
        results = self.drift.add(stable, canary=False) + self.drift.add(canary, canary=True)
        if results:
            self.last_tests = results
            # The strongest action of the window, with every reason for it; a hold never
            # turns a pause back into a hold.
            for action in ("pause", "hold"):
                reasons = [r.reason for r in results if r.action == action]
                if reasons and self.rollout.state in ("ramping", "held"):
                    if action == "hold" and self.rollout.state == "held":
                        break
                    self._move(action, "drift: " + "; ".join(reasons))
                    break
        return results

    # -- the controller -------------------------------------------------------------------
    def error_rate(self) -> float:
        """The canary's server-error rate plus its client errors in excess of stable's."""
        return self.server_error_rate() + self.client_error_excess()

    def server_error_rate(self) -> float:
        return self._error_count / len(self._errors) if self._errors else 0.0

    def client_error_rates(self) -> tuple[float, float | None]:
        """The canary's client-error rate and stable's (None: too few stable requests yet)."""
        canary = self._client_count / len(self._client) if self._client else 0.0
        if len(self._stable_client) < MIN_ERROR_SAMPLES:
            return canary, None
        return canary, self._stable_client_count / len(self._stable_client)

    def client_error_excess(self) -> float:
        """The canary's client-error rate less stable's and less `CLIENT_ERROR_Z` standard
        errors of that difference (at least 0); all of it while stable has too few requests."""
        canary, stable = self.client_error_rates()
        if stable is None or canary <= stable:
            return canary if stable is None else 0.0
        n, m = len(self._client), len(self._stable_client)
        pooled = (self._client_count + self._stable_client_count) / (n + m)
        noise = CLIENT_ERROR_Z * math.sqrt(pooled * (1 - pooled) * (1 / n + 1 / m))
        return max(0.0, canary - stable - noise)

    def ttft_p99(self) -> float | None:
        if not self._ttfts:
            return None
        ordered = sorted(self._ttfts)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]

    def check(self) -> None:
        """Roll back, pause or advance as the SLOs and the step's progress say."""
        r = self.rollout
        cfg = self.config
        if r.state in ("rolled_back", "promoted"):
            return
        if len(self._errors) >= MIN_ERROR_SAMPLES and self.error_rate() > cfg.max_error_rate:
            self._move("rollback", f"canary error rate {self.error_rate():.1%} > "
                                   f"{cfg.max_error_rate:.1%}{self._client_part()}")  # fmt: skip
            return
        if r.state != "ramping":
            return
        if self.step_requests < cfg.step_requests:
            return
        if self._clock() - self.step_started < cfg.step_seconds:
            return
        if not cfg.auto and (cfg.max_ttft_p99 is None or self.step_requests % cfg.drift.window):
            # The operator advances it; its TTFT p99 is still checked once the step would be
            # done, at every `window`th canary request of the step (the p99 sorts the window).
            return
        p99 = self.ttft_p99()
        if cfg.max_ttft_p99 is not None and p99 is not None and p99 > cfg.max_ttft_p99:
            self._move("pause", f"canary TTFT p99 {p99 * 1000:.0f} ms > "
                                f"{cfg.max_ttft_p99 * 1000:.0f} ms")  # fmt: skip
            return
        if not cfg.auto:
            return
        done = f"{self.step_requests} canary requests, error rate {self.error_rate():.1%}"
        self._advance("step done: " + done)

    def _client_part(self) -> str:
        """What client errors added to the error rate, for a rollback's reason."""
        excess = self.client_error_excess()
        if not excess:
            return ""
        canary, stable = self.client_error_rates()
        baseline = "too few stable requests" if stable is None else f"stable {stable:.1%}"
        return f" (client errors: {excess:.1%} of it; canary {canary:.1%}, {baseline})"

    def _advance(self, reason: str) -> None:
        self._go_to(self.step + 1, reason)

    def _go_to(self, step: int, reason: str) -> None:
        """Start step `step`; past the last one, promote."""
        steps = self.config.steps
        if step >= len(steps):
            self.rollout.percent = 100.0
            self._move("promoted", reason)
            return
        self.step = step
        self._start_step()
        self.rollout.percent = steps[step]
        self._move("advance", reason)
        if self.rollout.percent >= 100:
            self._move("promoted", "reached 100 %")

    def _start_step(self) -> None:
        self.step_started = self._clock()
        self.step_requests = 0

    def _move(self, action: str, reason: str) -> None:
        r = self.rollout
        if action == "rollback":
            r.percent = 0.0
            r.state = "rolled_back"
        elif action in ("pause", "hold"):
            r.state = "paused" if action == "pause" else "held"
        elif action == "promoted":
            r.state = "promoted"
        elif action in ("advance", "resume", "restart"):
            r.state = "ramping"
        r.reason = reason
        step = len(self.config.steps) if r.state == "promoted" else self.step
        transition = Transition(self._clock(), action, r.percent, reason, step)
        self.history.append(transition)
        log.warning("rollout %s: %s at %.4g %% (%s)", r.pool, action, r.percent, reason)
        if self._on_transition is not None:
            self._on_transition(r, transition)

    def retire(self) -> None:
        """Taken out of service (its rollout restarted or removed): a late mirror's pair may
        still reach it, but its transitions are no longer told to anyone."""
        self._on_transition = None

    def restarted(self, reason: str) -> None:
        """Record that this fresh ramp restarts its rollout (counted and told as any move)."""
        self._move("restart", reason)

    # -- the admin API --------------------------------------------------------------------
    def promote(self, reason: str = "operator") -> None:
        """Resume a paused or held ramp at its step, or advance a ramping one a step."""
        if self.rollout.state == "rolled_back":
            raise ValueError(
                f"rollout {self.rollout.pool} was rolled back; restart it (POST "
                f"/rollouts/{self.rollout.pool}/restart, or a reload that changes its entry)"
            )
        if self.rollout.state in ("paused", "held"):
            self._start_step()
            self._move("resume", reason)
        elif self.rollout.state == "ramping":
            self._advance(reason)

    def pause(self, reason: str = "operator") -> None:
        if self.rollout.state in ("ramping", "held"):
            self._move("pause", reason)

    def rollback(self, reason: str = "operator") -> None:
        if self.rollout.state != "rolled_back":
            self._move("rollback", reason)

    def take(self, action: str, step: int, reason: str) -> None:
        """A transition another process's ramp took (one of `STOPS` or `ADVANCES`), here too."""
        if action in ADVANCES:
            self.follow(step, reason)
        elif action == "rollback":
            self.rollback(reason)
        elif action == "pause":
            self.pause(reason)

    def follow(self, step: int, reason: str) -> None:
        """Another process's ramp reached `step` (`len(steps)`: promoted); go there if behind.

        Only a ramping ramp follows: a pause or hold here is this process's own evidence, and a
        rollback or promotion is final. Idempotent, so hearing one advance twice is harmless."""
        if self.rollout.state == "ramping" and self.step < step <= len(self.config.steps):
            self._go_to(step, reason)

    def snapshot(self) -> dict[str, Any]:
        r = self.rollout
        now = self._clock()
        p99 = self.ttft_p99()
        canary_4xx, stable_4xx = self.client_error_rates()
        return {
            "model": r.pool, "stable": r.stable, "canary": r.canary, "state": r.state,
            "reason": r.reason, "percent": r.percent, "step": self.step,
            "steps": list(self.config.steps), "step_requests": self.step_requests,
            "step_age_s": round(now - self.step_started, 3),
            "canary_error_rate": round(self.error_rate(), 4),
            "canary_client_error_rate": round(canary_4xx, 4),
            "stable_client_error_rate": None if stable_4xx is None else round(stable_4xx, 4),
            "canary_ttft_p99_ms": None if p99 is None else round(p99 * 1000, 2),
            "drift_windows_tested": self.drift.windows_tested,
            "last_tests": [
                {"metric": t.metric, "stable": round(t.stable_mean, 4),
                 "canary": round(t.canary_mean, 4), "p": t.p_value, "action": t.action}
                for t in self.last_tests
            ],
            "history": [
                {"age_s": round(now - t.at, 3), "action": t.action, "percent": t.percent,
                 "reason": t.reason}
                for t in self.history
            ],
        }  # fmt: skip


__all__ = [
    "ADVANCES",
    "CLIENT_ERROR_Z",
    "MIN_ERROR_SAMPLES",
    "STABLE_WINDOWS",
    "STOPS",
    "Ramp",
    "Transition",
]
