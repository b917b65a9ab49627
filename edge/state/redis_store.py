"""The one class through which `edge.state` talks to Redis: every call bounded by a timeout.

A call that times out or fails raises `StateUnavailable` (503 `state_unavailable`), so a request
that needs the state gets a clear answer and a request that does not (the response cache treats it
as a miss) goes on. The client is `redis.asyncio` with its own socket timeouts as well, so a dead
server costs at most `timeout` per call, never a hang.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from edge.errors import StateUnavailable

T = TypeVar("T")

# Commit a conversation only while this turn still holds its lease (the value is the turn's
# token): a turn whose lease expired and was taken by another cannot overwrite the history.
_COMMIT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisState:
    """A `redis.asyncio` client whose every call ends within `timeout` seconds."""

    def __init__(self, url: str, *, timeout: float, prefix: str) -> None:
        self.prefix = prefix
        self.timeout = timeout
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry_on_timeout=False,
        )
        self._commit = self.client.register_script(_COMMIT)
        self._release = self.client.register_script(_RELEASE)

    async def _call(self, what: str, call: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(call, self.timeout)
        except (TimeoutError, RedisError, OSError) as exc:
            raise StateUnavailable(
                f"the state store did not answer ({what}): {type(exc).__name__}; retry shortly"
            ) from None

    async def get(self, key: str) -> bytes | None:
        value: Any = await self._call("get", self.client.get(key))
        return value if isinstance(value, bytes) else None

    async def get_refresh(self, key: str, ttl_ms: int) -> bytes | None:
        """GET that also restarts the key's TTL (GETEX PX), in one round trip."""
        value: Any = await self._call("getex", self.client.getex(key, px=ttl_ms))
        return value if isinstance(value, bytes) else None

    async def set(self, key: str, value: bytes, ttl_ms: int) -> None:
        await self._call("set", self.client.set(key, value, px=ttl_ms))

    async def set_new(self, key: str, value: bytes, ttl_ms: int) -> bool:
        """SET NX PX: True when the key did not exist (a lease taken)."""
        return bool(await self._call("set nx", self.client.set(key, value, nx=True, px=ttl_ms)))

    async def commit(self, lease: str, token: bytes, key: str, value: bytes, ttl_ms: int) -> bool:
        """Write `key` and drop `lease` only while `lease` still holds `token`."""
        done = await self._call(
            "commit", self._commit(keys=[lease, key], args=[token, value, ttl_ms])
        )
        return bool(done)

    async def release(self, lease: str, token: bytes) -> None:
        await self._call("release", self._release(keys=[lease], args=[token]))

    async def aclose(self) -> None:
        await self.client.aclose()


__all__ = ["RedisState"]
