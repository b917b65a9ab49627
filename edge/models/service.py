"""`Models`: what the app and the attempts call: pools, rollouts, shadows and their metrics.

Three calls on the request path, each O(1) or O(backends): `route` (after parsing: the body's
`model` to a pool and version), `candidates` (before the policy: the registry's candidates
narrowed to them) and `observe` (after each attempt: per-pool metrics, the ramp's SLO window and
maybe a shadow mirror).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from backends.credentials import BackendCredentials
from backends.pool import UpstreamPool
from backends.registry import Backend, BackendRegistry
from edge.models.catalog import ModelCatalog
from edge.models.config import ModelsConfig
from edge.models.metrics import ModelMetrics
from edge.models.pools import ModelPools, Route
from edge.models.ramp import Ramp, Transition
from edge.models.rollout import Rollout
from edge.models.shadow import Shadow
from edge.routing.breakers import Breakers

STOPS_TESTING = frozenset({"pause", "rollback", "promoted"})
"""Transitions that cancel the mirrors in flight: a paused canary may be slow, and after a
rollback or a promotion their answers compare nothing."""


class Models:
    def __init__(
        self,
        config: ModelsConfig,
        *,
        backends: BackendRegistry,
        catalog: ModelCatalog,
        pool: UpstreamPool,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
        credentials: BackendCredentials | None = None,
        breakers: Breakers | None = None,
    ) -> None:
        self.config = config
        self.metrics = ModelMetrics(registry)
        catalog.discover = config.discover
        self.ramps: dict[str, Ramp] = {
            r.model: Ramp(r, clock=clock, on_transition=self._transition) for r in config.rollouts
        }
        self.shadows: dict[str, Shadow] = {
            r.model: Shadow(
                r,
                ramp=self.ramps[r.model],
                pool=pool,
                registry=backends,
                metrics=self.metrics,
                rng=rng,
                clock=clock,
                credentials=credentials,
                breakers=breakers,
            )  # fmt: skip
            for r in config.rollouts
        }
        self.pools = ModelPools(
            config, backends=backends.backends, catalog=catalog,
            rollouts={name: ramp.rollout for name, ramp in self.ramps.items()}, rng=rng,
        )  # fmt: skip
        for name, ramp in self.ramps.items():
            self.metrics.canary_percent.labels(name).set(ramp.rollout.percent)

    def set_aborter(self, abort: Callable[[Backend, str], None]) -> None:
        """How a cancelled mirror is aborted on its canary (`/abort_request` by rid)."""
        for shadow in self.shadows.values():
            shadow.abort = abort

    def _transition(self, rollout: Rollout, transition: Transition) -> None:
        self.metrics.transitions.labels(rollout.pool, transition.action).inc()
        self.metrics.canary_percent.labels(rollout.pool).set(rollout.percent)
        if transition.action in STOPS_TESTING:
            shadow = self.shadows.get(rollout.pool)
            if shadow is not None:
                shadow.cancel_all("rollout")

    def route_now(
        self, model: Any, *, tenant: str | None, canary: bytes | None, session: bytes | None
    ) -> Route | None:
        """The request's pool and version when its name is known (no await); else None."""
        return self.pools.resolve_now(model, tenant=tenant, canary=canary, session=session)

    async def route(
        self, model: Any, *, tenant: str | None, canary: bytes | None, session: bytes | None
    ) -> Route:
        """The request's pool and version; 404 for a model the fleet does not serve."""
        return await self.pools.resolve(model, tenant=tenant, canary=canary, session=session)

    def candidates(self, route: Route | None, able: list[Backend]) -> list[Backend]:
        if route is None:
            return able
        return self.pools.candidates(route, able)

    def to_stable(self, route: Route, *, refused: bool) -> None:
        """Send a canary request to the stable version. `refused`: the canary's breakers
        turned it away, which its ramp counts as a canary error (an open breaker would
        otherwise hide a failing canary from the rollback)."""
        self.pools.to_stable(route)
        ramp = self.ramps.get(route.pool) if route.pool is not None else None
        if refused and ramp is not None:
            ramp.observe(canary=True, error=True, ttft_s=None)

    def observe(
        self,
        route: Route | None,
        backend: Backend,
        *,
        ttft_s: float | None,
        error: str | None,
        request: tuple[str, bytes, str] | None,
    ) -> None:
        """One attempt's outcome. `request` (route, payload, rid) lets a successful stable
        request be mirrored."""
        if route is None or route.pool is None:
            self.metrics.attempt(backend.model, backend.model_version, error, None)
            return
        ramp = self.ramps.get(route.pool)
        # TTFT per version only where versions are compared: elsewhere it is the backend's
        # `quicedge_upstream_ttft_seconds`, and a histogram costs ~2 us an observation.
        self.metrics.attempt(backend.model, backend.model_version, error,
                             ttft_s if ramp is not None else None)  # fmt: skip
        if ramp is None or error == "disconnect":
            return
        canary = backend.model_version == ramp.rollout.canary
        ramp.observe(canary=canary, error=error is not None, ttft_s=ttft_s)
        if not canary and error is None and request is not None:
            self.shadows[route.pool].mirror(*request)

    # -- admin ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        pools = {
            name: [
                {
                    "name": b.name,
                    "version": b.model_version,
                    "hw_group": b.hw_group,
                    "healthy": b.healthy,
                }
                for b in members
            ]  # fmt: skip
            for name, members in self.pools.pools().items()
        }
        return {
            "default": self.pools.default_pool(),
            "pools": pools,
            "aliases": dict(self.pools.aliases),
            "rollouts": [ramp.snapshot() for ramp in self.ramps.values()],
        }

    async def aclose(self) -> None:
        for shadow in self.shadows.values():
            await shadow.aclose()


__all__ = ["Models"]
