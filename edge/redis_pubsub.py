"""One Redis pub/sub subscription kept alive, for the parts that share news between edges
(`edge.routing.fleet_view` loads, `edge.models.rollout_sync` stops, `edge.backend_holds`
drains).

`Subscription.run` subscribes, waits for Redis to confirm it, hands each message's payload to
`on_message`, and when Redis fails (gone, slow to subscribe) reports it to `on_error` and
subscribes again `retry_after` seconds later, until it is cancelled or `closing()` says so.

A connection can also die without a close: a Redis host lost in a failover, a partition, a NAT
or conntrack entry dropped. No FIN or RST ever arrives, the read waits for ever and every
message is lost while the edge looks subscribed. So whenever nothing has arrived for
`ping_interval` seconds, the subscription sends PING on its own connection and expects the
answer within `ping_timeout`; without one the connection is taken as dead, reported as
`SilentConnection`, closed and subscribed again. Each failure is counted per reason
(`failures`, exported by `SubscriptionCollector`). TCP keepalive (`subscriber_client`) is a
second line for a peer that vanished.

Pub/sub drops what is published while a subscription is down. `on_subscribed` is told, once
each subscription is confirmed, how long ago the previous one was last known to be alive (None
for the first), so its owner can read back what it may have missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import redis.asyncio as aioredis
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

PING_INTERVAL_S = 5.0
"""Seconds without a message after which a subscription sends PING to see that its connection
still carries anything."""
PING_TIMEOUT_S = 2.0
"""Seconds the PING's answer may take before the connection is taken as dead."""
REASONS = ("silent", "error")
"""Why a subscription was lost: `silent` (no answer to PING: dead without a close), `error`
(Redis closed or refused the connection, or did not confirm the subscription in time)."""

# TCP keepalive where the platform has the knobs: a peer that vanished is found in about
# 10 + 5 × 3 s even on an idle channel (the OS default waits two hours).
_KEEPALIVE = {
    option: value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if (option := getattr(socket, name, None)) is not None
}


def subscriber_client(url: str, *, connect_timeout: float) -> Any:
    """A Redis client for `Subscription`: no socket read timeout (a subscriber waits for
    messages as long as there are none; `Subscription`'s PING finds a dead connection), TCP
    keepalive, and no retries of its own (the subscription subscribes again itself)."""
    options: dict[str, Any] = {}
    if not url.startswith("unix://"):  # keepalive is a TCP option; redis-py refuses it on unix
        options = {"socket_keepalive": True, "socket_keepalive_options": _KEEPALIVE}
    return aioredis.Redis.from_url(
        url, socket_connect_timeout=connect_timeout, retry=Retry(NoBackoff(), 0), **options
    )


async def drop_idle_connections(client: Any, timeout: float) -> None:
    """Close `client`'s idle pooled connections (within `timeout`), so that its next calls
    connect again. For a READONLY answer: after a failover behind one address (a Service, a
    VIP, a DNS name), new connections reach the new master, but the old one, now a replica,
    keeps the connections it had and refuses their writes for as long as they are reused.
    (A subscription there needs no such care: a replica hears what its master publishes.)"""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout):
            await client.connection_pool.disconnect(inuse_connections=False)


class SilentConnection(ConnectionError):
    """The subscribed connection did not answer PING in time: dead without a close."""


class Subscription:
    def __init__(
        self,
        client: Any,
        channel: bytes | str,
        on_message: Callable[[bytes], None],
        *,
        on_error: Callable[[BaseException], None],
        subscribe_timeout: float,
        retry_after: float,
        idle_timeout: float = 60.0,
        closing: Callable[[], bool] = lambda: False,
        subscribed: asyncio.Event | None = None,
        on_subscribed: Callable[[float | None], Awaitable[None]] | None = None,
        ping_interval: float = PING_INTERVAL_S,
        ping_timeout: float = PING_TIMEOUT_S,
        name: str = "subscription",
    ) -> None:
        for what, value in (("subscribe_timeout", subscribe_timeout), ("retry_after",
                            retry_after), ("idle_timeout", idle_timeout), ("ping_interval",
                            ping_interval), ("ping_timeout", ping_timeout)):  # fmt: skip
            if not value > 0:
                raise ValueError(f"subscription {name}: {what} must be > 0, got {value!r}")
        self.client = client
        self.channel = channel
        self.on_message = on_message
        self.on_error = on_error
        self.subscribe_timeout = subscribe_timeout
        self.retry_after = retry_after
        self.idle_timeout = idle_timeout
        """Seconds one read of the connection waits at most (then `closing` is looked at)."""
        self.closing = closing
        self.subscribed = subscribed if subscribed is not None else asyncio.Event()
        """Set while the channel is subscribed (from Redis's confirmation on)."""
        self.on_subscribed = on_subscribed
        """Awaited once each subscription is confirmed, with the seconds since the previous one
        was last known alive (None: the first); what it raises counts as a failure."""
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.name = name
        """Who subscribes (the `subscriber` label of the failures)."""
        self.failures = dict.fromkeys(REASONS, 0)
        """Subscriptions lost or not made, by reason (`REASONS`)."""
        self._alive_at: float | None = None
        """Loop time anything last arrived on a confirmed subscription's connection."""

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.closing():
            # Subscribe messages are read, not ignored: Redis's confirmation says from when
            # messages are delivered, and every arrival proves the connection alive.
            pubsub = self.client.pubsub()
            try:
                async with asyncio.timeout(self.subscribe_timeout):
                    await pubsub.subscribe(self.channel)
                    while True:
                        confirmation = await pubsub.get_message(timeout=self.subscribe_timeout)
                        if confirmation is not None and confirmation["type"] == "subscribe":
                            break
                confirmed_at = loop.time()
                self.subscribed.set()
                if self.on_subscribed is not None:
                    gap = None if self._alive_at is None else loop.time() - self._alive_at
                    await self.on_subscribed(gap)
                self._alive_at = confirmed_at  # only once what was missed has been read back
                await self._listen(pubsub, loop)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # gone: subscribe again shortly
                self.failures["silent" if isinstance(exc, SilentConnection) else "error"] += 1
                self.on_error(exc)
            finally:
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # bounded by the client's connect timeout
            await asyncio.sleep(self.retry_after)

    async def _listen(self, pubsub: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Hand messages over until `closing`; PING after `ping_interval` without any, and
        raise `SilentConnection` when its answer does not come within `ping_timeout`."""
        assert self._alive_at is not None
        pinged_at: float | None = None
        while not self.closing():
            now = loop.time()
            if pinged_at is None:
                wait = self._alive_at + self.ping_interval - now
                if wait <= 0:
                    try:  # a write only, unless the socket's buffers are full
                        async with asyncio.timeout(self.ping_timeout):
                            await pubsub.ping()
                    except TimeoutError:
                        raise SilentConnection("PING could not be sent") from None
                    pinged_at = now
                    continue
            else:
                wait = pinged_at + self.ping_timeout - now
                if wait <= 0:
                    raise SilentConnection(
                        f"no answer to PING within {self.ping_timeout:g} s on the subscribed"
                        " connection"
                    )
            message = await pubsub.get_message(timeout=min(wait, self.idle_timeout))
            if message is None:
                continue
            self._alive_at, pinged_at = loop.time(), None  # a pong or anything else: alive
            if message["type"] == "message":
                self.on_message(message["data"])


class SubscriptionCollector(Collector):
    """`quicedge_redis_subscription_failures_total{subscriber, reason}`, read at scrape from
    the subscriptions `subscriptions()` names (None entries: a part that is off)."""

    labelnames = ("subscriber", "reason")

    def __init__(self, subscriptions: Callable[[], Iterable[Subscription | None]]) -> None:
        self._subscriptions = subscriptions

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "quicedge_redis_subscription_failures",
            "Redis pub/sub subscriptions lost or not made (each is made again), by subscriber"
            " (drains, rollouts, fleet_view) and reason: silent (the connection answered no"
            " PING in time: dead without a close), error (closed, refused, or not confirmed)",
            labels=list(self.labelnames),
        )
        for subscription in self._subscriptions():
            if subscription is None:
                continue
            for reason, count in subscription.failures.items():
                family.add_metric([subscription.name, reason], count)
        yield family


__all__ = [
    "PING_INTERVAL_S",
    "PING_TIMEOUT_S",
    "SilentConnection",
    "Subscription",
    "SubscriptionCollector",
    "drop_idle_connections",
    "subscriber_client",
]
