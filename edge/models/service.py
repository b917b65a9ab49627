"""`Models`: what the app and the attempts call: pools, rollouts, shadows and their metrics.

Four calls on the request path, each O(1) or O(backends): `route` (after parsing: the body's
`model` to a pool and version), `prepare` (before forwarding: an alias becomes its pool's name,
and a request sampled for shadowing asks for logprobs and carries a tap), `candidates` (before
the policy: the registry's candidates narrowed to them) and `observe` (after each attempt:
per-pool metrics, the ramp's SLO window and maybe a shadow mirror).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CollectorRegistry

from backends.credentials import BackendCredentials
from backends.pool import UpstreamPool
from backends.registry import Backend, BackendRegistry
from edge.models.catalog import ModelCatalog
from edge.models.config import ModelsConfig, RolloutConfig
from edge.models.metrics import ModelMetrics
from edge.models.pools import ModelPools, Route
from edge.models.ramp import Ramp, Transition
from edge.models.rollout import Rollout
from edge.models.shadow import Shadow

if TYPE_CHECKING:
    from edge.exchange import Exchange
from edge.routing.breakers import Breakers

NO_VERDICT = frozenset({"disconnect", "overloaded", "refused", "cancelled"})
"""Attempt outcomes that say nothing of the version that served them: the client left, the edge
had no room, the guard model refused the prompt (`[policy.judge]` race), or the request was
cancelled (a background response's cancel, shutdown). The ramp counts none of them."""

CLIENT_ERRORS = frozenset({"4xx", "429"})
"""Attempt outcomes that may be the client's doing (a bad request, a prompt over the context
length, a rate limit): the ramp judges the canary's against stable's (`Ramp.observe`)."""

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
        self._catalog = catalog
        catalog.discover = config.discover
        self._backends = backends
        self._pool = pool
        self._clock = clock
        self._rng = rng
        self._credentials = credentials
        self._breakers = breakers
        self._abort: Callable[[Backend, str], None] | None = None
        self.ramps: dict[str, Ramp] = {}
        self.shadows: dict[str, Shadow] = {}
        self._retired: list[Shadow] = []
        """Shadows of restarted or removed rollouts, their mirrors cancelled, to be closed."""
        for r in config.rollouts:
            self._start(r)
        self.pools = ModelPools(
            config, backends=backends.backends, catalog=catalog,
            rollouts={name: ramp.rollout for name, ramp in self.ramps.items()}, rng=rng,
        )  # fmt: skip
        self.on_transition: list[Callable[[Rollout, Transition], None]] = []
        """Also told of every transition (the other workers hear of a rollback this way)."""

    def _start(self, config: RolloutConfig) -> Ramp:
        """A rollout from its first step: its ramp, its shadow and its share's gauge."""
        ramp = Ramp(config, clock=self._clock, on_transition=self._transition)
        shadow = Shadow(
            config, ramp=ramp, pool=self._pool, registry=self._backends, metrics=self.metrics,
            rng=self._rng, clock=self._clock, credentials=self._credentials,
            breakers=self._breakers,
        )  # fmt: skip
        if self._abort is not None:
            shadow.abort = self._abort
        self.ramps[config.model] = ramp
        self.shadows[config.model] = shadow
        self.metrics.canary_percent.labels(config.model).set(ramp.rollout.percent)
        return ramp

    def set_aborter(self, abort: Callable[[Backend, str], None]) -> None:
        """How a cancelled mirror is aborted on its canary (`/abort_request` by rid)."""
        self._abort = abort
        for shadow in self.shadows.values():
            shadow.abort = abort

    def _transition(self, rollout: Rollout, transition: Transition) -> None:
        self.metrics.transitions.labels(rollout.pool, transition.action).inc()
        self.metrics.canary_percent.labels(rollout.pool).set(rollout.percent)
        if transition.action in STOPS_TESTING:
            shadow = self.shadows.get(rollout.pool)
            if shadow is not None:
                shadow.cancel_all("rollout")
        for listener in self.on_transition:
            listener(rollout, transition)

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
        mine = self.pools.candidates(route, able)
        if mine or route.pool is None:
            return mine
        # `able` (`BackendRegistry.candidates`) keeps degraded and warming backends for when no
        # other backend can take the request, judged over the whole fleet: another pool's ready
        # backends, or another version's, cannot take this request, so they must not make it a
        # 503. Each version of the pool is judged by its own backends.
        return self.pools.candidates(route, self._able_in(route.pool))

    def _able_in(self, pool: str) -> list[Backend]:
        """The backends that may take a request of `pool`: as `BackendRegistry.candidates`
        chooses among the whole fleet, but among each version's of the pool."""
        registry, now = self._backends, self._clock()
        versions: dict[str | None, list[Backend]] = {}
        for b in registry.backends:
            if (b.model == pool or b.model is None) and registry.available(b, now):
                versions.setdefault(b.model_version, []).append(b)
        out: list[Backend] = []
        for members in versions.values():
            ready = [b for b in members if b.warming_until <= now] or members
            out += [b for b in ready if not b.degraded] or ready
        return out

    def to_stable(self, route: Route, *, refused: bool) -> None:
        """Send a canary request to the stable version. `refused`: the canary's breakers
        turned it away, which its ramp counts as a canary error (an open breaker would
        otherwise hide a failing canary from the rollback), unless one of the request's canary
        attempts failed already: one request is one canary error at most."""
        self.pools.to_stable(route)
        ramp = self.ramps.get(route.pool) if route.pool is not None else None
        if refused and ramp is not None and not route.canary_failed:
            ramp.observe(canary=True, error=True, ttft_s=None)

    def prepare(
        self, ex: Exchange, raw: bytes, body: Mapping[str, Any]
    ) -> tuple[bytes, Mapping[str, Any]]:
        """The body to forward, bytes and decoded: an alias is sent as its pool's name, and a
        stable request sampled for shadowing asks for the logprobs its tap reads (re-encoded
        from `body` once, only then). Sets `ex.shadow_tap` (and the stream's guard)."""
        route = ex.model_route
        if route is None or route.pool is None:
            return raw, body
        sent = body
        model = body.get("model")
        if isinstance(model, str) and model != route.pool and model in self.pools.aliases:
            sent = {**body, "model": route.pool}
        shadow = self.shadows.get(route.pool) if not route.canary else None
        if shadow is not None:
            inner = ex.stream_guard if ex.stream else None
            picked = shadow.sample(ex.route, sent, stream=ex.stream, inner=inner)
            if picked is not None:
                tap, fields = picked
                ex.shadow_tap = tap
                if ex.stream:
                    ex.stream_guard = tap
                if fields:
                    sent = {**sent, **fields}
        if sent is body:
            return raw, body
        return orjson.dumps(sent), sent

    def unsample(self, ex: Exchange) -> None:
        """`ex` was answered without a backend (from the response cache): a shadow that sampled
        it mirrors nothing, and takes back the rate token it spent (`Shadow.unsample`)."""
        tap, ex.shadow_tap = ex.shadow_tap, None
        route = ex.model_route
        if tap is None or route is None or route.pool is None:
            return
        shadow = self.shadows.get(route.pool)
        if shadow is not None:
            shadow.unsample()

    def observe(
        self,
        route: Route | None,
        backend: Backend,
        *,
        ttft_s: float | None,
        error: str | None,
        ex: Exchange | None = None,
    ) -> None:
        """One attempt's outcome; a stable reply read by a shadow tap (`ex.shadow_tap`) that
        succeeded is mirrored to the canary."""
        if route is None or route.pool is None:
            self.metrics.attempt(backend.model, backend.model_version, error, None)
            return
        ramp = self.ramps.get(route.pool)
        # TTFT per version only where versions are compared: elsewhere it is the backend's
        # `quicedge_upstream_ttft_seconds`, and a histogram costs ~2 us an observation.
        self.metrics.attempt(backend.model, backend.model_version, error,
                             ttft_s if ramp is not None else None)  # fmt: skip
        if ramp is None or error in NO_VERDICT:
            return
        canary = backend.model_version == ramp.rollout.canary
        if canary and error is not None and route.canary:  # (a shared route is never a canary's)
            route.canary_failed = True
        ramp.observe(canary=canary, error=error is not None, ttft_s=ttft_s,
                     client_error=error in CLIENT_ERRORS)  # fmt: skip
        tap = ex.shadow_tap if ex is not None else None
        if tap is not None and not canary and error is None:
            assert ex is not None
            self.shadows[route.pool].start(ex.route, ex.payload, ex.abort_rid or ex.request_id, tap)

    # -- admin ----------------------------------------------------------------------------
    async def restart(self, model: str, reason: str = "operator") -> Ramp:
        """Start `model`'s rollout again at its first step, from any state, a rollback
        included (the admin API's `restart`). KeyError when it has none."""
        ramp = self._restart(self.ramps[model].config, reason)
        await self._retire_shadows()
        return ramp

    def _restart(self, config: RolloutConfig, reason: str) -> Ramp:
        """Replace a rollout's ramp and shadow with fresh ones; the history carries on, with
        the restart in it. The old shadow's mirrors are cancelled (`_retire_shadows` ends
        them)."""
        old = self.ramps[config.model]
        self._retire(config.model, "restart")
        ramp = self._start(config)
        ramp.history.extend(old.history)
        ramp.restarted(reason)
        self.pools.rollouts[config.model] = ramp.rollout
        return ramp

    def _retire(self, model: str, reason: str) -> None:
        self.ramps.pop(model).retire()
        shadow = self.shadows.pop(model)
        shadow.cancel_all(reason)
        self._retired.append(shadow)

    async def _retire_shadows(self) -> None:
        retired, self._retired = self._retired, []
        for shadow in retired:
            await shadow.aclose()

    async def reconfigure(self, config: ModelsConfig) -> list[str]:
        """Apply a reloaded `[models]`: its default, discover, aliases and rollouts (the
        backends' labels and the sharing keys wait for a restart). A rollout whose entry is
        unchanged keeps its state; a changed one restarts at its first step; a new one starts;
        a removed one stops, and its pool's requests all go to whatever version they name.
        What changed, for the log."""
        done: list[str] = []
        old = {r.model: r for r in self.config.rollouts}
        new = {r.model: r for r in config.rollouts}
        for model in old.keys() - new.keys():
            self._retire(model, "removed")
            del self.pools.rollouts[model]
            self.metrics.canary_percent.remove(model)
            done.append(f"rollout {model} removed")
        for model, entry in new.items():
            if model not in old:
                self.pools.rollouts[model] = self._start(entry).rollout
                done.append(f"rollout {model} started")
            elif entry != old[model]:
                self._restart(entry, "config reload: its entry changed")
                done.append(f"rollout {model} restarted")
        aliases = {a.name: a.model for a in config.aliases}
        if aliases != self.pools.aliases:
            done.append("aliases")
        if config.default != self.config.default:
            done.append("default")
        if config.discover != self.config.discover:
            done.append("discover")
        # The backends' labels stay as the process started (a backend's isolation domain is
        # fixed while it serves), and so does everything else outside these four.
        self.config = replace(self.config, default=config.default, discover=config.discover,
                              aliases=config.aliases, rollouts=config.rollouts)  # fmt: skip
        self.pools.config = self.config
        self.pools.aliases = aliases
        self._catalog.discover = config.discover
        await self._retire_shadows()
        return done

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
        for shadow in [*self.shadows.values(), *self._retired]:
            await shadow.aclose()


__all__ = ["CLIENT_ERRORS", "NO_VERDICT", "Models"]
