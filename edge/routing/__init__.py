"""Routing policies, chosen by name: round_robin, random, least_load, power_of_two, cache_aware
and ttft (the default). See docs/routing.md."""

from edge.routing import cache_aware, simple, ttft  # noqa: F401  (each registers its policies)
from edge.routing.base import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    Decision,
    NoCandidates,
    Outcome,
    RequestView,
    RoutingPolicy,
    make_policy,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Decision",
    "NoCandidates",
    "Outcome",
    "RequestView",
    "RoutingPolicy",
    "make_policy",
]
