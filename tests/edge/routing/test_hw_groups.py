"""The `ttft` policy learns one speed per hardware group: a fleet of an H200-like backend
(3x faster prefill) and an A100-like one, fed by a queueing model of prefill (FIFO per backend,
Poisson arrivals at 90 % of the fleet's capacity, seeded), sends traffic in proportion to what
each can serve, and learns the slower group's per-token cost as the larger."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from backends.registry import Backend
from edge.routing.base import Outcome, RequestView
from edge.routing.ttft import TTFTPolicy

BASE_S = 0.015
A_S_PER_TOKEN = 33e-6
TOKENS = 2000


@dataclass
class Served:
    backend: Backend
    speed: float
    free_at: float = 0.0
    open: list[tuple[float, int]] = field(default_factory=list)

    @property
    def prefill_s(self) -> float:
        return BASE_S + A_S_PER_TOKEN / self.speed * TOKENS


def run(
    *, groups: bool, load: float = 0.9, n: int = 3000
) -> tuple[dict[str, int], float, TTFTPolicy]:
    rng = random.Random(1)
    policy = TTFTPolicy(learn_completions=False)
    fleet = [
        Served(Backend("fast", "http://fast:1", hw_group="h200" if groups else "default"), 3.0),
        Served(Backend("slow", "http://slow:1", hw_group="a100" if groups else "default"), 1.0),
    ]
    by_backend = {id(s.backend): s for s in fleet}
    capacity = sum(1 / s.prefill_s for s in fleet)
    t = 0.0
    counts = {"fast": 0, "slow": 0}
    ttfts: list[float] = []
    for k in range(n):
        t += rng.expovariate(capacity * load)
        for s in fleet:  # prefills that ended leave the backend's queue
            b = s.backend
            for _end, tokens in [o for o in s.open if o[0] <= t]:
                b.in_flight -= 1
                b.in_prefill -= 1
                b.in_flight_prefill_tokens -= tokens
            s.open = [o for o in s.open if o[0] > t]
        view = RequestView(route="/generate", text=f"{k} " + "x" * (4 * TOKENS - 6),
                           approx_tokens=TOKENS)  # fmt: skip
        decision = policy.choose(view, [s.backend for s in fleet])
        s = by_backend[id(decision.backend)]
        end = max(t, s.free_at) + s.prefill_s * (1 + 0.05 * rng.random())
        s.free_at = end
        s.backend.in_flight += 1
        s.backend.in_prefill += 1
        s.backend.in_flight_prefill_tokens += TOKENS
        s.open.append((end, TOKENS))
        policy.observe(Outcome(backend=s.backend, view=view, decision=decision, ttft_s=end - t,
                               prompt_tokens=TOKENS, cached_tokens=0))  # fmt: skip
        if k >= n // 3:  # after learning
            counts[s.backend.name] += 1
            ttfts.append(end - t)
    return counts, sum(ttfts) / len(ttfts), policy


def test_mixed_groups_get_traffic_in_proportion_to_their_speed() -> None:
    counts, mean_ttft, policy = run(groups=True)
    share = counts["fast"] / sum(counts.values())
    capacity_share = (1 / (BASE_S + A_S_PER_TOKEN / 3 * TOKENS)) / (
        1 / (BASE_S + A_S_PER_TOKEN / 3 * TOKENS) + 1 / (BASE_S + A_S_PER_TOKEN * TOKENS)
    )
    assert abs(share - capacity_share) < 0.08, (share, capacity_share)
    assert policy.coefficients("a100")[1] > 1.5 * policy.coefficients("h200")[1]
    # one shared set of coefficients cannot tell them apart: the slow one gets more, and
    # requests wait longer
    one_counts, one_mean, _ = run(groups=False)
    assert one_counts["fast"] / sum(one_counts.values()) < share - 0.04
    assert mean_ttft < one_mean
