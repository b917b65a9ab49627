"""Token buckets: the memory store and the Redis store (a real Redis) agree on the rules."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from edge.admission.buckets import MemoryBuckets, RedisBuckets
from edge.admission.headers import Standing, duration, ratelimit_headers, retry_after
from edge.admission.redis_guard import RedisGuard
from edge.admission.settings import RedisSettings
from edge.admission.tenants import Bucket


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_memory_bucket_burst_refill_and_retry_after() -> None:
    clock = FakeClock()
    store = MemoryBuckets(clock)
    rps = Bucket(rate=2.0, capacity=3.0)
    for _ in range(3):
        assert store.take_now([("t", rps, 1)]).allowed
    refused = store.take_now([("t", rps, 1)])
    assert not refused.allowed and refused.refused == 0
    assert refused.retry_after == pytest.approx(0.5)
    clock.now += 0.5
    assert store.take_now([("t", rps, 1)]).allowed


def test_memory_take_is_all_or_nothing_and_debt_is_paid_back() -> None:
    clock = FakeClock()
    store = MemoryBuckets(clock)
    rps = Bucket(rate=1.0, capacity=5.0)
    tpm = Bucket(rate=10.0, capacity=100.0)
    verdict = store.take_now([("r", rps, 1), ("k", tpm, 150)])  # bigger than the bucket: full
    assert verdict.allowed
    assert store.level("k") == -50
    assert verdict.levels == (4, -50)  # each bucket after the take
    refused = store.take_now([("r", rps, 1), ("k", tpm, 10)])
    assert not refused.allowed and refused.refused == 1
    assert refused.retry_after == pytest.approx(6.0)  # from -50 to 10 at 10/s
    assert refused.levels == (4, -50)  # as they were: nothing taken
    assert store.level("r") == 4  # nothing was taken from the requests bucket
    store.debit_now("k", tpm, 40)
    assert store.level("k") == -90


@pytest.fixture
async def guard(redis_url: str) -> AsyncIterator[RedisGuard]:
    # generous deadlines: this test is about the script, not about Redis being slow
    g = RedisGuard(RedisSettings(url=redis_url, timeout_ms=2000, slow_ms=2000))
    yield g
    await g.aclose()


async def test_redis_buckets_share_state_across_clients(
    redis_url: str, redis_prefix: str, guard: RedisGuard
) -> None:
    other = RedisGuard(RedisSettings(url=redis_url, timeout_ms=2000, slow_ms=2000))
    try:
        a, b = RedisBuckets(guard, redis_prefix), RedisBuckets(other, redis_prefix)
        rps = Bucket(rate=0.001, capacity=4.0)  # no refill to speak of during the test
        results = [await (a if i % 2 else b).take([("t:req", rps, 1)]) for i in range(6)]
        assert [v.allowed for v in results] == [True] * 4 + [False] * 2
        assert [round(v.levels[0]) for v in results] == [3, 2, 1, 0, 0, 0]  # shared, after each
        assert results[-1].retry_after == pytest.approx(1000, rel=0.01)
        tpm = Bucket(rate=1.0, capacity=100.0)
        assert (await a.take([("t:req2", Bucket(1.0, 9.0), 1), ("t:tok", tpm, 60)])).allowed
        refused = await b.take([("t:req2", Bucket(1.0, 9.0), 1), ("t:tok", tpm, 60)])
        assert not refused.allowed and refused.refused == 1
        assert refused.retry_after == pytest.approx(20, abs=0.5)
        await a.debit("t:tok", tpm, 100)
        level = float(await guard.client.hget(redis_prefix + "t:tok", "l"))
        assert level == pytest.approx(-60, abs=1)
        ttl = await guard.client.pttl(redis_prefix + "t:tok")
        assert 0 < ttl <= 162_000  # time to refill from the debt, plus a second
    finally:
        await other.aclose()


def test_rate_limit_headers_in_openais_shape() -> None:
    assert [duration(s) for s in (0, 0.0114, 0.999, 1.0, 1.5, 20, 360, 3723.25)] == [
        "0s", "12ms", "999ms", "1s", "1.5s", "20s", "6m0s", "1h2m3.25s"]  # fmt: skip
    requests, tokens = Bucket(rate=0.5, capacity=10.0), Bucket(rate=100.0, capacity=6000.0)
    headers = dict(ratelimit_headers((Standing("requests", requests, 7.6),
                                      Standing("tokens", tokens, -50.0))))  # fmt: skip
    assert headers == {
        b"x-ratelimit-limit-requests": b"10",
        b"x-ratelimit-remaining-requests": b"7",
        b"x-ratelimit-reset-requests": b"4.8s",  # 2.4 requests at 0.5/s
        b"x-ratelimit-limit-tokens": b"6000",
        b"x-ratelimit-remaining-tokens": b"0",  # in debt: never below zero
        b"x-ratelimit-reset-tokens": b"1m0.5s",  # 6,050 tokens at 100/s
    }
    assert retry_after(0.0125) == ((b"retry-after", b"1"), (b"retry-after-ms", b"13"))
    assert retry_after(2.5) == ((b"retry-after", b"3"), (b"retry-after-ms", b"2500"))
