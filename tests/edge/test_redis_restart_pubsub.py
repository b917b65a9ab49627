"""A Redis pub/sub subscription (`edge.redis_pubsub.Subscription`, which the shared drains, the
rollout sync and the fleet view's load channel each hold) whose connection Redis ends: Redis
restarted empty on its port, the client killed (`CLIENT KILL TYPE pubsub`), or dropped for its
output buffer (`client-output-buffer-limit pubsub`, a slow reader of a large message). Each is
counted, the channel subscribed again, messages heard again, and the owner told how long the
lost one was away (so it can read back what it missed)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import redis

from edge.redis_pubsub import Subscription, subscriber_client
from tests.helpers import RedisServer, wait_until


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


def _restart(server: RedisServer) -> RedisServer:
    server.stop()
    return RedisServer(port=server.port)


def _client_kill(server: RedisServer) -> RedisServer:
    with redis.Redis(port=server.port) as r:
        assert r.execute_command("CLIENT", "KILL", "TYPE", "pubsub") >= 1
    return server


def _output_buffer(server: RedisServer) -> RedisServer:
    with redis.Redis(port=server.port) as r:
        r.config_set("client-output-buffer-limit", "pubsub 1024 0 0")
        r.publish("news", b"x" * 100_000)  # past the hard limit at once: Redis drops the client
    return server


ENDINGS: dict[str, Callable[[RedisServer], RedisServer]] = {
    "restart": _restart,
    "client_kill": _client_kill,
    "output_buffer": _output_buffer,
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
async def test_a_subscription_redis_ends_is_made_again_and_hears_again(
    own_redis: RedisServer, ending: str
) -> None:
    heard: list[bytes] = []
    gaps: list[float | None] = []
    errors: list[BaseException] = []

    async def subscribed_again(gap: float | None) -> None:
        gaps.append(gap)

    subscriber = subscriber_client(own_redis.url, connect_timeout=0.5)
    subscription = Subscription(
        subscriber, "news", heard.append, on_error=errors.append, subscribe_timeout=2.0,
        retry_after=0.05, on_subscribed=subscribed_again, name="drains",
    )  # fmt: skip
    task = asyncio.get_running_loop().create_task(subscription.run())
    server = own_redis
    try:
        await wait_until(subscription.subscribed.is_set, timeout=5)
        with redis.Redis(port=server.port) as r:
            r.publish("news", b"before")
        await wait_until(lambda: heard == [b"before"], timeout=5)
        server = ENDINGS[ending](server)
        await wait_until(lambda: subscription.failures["error"] >= 1, timeout=5)
        await wait_until(lambda: len(gaps) >= 2, timeout=10)
        assert subscription.subscribed.is_set()
        with redis.Redis(port=server.port) as r:
            r.config_set("client-output-buffer-limit", "pubsub 0 0 0")
            r.publish("news", b"after")
        await wait_until(lambda: heard[-1] == b"after", timeout=5)
        assert gaps[0] is None and all(g is not None and g >= 0 for g in gaps[1:])
        assert subscription.failures["silent"] == 0 and errors
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await subscriber.aclose()
        if server is not own_redis:
            server.stop()
