"""Model pools: which backends serve the model a request names, and which version it gets.

A backend's pool is its `Backend.model` (from `[[models.backends]]`, else discovered by
`edge.models.catalog`); its version is `Backend.model_version`. `ModelPools.resolve` turns the
body's `model` (a pool name, an alias, `default` or absent) into a `Route` (pool, version) before
routing; `candidates` narrows the registry's candidates to that pool and version, so the routing
policy only ever sees backends that serve the request's model. A backend whose model is not known
yet serves every pool (the backend decides), as the edge did before it knew any model.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backends.backend import Backend
from backends.labels import DEFAULT_GROUP
from edge.errors import InvalidRequest, ModelNotFound, NoHealthyBackend
from edge.models.catalog import DEFAULT_MODEL, ModelCatalog
from edge.models.config import ModelsConfig
from edge.models.rollout import Rollout


@dataclass(slots=True)
class Route:
    """The pool and version one request goes to (None: any)."""

    pool: str | None
    version: str | None = None
    canary: bool = False
    """The version is the pool's canary."""
    canary_failed: bool = False
    """A canary attempt of this request failed, and its ramp counted it (`Models.observe`): the
    canary's breaker refusing its retry is no second error."""


ANY = Route(None)


class ModelPools:
    """Pools by model name, aliases, and the rollout of each pool that has one."""

    def __init__(
        self,
        config: ModelsConfig,
        *,
        backends: Sequence[Backend],
        catalog: ModelCatalog,
        rollouts: dict[str, Rollout] | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.config = config
        self.backends = backends
        self.catalog = catalog
        self.aliases = {a.name: a.model for a in config.aliases}
        self.rollouts: dict[str, Rollout] = rollouts or {}
        self._rng = rng
        self._plain: dict[str, Route] = {}
        self.apply_config()
        catalog.configure = self.apply_config

    def apply_config(self) -> None:
        """Set model, version and hardware group from `[[models.backends]]` (the config wins
        over discovery). Called again when discovery adds backends."""
        by_url = {b.url.rstrip("/"): b for b in self.config.backends}
        for backend in self.backends:
            entry = by_url.get(backend.url)
            if entry is None:
                continue
            if entry.model is not None or entry.version is not None:
                backend.set_model(
                    entry.model if entry.model is not None else backend.model,
                    entry.version if entry.version is not None else backend.model_version,
                )
            if entry.hardware_group != DEFAULT_GROUP:  # else its `hardware=` label, if any
                backend.set_hw_group(entry.hardware_group)
        self.catalog.pinned = {
            url for url, e in by_url.items() if e.model is not None and e.version is not None
        }

    # -- names --------------------------------------------------------------------------------
    def pools(self) -> dict[str, list[Backend]]:
        """Backends by pool, for the listing and the admin API."""
        out: dict[str, list[Backend]] = {}
        for b in self.backends:
            if b.model is not None:
                out.setdefault(b.model, []).append(b)
        return out

    def default_pool(self) -> str | None:
        """The pool of a request that names no model (or `default`): `[models] default`, else
        the only pool; None when no pool or several are known (see `_default`)."""
        if self.config.default is not None:
            return self.config.default
        only: str | None = None
        for b in self.backends:  # not those being removed: a pool the fleet leaves is none
            if b.model is not None and b.model != only and not b.draining:
                if only is not None:
                    return None  # a second pool
                only = b.model
        return only

    def _default(self) -> str | None:
        """`default_pool`, or 400 when several pools are served and none is the default: the
        edge will not pick one for the client (which one is "first" is an accident of the
        backend list)."""
        pool = self.default_pool()
        if pool is None and self.config.default is None:
            served = {b.model for b in self.backends if b.model is not None and not b.draining}
            if len(served) > 1:
                raise InvalidRequest(
                    "this endpoint serves several models and none is the default: name one as "
                    "`model`: " + ", ".join(sorted({*served, *self.aliases})),
                    param="model",
                    code="model_required",
                )
        return pool

    def resolve_now(self, model: Any, *, tenant: str | None, canary: bytes | None,
                    session: bytes | None) -> Route | None:  # fmt: skip
        """`resolve` without awaiting, for a name that is known (the hot path); None when the
        name needs the fleet's list."""
        if model is None or model == DEFAULT_MODEL:
            pool = self._default()
        else:
            pool = self.aliases.get(model, model)
            if not self._known(pool):
                return None
        if pool is None:
            return ANY
        return self._route(pool, tenant=tenant, canary=canary, session=session)

    def _route(self, pool: str, *, tenant: str | None, canary: bytes | None,
               session: bytes | None) -> Route:  # fmt: skip
        rollout = self.rollouts.get(pool)
        if rollout is None:
            route = self._plain.get(pool)
            if route is None:  # shared: a route without a rollout is never changed
                route = self._plain[pool] = Route(pool)
            return route
        to_canary = rollout.to_canary(tenant=tenant, header=canary, session=session,
                                      draw=self._rng)  # fmt: skip
        return Route(pool, rollout.canary if to_canary else rollout.stable, to_canary)

    async def resolve(self, model: Any, *, tenant: str | None, canary: bytes | None,
                      session: bytes | None) -> Route:  # fmt: skip
        """The route of a request whose body names `model` (None: `/generate`, or absent).

        Raises ModelNotFound (404) for a name that is neither a pool nor an alias, once the
        fleet's models are known."""
        if model is None or model == DEFAULT_MODEL:
            pool = self._default()
        else:
            pool = self.aliases.get(model, model)
            if not self._known(pool):
                await self.catalog.check(pool)  # refreshes a stale list; raises if unknown
                if not self._known(pool):
                    if self.catalog.known is None and not self.pools():
                        return ANY  # nothing is known yet: the backend decides
                    if self.catalog.known is not None and self._undiscovered():
                        # listed (the check passed) by a backend whose pool is not learned
                        return self._route(pool, tenant=tenant, canary=canary, session=session)
                    raise ModelNotFound(
                        f"The model `{model}` does not exist. Served: "
                        + ", ".join(sorted({*self.pools(), *self.aliases})),
                        param="model",
                    )
        if pool is None:
            return ANY
        return self._route(pool, tenant=tenant, canary=canary, session=session)

    def _known(self, pool: str) -> bool:
        return any(b.model == pool for b in self.backends)

    def _undiscovered(self) -> bool:
        """Discovery is off and some backend's model is not set by the config: its pool is
        never learned, so the models the backends list (the catalog's check) are served by
        those backends, which decide, as a backend not known yet does."""
        return not self.catalog.discover and any(b.model is None for b in self.backends)

    # -- routing ------------------------------------------------------------------------------
    def candidates(self, route: Route, able: list[Backend]) -> list[Backend]:
        """`able` narrowed to the route's pool and version. A canary with no backend that can
        take the request falls back to the stable version (the client is served), and so does
        one whose rollout was rolled back (or removed) since it was drawn; empty when the pool
        has none (the caller answers `no_backend`)."""
        pool = route.pool
        if pool is None:
            return able
        mine = [b for b in able if b.model == pool or b.model is None]
        if route.canary:
            rollout = self.rollouts.get(pool)
            if rollout is None or rollout.state == "rolled_back":
                # Drawn before a rollback (or the rollout's removal): what the request sends
                # now (a retry, an attempt after its wait for room) goes where new ones do.
                self.to_stable(route)
        if route.version is not None:
            exact = [b for b in mine if b.model_version == route.version]
            if not exact and route.canary:
                self.to_stable(route)
                exact = [b for b in mine if route.version in (None, b.model_version)]
            mine = exact
        return mine

    def to_stable(self, route: Route) -> None:
        """Move a canary route to its pool's stable version (any version, once a reload has
        removed the rollout the route was drawn from)."""
        assert route.pool is not None
        rollout = self.rollouts.get(route.pool)
        route.version, route.canary = rollout.stable if rollout is not None else None, False

    def no_backend(self, route: Route) -> NoHealthyBackend:
        if route.pool not in self.pools():  # `[models] default` naming a pool nothing serves
            return NoHealthyBackend(f"no backend serves model pool {route.pool}")
        what = route.pool if route.version is None else f"{route.pool} version {route.version}"
        return NoHealthyBackend(f"model pool {what} has no healthy backend that can take it now")

    # -- /v1/models ---------------------------------------------------------------------------
    async def listing(self) -> dict[str, Any]:
        """The fleet's models (the backends' cards, merged) and the aliases, OpenAI's shape."""
        listing = await self.catalog.listing()
        pools = self.pools()
        data = list(listing["data"])
        if pools and not self._undiscovered():
            # Only what a request may name: a card whose id is neither a pool nor an alias (the
            # served name of a backend `[[models.backends]]` puts in another pool) is a 404.
            data = [card for card in data if card["id"] in pools or card["id"] in self.aliases]
        ids = {card["id"] for card in data}
        for name in sorted(pools):
            if name not in ids:
                data.append({"id": name, "object": "model", "owned_by": "quicedge", "root": name})
                ids.add(name)
        for alias, pool in sorted(self.aliases.items()):
            if alias not in ids:
                data.append({"id": alias, "object": "model", "owned_by": "quicedge",
                             "root": pool, "parent": pool})  # fmt: skip
        return {"object": "list", "data": data}


__all__ = ["ANY", "ModelPools", "Route"]
