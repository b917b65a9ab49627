"""Shared drains across a failover behind one address (a Service, a VIP, DNS): the old master,
now a replica, keeps the connections it had and refuses their writes (READONLY), while new
connections reach the new master. A drain or undrain must reach the new master, not answer 503
for as long as the old connection is reused. Real Redis servers behind a relay."""

from __future__ import annotations

import redis

from backends.registry import BackendRegistry
from edge.backend_holds import SharedHolds
from tests.edge.silent_relay import SilentRelay
from tests.helpers import RedisServer, free_port


async def test_a_drain_after_a_failover_that_moves_the_address_reaches_the_new_master() -> None:
    old, promoted = RedisServer(), RedisServer()
    url = f"http://127.0.0.1:{free_port()}"
    registry = BackendRegistry([url], pool=None)
    name = registry.backends[0].name
    try:
        async with SilentRelay(old.url) as relay:
            holds = SharedHolds(registry, url=relay.url, key="drains", interval=3600.0)
            await holds.start()
            try:
                await holds.set(name, True)  # the connection to the old master is pooled
                with redis.Redis(port=promoted.port) as r:
                    r.hset("drains", name, b"{}")
                    r.set("drains:marker", b"{}")
                with redis.Redis(port=old.port) as r:
                    r.replicaof("127.0.0.1", str(promoted.port))
                relay.upstream = ("127.0.0.1", promoted.port)
                await holds.set(name, False)  # refused READONLY on the old connection
                assert registry.backends[0].held is False
                with redis.Redis(port=promoted.port) as r:
                    assert not r.hexists("drains", name)
            finally:
                await holds.aclose()
    finally:
        old.stop()
        promoted.stop()
