"""The Redis guard's breaker: slow answers open it like errors do, warnings are rate-limited,
and a probe against the real Redis closes it again."""

from __future__ import annotations

import asyncio
import logging

import pytest

from edge.admission.redis_guard import MAX_CONNECTIONS, RedisGuard, RedisUnavailable
from edge.admission.settings import RedisSettings
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
