"""The shared routing view: two edge instances (two wirings) sharing a real Redis, in front of
real stand-ins; and what happens when that Redis goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from backends.pool import UpstreamPool
from backends.registry import BackendRegistry
from edge.routing.fleet_view import FleetView, FleetViewConfig
from edge.routing.prefix_blocks import BlockHasher
from tests.edge.conftest import Edge, client, fast_config, run_edge
from tests.edge.routing.test_prewarm import generate, sim_config, sims, words
from tests.helpers import RedisServer, free_port, wait_until


def view_of(edge: Edge) -> FleetView:
    assert edge.wiring.fleet is not None and edge.wiring.fleet.view is not None
    return edge.wiring.fleet.view


def url_of(edge: Edge, name: str) -> str:
    backend = edge.wiring.registry.get(name)
    assert backend is not None
    return backend.url


@dataclass
class TwoViews:
    """Two processes' views of one real Redis, over registries of the same backend URLs."""

    redis: RedisServer
    config: FleetViewConfig
    a: BackendRegistry
    b: BackendRegistry
    view_a: FleetView
    view_b: FleetView


@contextlib.asynccontextmanager
async def two_views(urls: list[str], redis_prefix: str, **options: Any) -> AsyncIterator[TwoViews]:
    """Both views started; everything (and whichever Redis `redis` is then) stopped after."""
    redis = RedisServer()
    pools = [UpstreamPool(), UpstreamPool()]
    a, b = (BackendRegistry(urls, pool=pool) for pool in pools)
    config = FleetViewConfig(enabled=True, redis=redis.url, key=redis_prefix + "fv", **options)
    both = TwoViews(
        redis, config, a, b,
        FleetView(config, url=redis.url, backends=a.backends),
        FleetView(config, url=redis.url, backends=b.backends),
    )  # fmt: skip
    try:
        await both.view_a.start()
        await both.view_b.start()
        yield both
    finally:
        await both.view_a.aclose()
        await both.view_b.aclose()
        for pool in pools:
            await pool.aclose()
        both.redis.stop()


async def test_an_instance_routes_a_prefix_where_another_instance_placed_it(
    redis_url: str, redis_prefix: str
) -> None:
    rng = random.Random(5)
    prefixes = [words(rng, 900) for _ in range(4)]
    shared = FleetViewConfig(enabled=True, redis=redis_url, key=redis_prefix + "fv", interval=0.05)
    async with sims(sim_config("b0"), sim_config("b1"), sim_config("b2")) as servers:
        config = fast_config([s.url for s in servers], policy="ttft")
        async with (
            run_edge(config, fleet_view=shared) as a,
            run_edge(config, fleet_view=shared) as b,
            client(a) as http_a,
            client(b) as http_b,
        ):
            # One request of its own first, so A's tie-breaking turn is not B's: without the
            # shared view, B would put each prefix on a different backend than A did.
            await generate(http_a, words(rng, 50))
            placed = [(await generate(http_a, p + words(rng, 40)))[0] for p in prefixes]
            assert len(set(placed)) > 1  # spread: a match below is not one backend for all
            hasher = BlockHasher()
            view = view_of(b)
            for prefix, name in zip(prefixes, placed, strict=True):
                hashes = hasher.blocks(prefix).hashes
                await wait_until(
                    lambda h=hashes, u=url_of(b, name): view.depth(u, h) == len(h)  # type: ignore[misc]
                )
            for prefix, name in zip(prefixes, placed, strict=True):
                chosen, meta = await generate(http_b, prefix + words(rng, 40))
                assert chosen == name
                assert meta["cached_tokens"] > 0.6 * meta["prompt_tokens"]
            backends = (await httpx.AsyncClient().get(b.admin_url + "/backends")).json()
            assert backends["fleet_view"]["connected"] and backends["fleet_view"]["peers"] == 1
            # Each shares its coefficients too: both report the other's.
            assert view_of(a).received > 0 and view.received > 0


async def test_losing_redis_degrades_to_local_knowledge_without_errors(
    redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(6)
    system = words(rng, 900)
    redis = RedisServer()
    try:
        shared = FleetViewConfig(
            enabled=True, redis=redis.url, key=redis_prefix + "fv", interval=0.05
        )
        async with sims(sim_config("b0"), sim_config("b1")) as servers:
            config = fast_config([s.url for s in servers], policy="ttft")
            async with run_edge(config, fleet_view=shared) as edge, client(edge) as http:
                view = view_of(edge)
                await generate(http, system + words(rng, 40))
                await wait_until(lambda: view.connected and view.published > 0)
                redis.stop()
                caplog.set_level(logging.WARNING, logger="edge.routing.fleet_view")
                await wait_until(lambda: not view.connected)
                homes = set()
                for _ in range(10):  # every request answered, the prefix kept where it is cached
                    name, meta = await generate(http, system + words(rng, 40))
                    homes.add(name)
                    assert meta["cached_tokens"] > 0.6 * meta["prompt_tokens"]
                assert len(homes) == 1
                await wait_until(lambda: view.errors >= 3)
                warnings = [r for r in caplog.records if "fleet view" in r.getMessage()]
                assert len(warnings) == 1  # at a bounded rate, not once per attempt
    finally:
        redis.stop()


async def test_an_edge_starts_and_serves_when_its_redis_is_not_there(redis_prefix: str) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    shared = FleetViewConfig(enabled=True, redis=dead, key=redis_prefix + "fv", interval=0.05)
    async with sims(sim_config("b0")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        async with run_edge(config, fleet_view=shared) as edge, client(edge) as http:
            for _ in range(3):
                await generate(http, words(random.Random(7), 300))
            await wait_until(lambda: view_of(edge).errors >= 2)
            assert not view_of(edge).connected


async def test_each_process_sees_the_others_in_flight_work_as_it_changes(
    redis_prefix: str,
) -> None:
    from edge.routing.base import RequestView
    from edge.routing.ttft import TTFTPolicy

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # never connected to
    # A publish interval far beyond the test: only the load channel can carry the figures.
    async with two_views(urls, redis_prefix, interval=30.0, timeout=5.0) as views:
        a, b, view_a, view_b = views.a, views.b, views.view_a, views.view_b
        await wait_until(lambda: view_b.processes == 2 and view_a.processes == 2)
        hot = b.backends[0].url
        with (
            a.track(a.backends[0], prefill_tokens=3000) as first,
            a.track(a.backends[0], prefill_tokens=2000),
        ):
            await wait_until(lambda: view_b.queued(hot) == (5000, 2, 2))
            # B's `ttft` policy counts A's queue there as its own.
            policy = TTFTPolicy()
            policy.attach(BlockHasher(), fleet=view_b)
            request = RequestView(route="/generate", text="x" * 400, approx_tokens=100)
            assert policy.choose(request, b.backends).backend.url != hot
            busy, idle = (policy.features(k, 0, request) for k in b.backends)
            assert busy[1] - idle[1] == pytest.approx(5000 * 1e-3)
            first.first_token()  # its prefill is over: decoding now
            await wait_until(lambda: view_b.queued(hot) == (2000, 1, 2))
        await wait_until(lambda: view_b.queued(hot) == (0, 0, 0))
        # Redis gone: what A said ages out and B routes on its own counts alone.
        with a.track(a.backends[1], prefill_tokens=700):
            await wait_until(lambda: view_b.queued(b.backends[1].url) == (700, 1, 1))
            views.redis.stop()
            await wait_until(lambda: view_b.processes == 1 and view_b.errors > 0)
            assert view_b.queued(b.backends[1].url) == (0, 0, 0)


async def test_placements_made_while_redis_is_gone_reach_the_fleet_when_it_returns(
    redis_prefix: str,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # never connected to
    async with two_views([url], redis_prefix, interval=0.05, timeout=0.5) as views:
        view_a, view_b = views.view_a, views.view_b
        view_a.placed(url, [1, 2])
        await wait_until(lambda: view_b.depth(url, [1, 2]) == 2)
        views.redis.stop()
        await wait_until(lambda: not view_a.connected)
        view_a.placed(url, [3, 4, 5])
        await asyncio.sleep(views.config.interval * 6)  # Redis stays away for several publishes
        views.redis = RedisServer(port=views.redis.port)  # back, empty
        await wait_until(lambda: view_b.depth(url, [3, 4, 5]) == 3)
        assert view_a.connected
