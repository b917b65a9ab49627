"""One guarded Redis client: every call has a deadline of a few ms, and a breaker keeps a Redis
that is dead *or slow* off the request path.

States: `closed` (calls go to Redis), `open` (calls fail at once with `RedisUnavailable`, the
caller uses its local fallback), `half_open` (one background probe is asking Redis). The breaker
opens after `failures_to_open` calls in a row that failed, timed out, or answered slower than
`slow_ms`. While open, a background task probes after `backoff_s`, doubling up to
`backoff_max_s`, with a write (`probe_key`, which expires within a second): a Redis that answers
PING but refuses writes (out of memory: OOM; a replica after a failover: READONLY; a failed
save: MISCONF) is of no use to the callers, whose calls write, and closing on its PING would only
have their next calls open the breaker again, a trip per probe. A probe Redis refused closes the
idle connections, so that the next connects again: after a failover behind one address, the old
master keeps its connections and refuses them for ever. The first fast answer closes it.
Requests never wait for a probe. Warnings are logged at most once per `warn_interval_s`; the
state is a gauge (0 closed, 1 half-open, 2 open) and trips are counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from edge.admission.settings import RedisSettings
from edge.free_time import FreeDeadline
from edge.redis_pubsub import drop_idle_connections
from edge.telemetry import REDIS_STATES

log = logging.getLogger(__name__)

T = TypeVar("T")
STATES = REDIS_STATES


MAX_CONNECTIONS = 64
"""Connections to Redis per guard; calls past that wait (within their deadline) for one."""
PROBE_TTL_MS = 1000
"""Lifetime of the key a probe writes."""


class RedisUnavailable(Exception):
    """Redis did not answer in time, failed, or its breaker is open."""


class RedisGuard:
    def __init__(
        self,
        settings: RedisSettings,
        *,
        name: str = "admission",
        on_state: Callable[[str, str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if settings.url is None:
            raise ValueError("admission.redis.url: needed for a Redis guard")
        self.settings = settings
        self.name = name
        timeout = settings.timeout_ms / 1000
        # redis-py's own timeouts only bound connect and socket reads; the asyncio deadline in
        # `run` bounds the whole call, including waiting for a pooled connection. The pool
        # makes a burst past its size wait for a connection (redis-py's default pool fails
        # such calls at once, which would open the breaker on a healthy Redis).
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.url,
            max_connections=MAX_CONNECTIONS,
            timeout=max(timeout, 0.05),
            socket_connect_timeout=max(timeout, 0.05),
            socket_timeout=max(timeout * 4, 0.05),
            retry_on_timeout=False,
        )
        self.client: Any = aioredis.Redis(connection_pool=pool)
        self.probe_key = f"{settings.prefix}breaker-probe:{name}"
        """The key a probe sets (for `PROBE_TTL_MS`): no bucket's (those end in the bucket's
        name), nothing anyone reads."""
        self.state = "closed"
        self.trips = 0
        self._streak = 0
        self._bad_until = 0.0
        self._backoff = settings.backoff_s
        self._clock = clock
        self._last_warning = -1e18
        self._on_state = on_state
        self._probe: asyncio.Task[None] | None = None

    @property
    def usable(self) -> bool:
        return self.state == "closed"

    async def run(self, call: Callable[[], Awaitable[T]]) -> T:
        """`await call()` within the deadline; RedisUnavailable when it cannot be had (any
        failure of the call, an odd answer's included). The deadline and `slow_ms` count the
        time the loop was free to read the answer: time it spent behind on other callbacks is
        the edge's delay, not Redis's (`edge.free_time`)."""
        if self.state != "closed":
            raise RedisUnavailable(f"redis breaker {self.state}")
        started = time.perf_counter()
        try:
            result, took = await self._timed(call)
        except Exception as exc:
            # Not only RedisError, OSError and timeouts: a server that answers oddly makes
            # redis-py (or the caller's reading of the answer) raise anything, and that is
            # Redis trouble too; let through, it would fail the request instead of the
            # fallback, and never open the breaker.
            self._failed(
                f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, started
            )
            raise RedisUnavailable(str(exc) or type(exc).__name__) from exc
        if took * 1000 > self.settings.slow_ms:
            self._failed(f"slow answer ({took * 1000:.1f} ms)", started)
        else:
            self._streak = 0
        return result

    async def _timed(self, call: Callable[[], Awaitable[T]]) -> tuple[T, float]:
        """`await call()` within `timeout_ms` of free loop time; its result and that time."""
        async with asyncio.timeout(None) as timeout:
            deadline = FreeDeadline(timeout, self.settings.timeout_ms / 1000)
            try:
                result = await call()
            finally:
                deadline.cancel()
        return result, deadline.free()

    def _failed(self, why: str, started: float) -> None:
        """Count a bad call that began at `started` (perf_counter). One that began before the
        last counted one ended shares its cause (a burst in flight while Redis, or the edge's
        host, stalled): the streak counts bad calls one after another, not at once."""
        if started < self._bad_until:
            return
        self._bad_until = time.perf_counter()
        self._streak += 1
        if self.state == "closed" and self._streak >= self.settings.failures_to_open:
            self._set("open")
            self.trips += 1
            self._warn(f"redis ({self.name}) breaker opened after {self._streak} bad calls: {why}")
            self._start_probe()

    def _warn(self, message: str) -> None:
        now = self._clock()
        if now - self._last_warning >= self.settings.warn_interval_s:
            self._last_warning = now
            log.warning("%s", message)

    def _set(self, state: str) -> None:
        if state != self.state:
            old, self.state = self.state, state
            if self._on_state is not None:
                self._on_state(self.name, old, state)
            log.info("redis (%s) breaker %s -> %s", self.name, old, state)

    def _start_probe(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_write(self) -> object:
        """A write, which Redis takes when the callers' calls can be taken: PING alone is
        answered by a Redis that refuses every write (OOM, READONLY, MISCONF)."""
        return await self.client.set(self.probe_key, b"1", px=PROBE_TTL_MS)

    async def _probe_loop(self) -> None:
        """Probe with backoff until Redis takes a write fast again; then close the breaker."""
        s = self.settings
        self._backoff = s.backoff_s
        while True:
            await asyncio.sleep(self._backoff)
            self._set("half_open")
            try:
                _, took = await self._timed(self._probe_write)
                fast = took * 1000 <= s.slow_ms
            except Exception as exc:
                # Any failure, redis-py's own included (an odd answer can make it raise an
                # AttributeError): were it to end this task, the breaker would stay half-open,
                # with Redis out of use for good.
                fast = False
                self._warn(f"redis ({self.name}) still unavailable: {exc or type(exc).__name__}")
                if isinstance(exc, ResponseError):  # the address may lead elsewhere now
                    await drop_idle_connections(self.client, max(s.timeout_ms / 1000, 0.05))
            if fast:
                self._streak = 0
                self._set("closed")
                log.warning("redis (%s) answers again; shared state back in use", self.name)
                return
            self._set("open")
            self._backoff = min(s.backoff_max_s, self._backoff * 2)

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        with contextlib.suppress(Exception):
            await self.client.aclose(close_connection_pool=True)


__all__ = ["STATES", "RedisGuard", "RedisUnavailable"]
