"""The Redis guard's breaker: slow answers open it like errors do, warnings are rate-limited,
and a probe against the real Redis closes it again."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from edge.admission.redis_guard import MAX_CONNECTIONS, RedisGuard, RedisUnavailable
from edge.admission.settings import RedisSettings
from edge.free_time import FreeClock, FreeDeadline
from tests.helpers import RedisServer, wait_until


async def test_slow_answers_open_the_breaker_and_a_fast_probe_closes_it(redis_url: str) -> None:
    states: list[str] = []
    guard = RedisGuard(
        RedisSettings(url=redis_url, timeout_ms=5000, slow_ms=250, backoff_s=0.05),
        on_state=lambda name, old, new: states.append(new),
    )
    try:
        for _ in range(3):  # answered, but slower than slow_ms: counts against Redis
            await guard.run(lambda: asyncio.sleep(0.6))
        assert guard.state == "open"
        with pytest.raises(RedisUnavailable, match="open"):
            await guard.run(guard.client.ping)
        await wait_until(lambda: guard.state == "closed", timeout=20)
        assert states[0] == "open" and states[-1] == "closed" and "half_open" in states
        assert guard.trips == 1
    finally:
        await guard.aclose()


async def test_a_dead_redis_warns_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer()
    server.stop()
    guard = RedisGuard(
        RedisSettings(url=server.url, backoff_s=0.01, backoff_max_s=0.02, warn_interval_s=60)
    )
    try:
        with caplog.at_level(logging.WARNING, logger="edge.admission.redis_guard"):
            for _ in range(3):
                with pytest.raises(RedisUnavailable):
                    await guard.run(guard.client.ping)
            assert guard.state != "closed"
            await asyncio.sleep(0.3)  # many failed probes meanwhile
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "breaker opened" in warnings[0].getMessage()
        assert guard.state in ("open", "half_open")
    finally:
        await guard.aclose()


async def test_a_burst_past_the_pool_size_waits_for_connections_and_keeps_the_breaker_shut(
    redis_url: str,
) -> None:
    # A generous deadline and slow threshold: what is checked is that a call beyond the pool's
    # size waits for a connection instead of failing (which would open the breaker).
    guard = RedisGuard(RedisSettings(url=redis_url, timeout_ms=10_000, slow_ms=10_000))
    try:
        answers = await asyncio.gather(
            *(guard.run(guard.client.ping) for _ in range(MAX_CONNECTIONS * 3))
        )
        assert all(answers)
        assert guard.state == "closed" and guard.trips == 0
    finally:
        await guard.aclose()


def _spin(seconds: float) -> None:
    """Hold the loop, as a request's own Python does between its awaits."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_busy_loop_is_not_blamed_on_redis(redis_url: str) -> None:
    # 48 requests each holding the loop 1 ms after its Redis call: the last answers are read
    # ~45 ms after Redis sent them, past the deadline and the slow mark below. That delay is
    # the edge's, so no call fails and the breaker stays shut.
    guard = RedisGuard(RedisSettings(url=redis_url, timeout_ms=30, slow_ms=20))
    walls: list[float] = []

    async def request() -> None:
        start = time.perf_counter()
        await guard.run(guard.client.ping)
        walls.append(time.perf_counter() - start)
        _spin(0.001)

    try:
        await guard.run(guard.client.ping)
        for _ in range(4):
            await asyncio.gather(*(request() for _ in range(48)))
        assert max(walls) > 0.03  # the loop did hold answers past the deadline
        assert guard.state == "closed" and guard.trips == 0
    finally:
        await guard.aclose()


async def test_bad_calls_at_once_count_as_one(redis_url: str) -> None:
    # Five slow calls in flight together are one stall, not five: the breaker opens after
    # failures_to_open bad calls one after another.
    guard = RedisGuard(RedisSettings(url=redis_url, timeout_ms=5000, slow_ms=100))
    try:
        await asyncio.gather(*(guard.run(lambda: asyncio.sleep(0.2)) for _ in range(5)))
        assert guard.state == "closed"
        await guard.run(lambda: asyncio.sleep(0.2))
        assert guard.state == "closed"
        await guard.run(lambda: asyncio.sleep(0.2))
        assert guard.state == "open" and guard.trips == 1
    finally:
        await guard.aclose()


async def test_the_deadline_counts_free_time() -> None:
    loop = asyncio.get_running_loop()
    clock = FreeClock()
    _spin(0.03)
    assert clock.free() < 0.015  # the thread ran: none of it was free
    await asyncio.sleep(0.03)
    assert clock.free() >= 0.025  # the loop waited with nothing to run
    # A deadline of 50 ms of free time outlives 100 ms of a loop held by other work, and
    # expires once the loop has been free that long.
    async with asyncio.timeout(None) as timeout:
        deadline = FreeDeadline(timeout, 0.05)
        loop.call_soon(_spin, 0.1)
        await asyncio.sleep(0.105)
        deadline.cancel()
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as timeout:
            FreeDeadline(timeout, 0.05)
            await asyncio.sleep(1)
    assert time.perf_counter() - start < 0.5
