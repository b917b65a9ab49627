"""Background responses (`background: true` on `/v1/responses`): the client gets the response
object at once, `queued`, and polls `GET /v1/responses/{id}` while the edge generates the answer
on its own; `POST /v1/responses/{id}/cancel` stops it (docs/state.md, "Background responses").

A background turn is an ordinary stored turn run without its client. While it runs, and after
it failed or was cancelled, a record under its response id says so; once its answer is stored
with its conversation, the record goes, and the stored turn is what `GET` shows. Records live
where conversations do (the memory store or Redis), so any worker answers a poll or a cancel:
the worker running the turn reads its record every `POLL_S` and stops when it says `cancelled`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from cachetools import TTLCache

from edge.state.config import ConversationConfig
from edge.state.redis_store import RedisState

POLL_S = 0.5
"""How often a running background turn reads its record for a cancel."""
RUNNING = "in_progress"
CANCELLED = "cancelled"
FAILED = "failed"


@dataclass(slots=True)
class Record:
    """What `GET /v1/responses/{id}` shows of a background response not stored (yet)."""

    status: str
    """`in_progress`, `cancelled` or `failed`."""
    meta: dict[str, Any]
    """The response's own fields, as `ResponseBuilder.stored()` gives them."""
    error: dict[str, Any] | None = None
    """A failed one's `{"code", "message"}`."""

    def encode(self) -> bytes:
        return orjson.dumps({"s": self.status, "m": self.meta, "e": self.error})

    @classmethod
    def decode(cls, blob: bytes) -> Record:
        obj = orjson.loads(blob)
        return cls(str(obj["s"]), dict(obj["m"]), obj.get("e"))


class RecordStore(Protocol):
    """Background responses' records by tenant and response id, kept as long as conversations."""

    async def put(self, tenant: str, rid: str, record: Record) -> None: ...
    async def get(self, tenant: str, rid: str) -> Record | None: ...
    async def delete(self, tenant: str, rid: str) -> None: ...


class MemoryRecords:
    """Records in this process (the memory store: one process sees its own only)."""

    def __init__(self, config: ConversationConfig) -> None:
        self._data: TTLCache[tuple[str, str], bytes] = TTLCache(
            maxsize=config.memory_max_conversations, ttl=config.ttl
        )

    async def put(self, tenant: str, rid: str, record: Record) -> None:
        self._data[(tenant, rid)] = record.encode()

    async def get(self, tenant: str, rid: str) -> Record | None:
        blob = self._data.get((tenant, rid))
        return None if blob is None else Record.decode(blob)

    async def delete(self, tenant: str, rid: str) -> None:
        self._data.pop((tenant, rid), None)


class RedisRecords:
    """Records in Redis: `{prefix}bg:{tenant}:{response id}`, with the conversations' TTL."""

    def __init__(self, redis: RedisState, config: ConversationConfig) -> None:
        self._redis = redis
        self._ttl_ms = int(config.ttl * 1000)

    def _key(self, tenant: str, rid: str) -> str:
        return f"{self._redis.prefix}bg:{tenant}:{rid}"

    async def put(self, tenant: str, rid: str, record: Record) -> None:
        await self._redis.set(self._key(tenant, rid), record.encode(), self._ttl_ms)

    async def get(self, tenant: str, rid: str) -> Record | None:
        blob = await self._redis.get(self._key(tenant, rid))
        return None if blob is None else Record.decode(blob)

    async def delete(self, tenant: str, rid: str) -> None:
        await self._redis.delete(self._key(tenant, rid))


__all__ = [
    "CANCELLED",
    "FAILED",
    "POLL_S",
    "RUNNING",
    "MemoryRecords",
    "Record",
    "RecordStore",
    "RedisRecords",
]
