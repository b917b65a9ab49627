"""Token buckets at their boundaries, against a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from edge.admission.buckets import RedisBuckets
from edge.admission.redis_guard import RedisGuard
from edge.admission.settings import RedisSettings
from edge.admission.tenants import Bucket


@pytest.fixture
async def guard(redis_url: str) -> AsyncIterator[RedisGuard]:
    g = RedisGuard(RedisSettings(url=redis_url, timeout_ms=2000, slow_ms=2000))
    yield g
    await g.aclose()


async def test_a_bucket_written_by_a_clock_ahead_refills_from_redis_clock_now(
    redis_prefix: str, guard: RedisGuard
) -> None:
    """A bucket last written at a time ahead of Redis's clock (a failover to a replica whose
    clock is behind the old master's, or a clock stepped back) refills from now on: it is not
    refused until Redis's clock catches up with the stored time."""
    store = RedisBuckets(guard, redis_prefix)
    rps = Bucket(rate=10.0, capacity=2.0)
    secs, micros = await guard.client.time()
    ahead = secs + micros / 1e6 + 3600.0  # written an hour "later" than Redis's clock now
    key = redis_prefix + "clock:req"
    await guard.client.hset(key, mapping={"l": "0", "t": repr(ahead)})
    await guard.client.expire(key, 7200)
    refused = await store.take([("clock:req", rps, 1)])
    assert not refused.allowed  # empty when written: nothing refilled yet
    assert refused.retry_after == pytest.approx(0.1, abs=0.01)  # 1 request at 10/s
    await asyncio.sleep(0.15)  # the wait the refusal named, and some: it holds a request
    assert (await store.take([("clock:req", rps, 1)])).allowed
