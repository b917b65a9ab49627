"""The response cache's own gauges follow what L1 holds."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from edge.state.cache import ResponseCache
from edge.state.config import CacheConfig


async def test_l1_bytes_drop_when_an_expired_entry_is_dropped() -> None:
    now = [1000.0]
    registry = CollectorRegistry()
    config = CacheConfig(allow_tenants=["*"], ttl=10.0)
    cache = ResponseCache(config, tiers=[], registry=registry, clock=lambda: now[0])
    key = cache.key("t", "/v1/chat/completions", "m", b"{}")
    await cache.put(key, stream=False, body=b"x" * 1000, content_type=b"application/json")
    assert registry.get_sample_value("quicedge_cache_l1_bytes") == cache.l1.currsize > 1000
    now[0] += 11.0  # past its TTL: the look-up drops it
    assert await cache.get(key) is None
    assert cache.l1.currsize == 0
    assert registry.get_sample_value("quicedge_cache_l1_bytes") == 0
