"""Load-only policies: round_robin, random, least_load and power_of_two.

Load is the edge's own in-flight count (`Backend.in_flight`, kept by the registry), which is
exact and current, unlike a polled engine metric.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from backends.registry import Backend
from edge.routing.base import Decision, Outcome, RequestView, register_policy, usable


class _Stateless:
    name = ""

    def observe(self, outcome: Outcome) -> None:
        """Load-only policies learn nothing from outcomes."""


@register_policy("round_robin")
class RoundRobin(_Stateless):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, view: RequestView, candidates: Sequence[Backend]) -> Decision:
        pool = usable(candidates)
        backend = pool[self._next % len(pool)]
        self._next += 1
        return Decision(backend=backend, reason="round_robin")


@register_policy("random")
class Random(_Stateless):
    name = "random"

    def __init__(self, *, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, view: RequestView, candidates: Sequence[Backend]) -> Decision:
        return Decision(backend=self._rng.choice(usable(candidates)), reason="random")


@register_policy("least_load")
class LeastLoad(_Stateless):
    """Fewest requests in flight; ties go round-robin so an idle fleet is spread evenly."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, view: RequestView, candidates: Sequence[Backend]) -> Decision:
        pool = usable(candidates)
        n = len(pool)
        self._turn += 1
        best = min(range(n), key=lambda i: (pool[i].in_flight, (i - self._turn) % n))
        return Decision(backend=pool[best], reason="least_load")


@register_policy("power_of_two")
class PowerOfTwo(_Stateless):
    """Two random candidates, the less loaded one wins (Mitzenmacher's power of two choices)."""

    name = "power_of_two"

    def __init__(self, *, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, view: RequestView, candidates: Sequence[Backend]) -> Decision:
        pool = usable(candidates)
        if len(pool) == 1:
            return Decision(backend=pool[0], reason="power_of_two")
        a, b = self._rng.sample(range(len(pool)), 2)
        pick = pool[a] if pool[a].in_flight <= pool[b].in_flight else pool[b]
        return Decision(backend=pick, reason="power_of_two")


__all__ = ["LeastLoad", "PowerOfTwo", "Random", "RoundRobin"]
