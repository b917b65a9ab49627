"""The shared routing view: two edge instances (two wirings) sharing a real Redis, in front of
real stand-ins; and what happens when that Redis goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

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
            # A request start tells the fleet at once (below: what that buys).
            assert b.wiring.registry.on_track == view.nudge
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


async def test_a_request_start_reaches_the_other_processes_without_waiting_for_a_look(
    redis_prefix: str,
) -> None:
    """Requests that arrive together at different processes are routed before any look: a
    start publishes at once (`nudge`), at most one message per `load_min_gap`."""
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    # Looks and batches far beyond the test: only a nudge can carry the figures in time.
    options = {"interval": 30.0, "load_interval": 30.0, "load_ttl": 120.0, "timeout": 5.0,
               "load_min_gap": 0.05}  # fmt: skip
    async with two_views(urls, redis_prefix, **options) as views:
        a, view_a, view_b = views.a, views.view_a, views.view_b
        a.on_track = view_a.nudge
        await wait_until(lambda: view_b.listening)
        async with aioredis.Redis.from_url(views.redis.url) as redis:  # Redis has B on the list
            channel = views.config.key + ":load"
            for _ in range(100):
                if (await redis.pubsub_numsub(channel))[0][1] == 2:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("both views did not subscribe in time")
        hot = a.backends[0].url
        with a.track(a.backends[0], prefill_tokens=3000):
            await wait_until(lambda: view_b.queued(hot) == (3000, 1, 1), timeout=5.0)
        # A burst of starts: every figure gets through, but in few messages.
        before, loop = view_a.loads_published, asyncio.get_running_loop()
        started = loop.time()
        with contextlib.ExitStack() as stack:
            for _ in range(40):
                stack.enter_context(a.track(a.backends[1], prefill_tokens=10))
                await asyncio.sleep(0.005)
            await wait_until(lambda: view_b.queued(a.backends[1].url) == (400, 40, 40), 5.0)
            elapsed = loop.time() - started
        assert view_a.loads_published - before <= elapsed / 0.05 + 1


def test_the_view_forgets_what_the_fleet_has_pushed_out_of_a_backends_cache() -> None:
    """Placements of every process, this one's included, in one recency order per backend:
    past the backend's capacity the oldest are taken as evicted, as its radix cache evicts."""
    view = FleetView(FleetViewConfig(enabled=True), url="redis://127.0.0.1:1/0", backends=[])
    url = "http://b0"
    view.placed(url, [1, 2, 3])
    assert view.depth(url, [1, 2, 3, 4]) == 3
    view.set_capacity(url, 6)
    view.placed(url, [10, 11])
    view.placed(url, [1])  # used again: the most recent now
    view.placed(url, [12, 13, 14])
    assert view.depth(url, [1, 2, 3]) == 1  # 2 and 3 are the oldest: gone
    assert view.depth(url, [10, 11, 12, 13, 14]) == 5
    view.set_capacity(url, 2)
    assert view.depth(url, [13, 14]) == 2 and view.depth(url, [12]) == 0


def test_a_process_does_not_trust_its_own_tree_for_what_the_fleet_has_evicted() -> None:
    """Each process's prefix tree sees only its own traffic. With other processes sending
    prompts to the same backend, a prefix this process placed long ago is gone there although
    its tree still holds it: the shared view's recency order says so, and the policy predicts
    a miss."""
    from edge.routing.base import RequestView
    from edge.routing.ttft import TTFTPolicy

    registry = BackendRegistry(["http://127.0.0.1:1", "http://127.0.0.1:2"], pool=UpstreamPool())
    a = registry.backends[0]
    view = FleetView(
        FleetViewConfig(enabled=True), url="redis://127.0.0.1:1/0", backends=registry.backends
    )
    hasher = BlockHasher()
    policy = TTFTPolicy()
    policy.attach(hasher, fleet=view)
    rng = random.Random(3)
    system = words(rng, 2000)

    def request() -> RequestView:
        text = system + words(rng, 40)
        return RequestView(route="/generate", text=text, approx_tokens=len(text) // 4)

    policy.holds(a.url, system)
    view.placed(a.url, hasher.blocks(system).hashes)
    view.set_capacity(a.url, 40)
    view.processes = 2  # another process routes to the same backends
    assert policy.choose(request(), [a]).predicted_cached_tokens > 1500
    for _ in range(5):  # the other process's prompts fill the backend's cache
        view.placed(a.url, hasher.blocks(words(rng, 2000)).hashes)
    assert policy.choose(request(), [a]).predicted_cached_tokens == 0
    view.processes = 1  # alone, the tree sees every request: it is trusted as it was
    assert policy.choose(request(), [a]).predicted_cached_tokens > 1500


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


async def test_entries_an_edge_cannot_read_are_skipped_and_the_sync_goes_on(
    redis_prefix: str,
) -> None:
    """Another version's entries, or garbage, in the shared stream (a rolling update, a stray
    writer): each is skipped, and placements keep reaching the other edges."""
    url = f"http://127.0.0.1:{free_port()}"  # never connected to
    async with two_views([url], redis_prefix, interval=0.05) as views:
        client = aioredis.Redis.from_url(views.redis.url)
        try:
            for fields in (
                {b"p": b"not json"},
                {b"p": b"[1, 2]"},
                {b"p": b'{"i": "old", "placed": {"u": "x"}, "theta": [1.0, 2.0], "n": "many"}'},
                {b"p": b'{"i": "old", "placed": [1, 2], "theta": "no"}'},
                {b"other": b"field"},
            ):
                await client.xadd(views.config.key, fields)  # type: ignore[arg-type]
        finally:
            await client.aclose()
        views.view_a.placed(url, [7, 8])
        await wait_until(lambda: views.view_b.depth(url, [7, 8]) == 2)
        assert views.view_b.errors == 0 and views.view_b.connected


async def test_an_edge_whose_clock_runs_ahead_of_redis_still_hears_the_fleet(
    redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stream entry ids are Redis's clock: an edge host whose clock runs ahead of it (by more
    than `ttl`) must not start reading from an id the fleet's entries reach only later."""
    import edge.routing.fleet_view as module

    url = f"http://127.0.0.1:{free_port()}"  # never connected to
    async with two_views([url], redis_prefix, interval=0.05) as views:
        ahead = types.SimpleNamespace(time=lambda: time.time() + 3600, monotonic=time.monotonic)
        monkeypatch.setattr(module, "time", ahead)
        late = FleetView(views.config, url=views.redis.url, backends=views.b.backends)
        await late.start()
        try:
            views.view_a.placed(url, [1, 2])
            await wait_until(lambda: late.depth(url, [1, 2]) == 2, timeout=5.0)
        finally:
            await late.aclose()


async def test_placements_on_backends_this_edge_does_not_route_are_not_kept(
    redis_prefix: str,
) -> None:
    """Entries naming backends this edge does not have (a stray writer, another fleet on the
    same key, a backend discovery removed) take no room in its mirror: otherwise every URL ever
    named keeps up to `max_blocks_per_backend` hashes for good."""
    known = f"http://127.0.0.1:{free_port()}"  # never connected to
    async with two_views([known], redis_prefix, interval=0.05) as views:
        client = aioredis.Redis.from_url(views.redis.url)
        try:
            stray = {f"http://10.9.{i // 250}.{i % 250}:1": list(range(100)) for i in range(500)}
            entry = orjson.dumps({"i": "stray", "placed": stray})
            await client.xadd(views.config.key, {b"p": entry})
        finally:
            await client.aclose()
        views.view_a.placed(known, [7, 8])
        await wait_until(lambda: views.view_b.depth(known, [7, 8]) == 2)
        assert set(views.view_b.snapshot()["remote_blocks"]) == {known}
        # Gone from discovery: what was heard of it goes too.
        await views.b.remove(views.b.backends[0].name, drain_timeout=0.1)
        await wait_until(lambda: views.view_b.snapshot()["remote_blocks"] == {})


async def test_load_figures_a_process_cannot_have_are_not_summed(redis_prefix: str) -> None:
    """A stray or broken publisher on the load channel: negative figures would make a backend
    look emptier than idle (every request would go there), and figures for backends this edge
    does not route to would only take room."""
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # never connected to
    async with two_views(urls, redis_prefix, interval=30.0, timeout=5.0) as views:
        view_b = views.view_b
        await wait_until(lambda: view_b.listening)
        client = aioredis.Redis.from_url(views.redis.url)
        try:
            rows = [[urls[0], -1_000_000, -5, -5], [urls[1], 300, 1, 1],
                    *([f"http://10.0.0.{i}:1", 1, 1, 1] for i in range(200))]  # fmt: skip
            message = orjson.dumps({"i": "stray", "l": rows})
            channel = (views.config.key + ":load").encode()
            await client.publish(channel, message)
            await wait_until(lambda: view_b.queued(urls[1]) == (300, 1, 1))
        finally:
            await client.aclose()
        assert view_b.queued(urls[0]) == (0, 0, 0)
        assert set(view_b._remote_load) <= set(urls)


async def test_what_a_process_placed_before_a_restart_is_not_told_after_it_forgot(
    redis_prefix: str,
) -> None:
    """Placements still waiting for the next publish when the backend restarted (the requests
    of the last interval) were told to the fleet after `forget`: every other process then took
    the empty cache for one holding them, for `ttl`."""
    url = f"http://127.0.0.1:{free_port()}"  # never connected to
    async with two_views([url], redis_prefix, interval=30.0, timeout=5.0) as views:
        view_a, view_b = views.view_a, views.view_b
        await wait_until(lambda: view_a.published and view_b.published)  # the first syncs
        view_a.placed(url, [1, 2])
        view_b.forget(url)  # B noticed the restart first
        view_a.forget(url)  # then A did, before its next publish
        view_a.placed(url, [3])  # a warm-up, after it
        await view_a.sync_once()
        await view_b.sync_once()
        assert view_b.depth(url, [3]) == 1
        assert view_b.depth(url, [1, 2]) == 0


def test_at_the_cap_the_least_recent_block_goes_first_wherever_it_was_heard_of() -> None:
    """The mirror's order at `max_blocks_per_backend`: a block placed again (here or by
    another process) moves to the recent end, what is dropped is always the least recent,
    and the list never holds more than the cap or the backend's pool."""
    cap = 8
    url = "http://b0"
    view = FleetView(
        FleetViewConfig(enabled=True, max_blocks_per_backend=cap),
        url="redis://127.0.0.1:1/0",
        backends=[],
    )
    expected: list[int] = []

    def heard(hashes: list[int], remote: bool) -> None:
        if remote:
            view._apply(orjson.dumps({"i": "other", "placed": {url: hashes}}), {url})
        else:
            view.placed(url, hashes)
        for h in hashes:
            if h in expected:
                expected.remove(h)
            expected.append(h)
        del expected[: max(0, len(expected) - min(cap, view._capacity.get(url, cap)))]

    rng = random.Random(11)
    for step in range(400):
        hashes = [rng.randrange(24) for _ in range(rng.randrange(1, 6))]
        heard(list(dict.fromkeys(hashes)), remote=step % 3 == 0)
        assert list(view._held[url]) == expected
        if step == 200:
            view.set_capacity(url, 5)
            del expected[: max(0, len(expected) - 5)]
            assert list(view._held[url]) == expected
    assert view.snapshot()["remote_blocks"] == {url: 5}
    assert view.depth(url, expected) == 5


def test_while_redis_is_away_the_oldest_untold_blocks_go_first() -> None:
    """Unpublished placements are bounded by `max_blocks_per_backend` too (oldest dropped);
    the next batch carries the survivors in the order they were placed, and what was told is
    remembered for at most the cap, the least recently told forgotten first."""
    url = "http://b0"
    view = FleetView(
        FleetViewConfig(enabled=True, max_blocks_per_backend=4, max_hashes_per_batch=3),
        url="redis://127.0.0.1:1/0",
        backends=[],
    )
    view.placed(url, [1, 2, 3])
    view.placed(url, [4, 5, 2])  # 2 is still untold: it keeps its place
    assert list(view._pending[url]) == [2, 3, 4, 5]
    _payload, placed = view._batch()
    assert placed == {url: [2, 3, 4]}
    assert list(view._pending[url]) == [5]
    assert list(view._published[url]) == [2, 3, 4]
    view._unsend(placed)  # that batch did not go out: told no one
    assert list(view._pending[url]) == [5, 2, 3, 4]
    assert list(view._published[url]) == []
    _payload, placed = view._batch()
    assert placed == {url: [5, 2, 3]}
    _payload, placed = view._batch()
    assert placed == {url: [4]}
    view.placed(url, [6, 7])
    _payload, placed = view._batch()
    assert placed == {url: [6, 7]}
    assert list(view._published[url]) == [3, 4, 6, 7]  # 5 and 2 told longest ago: forgotten
