"""Backend drains shared by every edge of one Redis (`[proxy] share_drains`; docs/operations.md,
"Draining a backend for maintenance").

A drain (`POST /backends/NAME/drain`) is written to a Redis hash (`drains_key`: backend name →
when and where it was drained) before it is taken, and every edge process reads the hash every
`drains_interval` seconds and holds exactly the backends it names. So one call drains a backend
on the whole fleet, an edge that starts later holds it too, and a restart forgets nothing.

The hash is the truth and the poll reads it: a drain is state, not an event, and an edge that
missed a message (started later, or Redis was away) must still find it. Each change is also
published on `{drains_key}:changed`, and every edge that hears it reads the hash at once, so a
drain reaches the fleet in a round trip rather than up to `drains_interval` later. An
announcement made while the channel was not subscribed is lost, so the hash is also read as soon
as a lost subscription is made again (`edge.redis_pubsub` finds one that died without a close).
When Redis is slow or gone, a drain or undrain is refused (503), a poll keeps the holds as they
were, and failures are logged at most every 30 s. Routing never waits on Redis.

An empty hash means "nothing is drained" only while the marker key `{drains_key}:marker`, written
with every change, is there. Without it Redis has lost its data (restarted without persistence,
flushed, evicted): an operator's drain must not end that way, so each edge keeps its holds,
writes them back with the marker, and warns (`restored`). An undrain removes the name and keeps
the marker, so it is still obeyed everywhere.

A refusal says what is true: "nothing changed" when Redis could not be reached before the
write went out; when the write went out and its answer did not come back in time, the field is
read back, and the change is taken (200) when Redis holds it, else the 503 says it may still
take effect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import redis.asyncio as aioredis
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ReadOnlyError

from backends.registry import BackendRegistry
from edge.errors import StateUnavailable
from edge.redis_pubsub import (
    PING_INTERVAL_S,
    PING_TIMEOUT_S,
    Subscription,
    drop_idle_connections,
    subscriber_client,
)
from transport.loop import cancelled
from transport.redacted import without_password

log = logging.getLogger(__name__)

WARN_EVERY_S = 30.0


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class SharedHolds:
    """One edge process's side of the shared drains."""

    def __init__(
        self,
        registry: BackendRegistry,
        *,
        url: str,
        key: str,
        interval: float,
        timeout: float = 0.5,
        ping_interval: float = PING_INTERVAL_S,
        ping_timeout: float = PING_TIMEOUT_S,
    ) -> None:
        self.registry = registry
        self.url = url
        self.key = key
        self.marker = f"{key}:marker"
        """Written with every change; its absence says Redis lost the hash (see the module)."""
        self.interval = interval
        self.timeout = timeout
        self.ping_interval = ping_interval
        """Seconds the change channel may stay silent before its connection is pinged."""
        self.ping_timeout = ping_timeout
        """Seconds the answer to that PING may take before the connection is taken as dead."""
        self.origin = f"{socket.gethostname()}:{os.getpid()}"
        self.channel = f"{key}:changed"
        self.restored = 0
        """Times this process found the drains gone from Redis and wrote its holds back."""
        self._redis: Any = None
        self._subscriber: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_warning = -1e18
        self._changed = asyncio.Event()
        self._subscription: Subscription | None = None
        self.subscribed = asyncio.Event()
        """Set while the change channel is subscribed (tests wait on it)."""

    @property
    def subscription(self) -> Subscription | None:
        """The change channel's subscription, once started."""
        return self._subscription

    async def start(self) -> None:
        self._redis = aioredis.Redis.from_url(
            self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
            retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        # Subscribing holds a connection in a blocking read: a client without a read timeout.
        self._subscriber = subscriber_client(self.url, connect_timeout=self.timeout)
        self._subscription = Subscription(
            self._subscriber, self.channel, lambda _name: self._changed.set(),
            on_error=self._failed, subscribed=self.subscribed, subscribe_timeout=self.timeout * 10,
            retry_after=1.0, on_subscribed=self._resubscribed,
            ping_interval=self.ping_interval, ping_timeout=self.ping_timeout,
            name="drains",
        )  # fmt: skip
        await self.sync()  # before the first request, when Redis answers at once
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll()), loop.create_task(self._subscription.run())]

    async def aclose(self) -> None:
        for task in self._tasks:
            await cancelled(task)
        self._tasks = []
        for client in (self._redis, self._subscriber):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()

    async def set(self, name: str, held: bool) -> None:
        """Drain (`held`) or undrain `name` for every edge, then here; 503 when Redis did not
        take it, saying whether it may still take effect."""
        try:  # Redis reachable: a failure after this point may have reached it
            async with asyncio.timeout(self.timeout):
                await self._redis.ping()
        except Exception as exc:
            raise StateUnavailable(
                f"the drain could not be shared through Redis ({_why(exc)}); nothing changed"
            ) from None
        try:
            try:
                async with asyncio.timeout(self.timeout):
                    await self._write(name, held)
            except ReadOnlyError:
                # A failover behind one address: this pooled connection reaches the old
                # master, now a replica, which took nothing (the transaction was refused
                # whole); a new connection reaches the new master.
                await drop_idle_connections(self._redis, self.timeout)
                async with asyncio.timeout(self.timeout):
                    await self._write(name, held)
        except Exception as exc:
            written = await self._read_back(name)
            if written != held:
                shown = "it may have been applied"
                if written is not None:
                    shown = "Redis does not show it, but a write that was late may still apply it"
                raise StateUnavailable(
                    f"the drain was sent to Redis but not confirmed ({_why(exc)}): {shown};"
                    " GET /backends on each edge shows what it holds"
                ) from None
        self.registry.hold(name, held)
        # The hash holds the change already; an edge that misses this finds it on its poll.
        try:
            async with asyncio.timeout(self.timeout):
                await self._redis.publish(self.channel, name)
        except Exception as exc:
            self._failed(exc)

    async def _write(self, name: str, held: bool) -> None:
        """The change and the marker, in one transaction."""
        stamp = orjson.dumps({"at": round(time.time(), 3), "by": self.origin})
        async with self._redis.pipeline(transaction=True) as pipe:
            if held:
                pipe.hset(self.key, name, stamp)
            else:
                pipe.hdel(self.key, name)
            pipe.set(self.marker, stamp)
            await pipe.execute()

    async def _read_back(self, name: str) -> bool | None:
        """Whether the hash names `name` now; None when Redis did not say in time."""
        try:
            async with asyncio.timeout(self.timeout):
                return bool(await self._redis.hexists(self.key, name))
        except Exception as exc:
            self._failed(exc)
            return None

    async def sync(self) -> None:
        """Hold exactly the backends the hash names (it stays as it was when Redis fails); with
        the marker gone, also those held here, written back."""
        try:
            async with asyncio.timeout(self.timeout):
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.hkeys(self.key)
                    pipe.exists(self.marker)
                    keys, marked = await pipe.execute()
        except Exception as exc:
            self._failed(exc)
            return
        names = frozenset(n.decode() for n in keys)
        if not marked:
            restored = await self._restore(names)
            if restored is None:
                return
            names = restored
        self.registry.hold_exactly(names)

    async def _restore(self, names: frozenset[str]) -> frozenset[str] | None:
        """Redis lost the drains (no marker): what to hold, and the holds Redis lacks written
        back with the marker; None when that write failed (the holds stay as they are)."""
        held = self.registry.held
        missing = sorted(held - names)
        if not missing:
            # Nothing to write back, and no marker either: a process that has just started
            # holds nothing yet, and a marker from it would let an empty hash undrain the
            # backends the other edges still hold.
            return names | held
        stamp = orjson.dumps({"at": round(time.time(), 3), "by": self.origin, "restored": True})
        try:
            async with asyncio.timeout(self.timeout):
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.hset(self.key, mapping=dict.fromkeys(missing, stamp))
                    pipe.set(self.marker, stamp)
                    await pipe.execute()
        except Exception as exc:
            self._failed(exc)
            return None
        self.restored += 1
        log.warning("shared drains: Redis at %s had lost the drains (%s is gone: restarted without"
                    " persistence, or flushed); still holding %s and written back",
                    without_password(self.url), self.marker, ", ".join(missing))  # fmt: skip
        return names | held

    async def _resubscribed(self, _gap: float | None) -> None:
        """A change announced while the channel was not subscribed was missed: read now."""
        self._changed.set()

    async def _poll(self) -> None:
        """Read the hash every `interval`, or at once when a change was announced."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._changed.wait()
            self._changed.clear()
            await self.sync()

    def _failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            log.warning("shared drains: Redis at %s did not answer (%s); holds stay as they are",
                        without_password(self.url), _why(exc))  # fmt: skip


class HoldsCollector(Collector):
    """`quicedge_drains_restored_total`, read at scrape (0 without shared drains)."""

    def __init__(self, holds: Callable[[], SharedHolds | None]) -> None:
        self._holds = holds

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "quicedge_drains_restored",
            "Times this process found the shared drains gone from Redis (restarted without"
            " persistence, or flushed) and wrote the backends it holds back",
        )
        holds = self._holds()
        family.add_metric([], holds.restored if holds is not None else 0)
        yield family


__all__ = ["HoldsCollector", "SharedHolds"]
