"""The fleet services one edge process runs beside routing: hot-prefix tracking, pre-warming,
the shared view and the backends' KV-cache events, built from the `[prewarm]`, `[fleet_view]`
and `[kv_events]` sections. The `ttft` policy
feeds and reads them itself (one hash of the prompt for both); any other policy is wrapped so that
its routed prompts are counted for pre-warming, and routes without the shared view."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.pool import UpstreamPool
from backends.registry import Backend, BackendRegistry
from edge.routing.base import Decision, Outcome, RequestView, RoutingPolicy
from edge.routing.fleet_view import FleetView, FleetViewConfig
from edge.routing.hot_prefixes import HotPrefixes, model_of
from edge.routing.kv_events import KvEvents, KvEventsConfig
from edge.routing.prefix_blocks import BlockHasher
from edge.routing.prewarm import PrewarmConfig, PrewarmService
from edge.routing.ttft import TTFTPolicy


class CountingPolicy:
    """A policy whose routed prompts are counted in the hot-prefix tracker; otherwise itself."""

    def __init__(self, inner: RoutingPolicy, hasher: BlockHasher, hot: HotPrefixes) -> None:
        self.inner = inner
        self.name = inner.name
        self._hasher = hasher
        self._hot = hot

    def choose(self, view: RequestView, candidates: Sequence[Backend]) -> Decision:
        model = model_of(view.model, candidates)
        blocks = self._hasher.blocks(view.text)
        self._hot.record(model, blocks, view.messages, view.tools, token_ids=view.token_ids)
        return self.inner.choose(view, candidates)

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)

    def __getattr__(self, name: str) -> Any:  # the inner policy's own attributes (its tree)
        return getattr(self.inner, name)


@dataclass(eq=False)
class FleetServices:
    hasher: BlockHasher
    hot: HotPrefixes
    prewarm: PrewarmService | None
    view: FleetView | None
    policy: RoutingPolicy
    """The policy to route with: the one given, or it wrapped to count its prompts."""
    kv_events: KvEvents | None = None

    async def start(self) -> None:
        if self.view is not None:
            await self.view.start()
        if self.prewarm is not None:
            await self.prewarm.start()
        if self.kv_events is not None:
            await self.kv_events.start()

    async def aclose(self) -> None:
        if self.kv_events is not None:
            await self.kv_events.aclose()
        if self.prewarm is not None:
            await self.prewarm.aclose()
        if self.view is not None:
            await self.view.aclose()

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.prewarm is not None:
            out["prewarm"] = self.prewarm.snapshot()
        if self.view is not None:
            out["fleet_view"] = self.view.snapshot()
        if self.kv_events is not None:
            out["kv_events"] = self.kv_events.snapshot()
        return out

    def collector(self) -> Collector:
        return _FleetCollector(self)


class _FleetCollector(Collector):
    def __init__(self, services: FleetServices) -> None:
        self._services = services

    def collect(self) -> Iterator[Metric]:
        if self._services.prewarm is not None:
            yield from self._services.prewarm.collector().collect()
        view = self._services.view
        if view is not None:
            up = GaugeMetricFamily(
                "quicedge_fleet_view_connected", "1 while the last Redis exchange succeeded"
            )
            up.add_metric([], 1.0 if view.connected else 0.0)
            peers = GaugeMetricFamily("quicedge_fleet_view_peers", "Edge processes heard from")
            peers.add_metric([], len(view._peers))
            yield from (up, peers)
        if self._services.kv_events is not None:
            yield from self._services.kv_events.collect()


def build_fleet(
    prewarm: PrewarmConfig | None,
    fleet_view: FleetViewConfig | None,
    *,
    redis_url: str | None,
    registry: BackendRegistry,
    pool: UpstreamPool,
    policy: RoutingPolicy,
    kv_events: KvEventsConfig | None = None,
) -> FleetServices | None:
    """The services the sections turn on (None when all are off)."""
    warm = prewarm is not None and prewarm.enabled
    share = fleet_view is not None and fleet_view.enabled
    events = kv_events is not None and kv_events.enabled
    if not warm and not share and not events:
        return None
    block_chars = prewarm.block_chars if prewarm is not None else 1024
    hasher = BlockHasher(block_chars)
    ttft = policy if isinstance(policy, TTFTPolicy) else None
    hot = HotPrefixes(
        capacity=prewarm.capacity if prewarm is not None else 256,
        half_life_s=prewarm.half_life if prewarm is not None else 60.0,
    )
    view: FleetView | None = None
    if share:
        assert fleet_view is not None
        url = fleet_view.redis or redis_url
        if url is None:
            raise ValueError("fleet_view.redis: the shared view needs a Redis URL (or --redis)")
        view = FleetView(
            fleet_view,
            url=url,
            backends=registry.backends,
            coefficients=ttft.learned if ttft is not None else None,
            adopt=ttft.adopt if ttft is not None else None,
        )
        registry.on_track = view.nudge
    service: PrewarmService | None = None
    if warm:
        assert prewarm is not None

        def reset(url: str) -> None:
            # `ttft` forgets what the backend held and learns each warmed prefix back. Another
            # policy's tree is left as it was: the warm-up makes its belief (the hot prefixes
            # live there) true again, where forgetting them would leave the backend only cold
            # traffic for as long as the hot prefixes have other homes.
            if ttft is not None:
                ttft.forget(url)
            elif view is not None:
                view.forget(url)

        def warmed(url: str, text: str) -> None:
            if ttft is not None:
                ttft.holds(url, text)
            if view is not None:
                view.placed(url, hasher.blocks(text).hashes)

        service = PrewarmService(
            prewarm, registry=registry, pool=pool, hot=hot, on_reset=reset, on_warmed=warmed,
            claim=(lambda url, ttl: view.claim("warm:" + url, ttl)) if view is not None else None,
        )  # fmt: skip
    listener: KvEvents | None = None
    if events:
        assert kv_events is not None

        def cleared(backend: Backend) -> None:
            # The engine's own word that its cache is empty: what a restart found by the
            # request counter or a failed health check does, without waiting for either.
            if service is not None:
                service.warm_hot(backend, reason="cache cleared", reset=True)
                return
            tree = getattr(policy, "tree", None)
            if tree is not None:  # ttft, cache_aware: nothing is cached there any more
                tree.remove_tenant(backend.url)
            if view is not None:
                view.forget(backend.url)

        listener = KvEvents(kv_events, backends=registry.backends, on_cleared=cleared)
    routed: RoutingPolicy = policy
    if ttft is not None and (warm or share):
        ttft.attach(hasher, hot=hot if warm else None, fleet=view)
    elif warm:
        routed = CountingPolicy(policy, hasher, hot)
    return FleetServices(
        hasher=hasher, hot=hot, prewarm=service, view=view, policy=routed, kv_events=listener
    )


__all__ = ["CountingPolicy", "FleetServices", "build_fleet"]
