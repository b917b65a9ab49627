"""Backends added and removed at run time (what discovery does)."""

from __future__ import annotations

import asyncio

import pytest

from backends.registry import BackendRegistry
from tests.helpers import wait_until


async def test_add_remove_and_add_back_while_draining() -> None:
    registry = BackendRegistry([], pool=None, allow_empty=True)
    assert registry.candidates() == []
    one = registry.add("http://127.0.0.1:30001")
    assert registry.get("127.0.0.1:30001") is one and registry.candidates() == [one]
    assert registry.add("http://127.0.0.1:30001/") is one
    with pytest.raises(ValueError, match="already in the registry"):
        registry.add("http://127.0.0.1:30002", name=one.name)
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        registry.add("https://127.0.0.1:30002")
    with registry.track(one, prefill_tokens=10):
        removal = asyncio.ensure_future(registry.remove(one.name, drain_timeout=30))
        await wait_until(lambda: one.draining)
        assert registry.candidates() == [] and one in registry.backends
        assert registry.add(one.url) is one  # back before it drained: kept, not removed
        await removal
        assert not one.draining and registry.candidates() == [one]
    with registry.track(one, prefill_tokens=10):
        removal = asyncio.ensure_future(registry.remove(one.name, drain_timeout=30))
        await wait_until(lambda: one.draining)
        assert not removal.done()  # waits for the request in flight
    await asyncio.wait_for(removal, 10)
    assert registry.backends == [] and registry.get(one.name) is None
    await registry.remove("no-such-backend", drain_timeout=1)  # ignored


async def test_a_removal_gives_up_waiting_after_its_drain_timeout() -> None:
    registry = BackendRegistry(["http://127.0.0.1:30001"], pool=None)
    backend = registry.backends[0]
    with registry.track(backend, prefill_tokens=0):
        await asyncio.wait_for(registry.remove(backend.name, drain_timeout=0.1), 10)
        assert registry.backends == [] and backend.in_flight == 1
    assert backend.in_flight == 0  # the request's own accounting still ends in `finally`


def test_an_empty_registry_needs_allow_empty() -> None:
    with pytest.raises(ValueError, match="at least one backend"):
        BackendRegistry([], pool=None)


async def test_a_url_the_registry_refuses_does_not_stop_the_other_changes() -> None:
    """One found URL the registry cannot take (a second spelling of a backend it holds) is
    left out; the other additions and the drains still happen."""
    from backends.discovery import apply_membership

    registry = BackendRegistry(["http://127.0.0.1:80", "http://127.0.0.1:8001"], pool=None)
    wanted = {url: url for url in ("http://127.0.0.1", "http://127.0.0.1:8002")}
    drains: set[asyncio.Task[None]] = set()
    apply_membership(registry, wanted, 0.0, drains)
    await asyncio.gather(*drains)
    assert sorted(b.url for b in registry.backends) == ["http://127.0.0.1:8002"]
    apply_membership(registry, wanted, 0.0, drains)  # the next refresh takes the other
    assert sorted(b.url for b in registry.backends) == ["http://127.0.0.1", "http://127.0.0.1:8002"]


async def test_a_removed_backend_leaves_the_pool_too() -> None:
    """Discovery replaces pods (new addresses) on every rollout: a removed backend's pool
    entry, and the `quicedge_upstream_connections` series read from it, must go with it."""
    from backends.pool import UpstreamPool
    from backends.sim import SimConfig, SimServer

    pool = UpstreamPool()
    async with SimServer(SimConfig(name="a", port=0, profile="instant")) as sim:
        registry = BackendRegistry([sim.url], pool=pool, warm_connections=2)
        try:
            await registry.start()
            assert pool.stats().backends[sim.url].idle == 2
            await registry.remove(registry.backends[0].name, drain_timeout=0)
            assert sim.url not in pool.stats().backends
            registry.add(sim.url)  # back again: a fresh entry, warmed again
            response = await pool.request(sim.url, "GET", "/health", headers=[], body=b"")
            assert response.status == 200
            await response.read()
            await wait_until(lambda: pool.stats().backends[sim.url].idle >= 2)
        finally:
            await registry.aclose()
            await pool.aclose()
