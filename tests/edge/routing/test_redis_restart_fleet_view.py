"""The fleet view across Redis losing its data under running edges: flushed (FLUSHALL), then
restarted empty on its port. The placements stream and the load channel come back on their own:
each view publishes and reads again, and hears the other's placements and load figures."""

from __future__ import annotations

import redis

from backends.pool import UpstreamPool
from backends.registry import BackendRegistry
from edge.routing.fleet_view import FleetView, FleetViewConfig
from tests.edge.silent_relay import SilentRelay
from tests.helpers import RedisServer, free_port, wait_until


async def test_placements_and_loads_are_shared_again_after_a_flush_and_a_restart() -> None:
    server = RedisServer()
    urls = [f"http://127.0.0.1:{free_port()}"]
    pools = [UpstreamPool(), UpstreamPool()]
    a, b = (BackendRegistry(urls, pool=pool) for pool in pools)
    config = FleetViewConfig(enabled=True, key="fv", interval=0.05, load_ttl=0.4, timeout=0.5)
    view_a = FleetView(config, url=server.url, backends=a.backends)
    view_b = FleetView(config, url=server.url, backends=b.backends)
    try:
        await view_a.start()
        await view_b.start()
        view_a.placed(urls[0], [1, 2, 3])
        await wait_until(lambda: view_b.depth(urls[0], [1, 2, 3]) == 3, timeout=5)
        with redis.Redis(port=server.port) as r:
            r.flushall()
        view_a.placed(urls[0], [4, 5])
        await wait_until(lambda: view_b.depth(urls[0], [4, 5]) == 2, timeout=5)
        server.stop()
        await wait_until(lambda: not view_a.connected and not view_b.connected, timeout=5)
        view_a.placed(urls[0], [6, 7])  # while Redis is away: kept, sent once it is back
        server = RedisServer(port=server.port)
        await wait_until(lambda: view_b.depth(urls[0], [6, 7]) == 2, timeout=10)
        assert view_a.connected and view_b.connected
        heard = view_b.loads_received
        await wait_until(lambda: view_b.loads_received > heard + 2, timeout=10)
        assert view_b.listening
        assert view_b.subscription.failures["error"] >= 1
    finally:
        await view_a.aclose()
        await view_b.aclose()
        for pool in pools:
            await pool.aclose()
        server.stop()


async def test_a_failover_that_moves_the_address_is_followed() -> None:
    """A failover behind one address (a Service, a VIP, DNS): the old master, now a replica,
    keeps the connections it had and answers their writes READONLY; new connections reach the
    new master. Each view's publishes must reach the new master, not fail for ever."""
    old, promoted = RedisServer(), RedisServer()
    urls = [f"http://127.0.0.1:{free_port()}"]
    pools = [UpstreamPool(), UpstreamPool()]
    a, b = (BackendRegistry(urls, pool=pool) for pool in pools)
    config = FleetViewConfig(enabled=True, key="fv", interval=0.05, timeout=0.5)
    async with SilentRelay(old.url) as relay:
        view_a = FleetView(config, url=relay.url, backends=a.backends)
        view_b = FleetView(config, url=relay.url, backends=b.backends)
        try:
            await view_a.start()
            await view_b.start()
            view_a.placed(urls[0], [1, 2, 3])
            await wait_until(lambda: view_b.depth(urls[0], [1, 2, 3]) == 3, timeout=5)
            with redis.Redis(port=old.port) as r:
                r.replicaof("127.0.0.1", str(promoted.port))
            relay.upstream = ("127.0.0.1", promoted.port)
            errors = view_a.errors
            await wait_until(lambda: view_a.errors > errors, timeout=5)  # READONLY
            view_a.placed(urls[0], [4, 5])
            await wait_until(lambda: view_b.depth(urls[0], [4, 5]) == 2, timeout=10)
            # none of their connections to the old master but the subscriptions' is left: those
            # hear what the new master publishes, as a replica gets it
            with redis.Redis(port=old.port) as r:
                me = str(r.client_id())

                def stale() -> list[object]:
                    return [c for c in r.client_list() if "P" not in c["flags"] and c["id"] != me]

                await wait_until(lambda: not stale(), timeout=10)
            errors, published = view_a.errors, view_a.published
            await wait_until(lambda: view_a.published >= published + 20, timeout=10)
            assert view_a.errors == errors and view_a.connected
            with redis.Redis(port=promoted.port) as r:
                assert r.xlen("fv") > 0
        finally:
            await view_a.aclose()
            await view_b.aclose()
            for pool in pools:
                await pool.aclose()
            old.stop()
            promoted.stop()
