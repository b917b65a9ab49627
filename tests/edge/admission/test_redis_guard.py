"""The Redis guard's breaker: slow answers open it like errors do, warnings are rate-limited,
and a probe against the real Redis closes it again."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

import edge.free_time
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


class HeldLoop:
    """The loop thread's CPU clock, as `edge.free_time` reads it, for a thread that has a core
    whenever the test holds the loop (`spin`, as a request's own Python does between its
    awaits): the real clock, plus the time the host kept the thread off its core during the
    spins. A test then does not depend on how busy the machine running it is."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._waited = 0.0
        """Wall time less CPU time of the spins so far: the host's waits inside them."""
        self._since: tuple[float, float] | None = None
        clocks = SimpleNamespace(perf_counter=time.perf_counter, thread_time=self.thread_time)
        monkeypatch.setattr(edge.free_time, "time", clocks)

    def thread_time(self) -> float:
        waited = self._waited
        if self._since is not None:
            wall, cpu = self._since
            waited += (time.perf_counter() - wall) - (time.thread_time() - cpu)
        return time.thread_time() + waited

    def spin(self, seconds: float) -> None:
        wall, cpu = self._since = time.perf_counter(), time.thread_time()
        while time.perf_counter() - wall < seconds:
            pass
        self._waited += (time.perf_counter() - wall) - (time.thread_time() - cpu)
        self._since = None


async def test_a_busy_loop_is_not_blamed_on_redis(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 48 requests each holding the loop 5 ms after its Redis call: the last answers are read
    # ~235 ms after Redis sent them, past the deadline and the slow mark below (set far above
    # what a Redis starved of CPU on a loaded test machine takes). That delay is the edge's,
    # so no call fails and the breaker stays shut.
    held = HeldLoop(monkeypatch)
    guard = RedisGuard(RedisSettings(url=redis_url, timeout_ms=150, slow_ms=100))
    walls: list[float] = []

    async def request() -> None:
        start = time.perf_counter()
        await guard.run(guard.client.ping)
        walls.append(time.perf_counter() - start)
        held.spin(0.005)

    try:
        await guard.run(guard.client.ping)
        for _ in range(3):
            await asyncio.gather(*(request() for _ in range(48)))
        assert max(walls) > 0.15  # the loop did hold answers past the deadline
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


async def test_the_deadline_counts_free_time(monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldLoop(monkeypatch)
    loop = asyncio.get_running_loop()
    clock = FreeClock()
    held.spin(0.1)
    assert clock.free() < 0.05  # the thread ran: none of its 0.1 s was free
    await asyncio.sleep(0.03)
    assert clock.free() >= 0.025  # the loop waited with nothing to run
    # A deadline of 50 ms of free time outlives 100 ms of a loop held by other work, and
    # expires once the loop has been free that long.
    async with asyncio.timeout(None) as timeout:
        deadline = FreeDeadline(timeout, 0.05)
        loop.call_soon(held.spin, 0.1)
        await asyncio.sleep(0.105)
        deadline.cancel()
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as timeout:
            FreeDeadline(timeout, 0.05)
            await asyncio.sleep(1)
    assert time.perf_counter() - start < 0.5


def test_free_time_is_wall_time_less_the_threads_cpu() -> None:
    """The real clocks: a thread that computes 50 ms of CPU had at most its wall time less
    that free, however long the host made it wait for a core."""
    start, clock = time.perf_counter(), FreeClock()
    cpu = time.thread_time()
    while time.thread_time() - cpu < 0.05:
        pass
    assert clock.free() <= time.perf_counter() - start - 0.049
