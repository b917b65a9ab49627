"""Stored chat completions: `store: true` on `/v1/chat/completions` keeps the answer, which is
then read back, listed, given new metadata and deleted by id, as OpenAI's stored completions are
(docs/state.md, "Stored chat completions"). The edge's own routes: nothing reaches a backend.

| route | answer |
| --- | --- |
| `GET /v1/chat/completions` | the tenant's stored ones, by `model` and `metadata[k]` |
| `GET /v1/chat/completions/{id}` | one, as it was answered |
| `POST /v1/chat/completions/{id}` | sets its `metadata` |
| `DELETE /v1/chat/completions/{id}` | forgets it |
| `GET /v1/chat/completions/{id}/messages` | the messages its request sent |

Kept where conversations are (the memory store or Redis), for `state.conversations.ttl`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qs

import orjson
from cachetools import TTLCache

from edge.admission.tenants import ANONYMOUS
from edge.errors import ConversationNotFound, InvalidRequest, Unauthorized
from edge.state.config import ConversationConfig
from edge.state.redis_store import RedisState, Share, Unreadable, read_or_none
from edge.state.responses import check_metadata
from edge.state.stored import order_and_limit, page

MAX_LIST_SCAN = 10_000
"""A list looks through at most this many of the tenant's newest completions (its filters
apply to these)."""
LIST_BATCH = 100
"""Completions a list reads from the store at a time."""


@dataclass(slots=True)
class StoredCompletion:
    completion: dict[str, Any]
    """The `chat.completion` object as it was answered, with its `metadata`."""
    messages: list[dict[str, Any]]
    """What the request sent."""

    def encode(self) -> bytes:
        return orjson.dumps({"c": self.completion, "m": self.messages})

    @classmethod
    def decode(cls, blob: bytes) -> StoredCompletion:
        """A stored completion; `Unreadable` for a value of any other shape."""
        try:
            obj = orjson.loads(blob)
        except orjson.JSONDecodeError as exc:
            raise Unreadable(f"not JSON: {exc}") from None
        if not (isinstance(obj, dict) and isinstance(obj.get("c"), dict)
                and isinstance(obj.get("m"), list)):  # fmt: skip
            raise Unreadable("not a stored completion")
        return cls(obj["c"], obj["m"])

    @classmethod
    def read(cls, blob: bytes | None, what: str) -> StoredCompletion | None:
        """`decode`, with None for no value or one this edge cannot read (logged)."""
        return read_or_none(cls.decode, blob, what)


class CompletionStore(Protocol):
    """Stored completions by tenant and id, newest first for listing."""

    async def put(self, tenant: str, cid: str, blob: bytes) -> None: ...
    async def get(self, tenant: str, cid: str) -> bytes | None: ...
    async def replace(self, tenant: str, cid: str, blob: bytes) -> bool: ...
    async def delete(self, tenant: str, cid: str) -> bool: ...
    async def newest(self, tenant: str, count: int) -> list[str]: ...
    async def get_many(self, tenant: str, cids: list[str]) -> list[bytes | None]: ...

    async def put_aliases(self, tenant: str, aliases: list[str], cid: str) -> None:
        """Let each of `aliases` name `cid` (for as long as a completion lives)."""
        ...

    async def alias_of(self, tenant: str, alias: str) -> str | None:
        """The id `alias` names; None: none."""
        ...


class MemoryCompletions:
    """This process's stored completions: per tenant, oldest evicted past
    `memory_max_conversations`, each gone after `ttl`; past `memory_max_bytes` over all
    tenants, the oldest of the tenant holding the most bytes goes."""

    def __init__(self, config: ConversationConfig, *, clock: Any = time.monotonic) -> None:
        self._ttl = config.ttl
        self._max = min(config.memory_max_conversations, config.tenant_max_conversations)
        self._max_bytes = config.memory_max_bytes
        self._tenant_max_bytes = config.tenant_max_bytes
        self._clock = clock
        self._data: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._bytes: dict[str, int] = {}
        """By tenant, the bytes its stored completions hold."""
        self._aliases: TTLCache[tuple[str, str], str] = TTLCache(
            maxsize=config.memory_max_conversations, ttl=config.ttl, timer=clock
        )

    def _live(self, tenant: str) -> OrderedDict[str, tuple[float, bytes]]:
        kept = self._data.setdefault(tenant, OrderedDict())
        now = self._clock()
        while kept and next(iter(kept.values()))[0] <= now:  # insertion order: oldest first
            self._drop_oldest(tenant)
        return kept

    def _drop_oldest(self, tenant: str) -> None:
        self._bytes[tenant] -= len(self._data[tenant].popitem(last=False)[1][1])

    def _pop(self, tenant: str, cid: str) -> bool:
        found = self._data[tenant].pop(cid, None)
        if found is not None:
            self._bytes[tenant] -= len(found[1])
        return found is not None

    async def put(self, tenant: str, cid: str, blob: bytes) -> None:
        kept = self._live(tenant)
        self._pop(tenant, cid)
        kept[cid] = (self._clock() + self._ttl, blob)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + len(blob)
        while len(kept) > 1 and (
            len(kept) > self._max or self._bytes[tenant] > self._tenant_max_bytes
        ):
            self._drop_oldest(tenant)
        while sum(self._bytes.values()) > self._max_bytes:  # the tenants are few
            self._drop_oldest(max(self._bytes, key=self._bytes.__getitem__))

    async def get(self, tenant: str, cid: str) -> bytes | None:
        found = self._live(tenant).get(cid)
        return None if found is None else found[1]

    async def replace(self, tenant: str, cid: str, blob: bytes) -> bool:
        kept = self._live(tenant)
        if cid not in kept:
            return False
        self._bytes[tenant] += len(blob) - len(kept[cid][1])
        kept[cid] = (kept[cid][0], blob)
        return True

    async def delete(self, tenant: str, cid: str) -> bool:
        self._live(tenant)
        return self._pop(tenant, cid)

    async def newest(self, tenant: str, count: int) -> list[str]:
        return list(reversed(self._live(tenant)))[:count]

    async def get_many(self, tenant: str, cids: list[str]) -> list[bytes | None]:
        kept = self._live(tenant)
        return [kept[cid][1] if cid in kept else None for cid in cids]

    async def put_aliases(self, tenant: str, aliases: list[str], cid: str) -> None:
        for alias in aliases:
            self._aliases[(tenant, alias)] = cid

    async def alias_of(self, tenant: str, alias: str) -> str | None:
        return self._aliases.get((tenant, alias))


class RedisCompletions:
    """Stored completions in Redis: `{prefix}chatcmpl:{tenant}:{id}`, with the conversations'
    TTL, and the tenant's index by time `{prefix}chatcmpl-index:{tenant}` (trimmed of what
    expired at every store)."""

    def __init__(self, redis: RedisState, config: ConversationConfig) -> None:
        self._redis = redis
        self._config = config
        self._ttl = config.ttl

    def _key(self, tenant: str, cid: str) -> str:
        return f"{self._redis.prefix}chatcmpl:{tenant}:{cid}"

    def _index(self, tenant: str) -> str:
        return f"{self._redis.prefix}chatcmpl-index:{tenant}"

    def _share(self, tenant: str) -> Share:
        """The tenant's index by time, and its completions' sizes, within its bound."""
        prefix, config = self._redis.prefix, self._config
        return Share(self._index(tenant), f"{prefix}chatcmpl-sizes:{tenant}",
                     f"{prefix}chatcmpl:{tenant}:", config.ttl, config.tenant_max_conversations,
                     config.tenant_max_bytes)  # fmt: skip

    async def put(self, tenant: str, cid: str, blob: bytes) -> None:
        # the key, its place in the index and the tenant's bound: one atomic step
        ttl_ms = int(self._ttl * 1000)
        await self._redis.set_shared(self._key(tenant, cid), blob, ttl_ms, self._share(tenant),
                                     cid)  # fmt: skip

    async def get(self, tenant: str, cid: str) -> bytes | None:
        return await self._redis.get(self._key(tenant, cid))

    async def replace(self, tenant: str, cid: str, blob: bytes) -> bool:
        return await self._redis.replace(self._key(tenant, cid), blob)

    async def delete(self, tenant: str, cid: str) -> bool:
        return await self._redis.delete_shared(self._share(tenant), cid) > 0

    async def newest(self, tenant: str, count: int) -> list[str]:
        return await self._redis.index_newest(self._index(tenant), count)

    async def get_many(self, tenant: str, cids: list[str]) -> list[bytes | None]:
        if not cids:
            return []
        blobs = await self._redis.get_many([self._key(tenant, cid) for cid in cids])
        gone = [cid for cid, blob in zip(cids, blobs, strict=True) if blob is None]
        if gone:  # deleted or expired since it was indexed: out of its share too
            await self._redis.delete_shared(self._share(tenant), *gone)
        return blobs

    def _alias_key(self, tenant: str, alias: str) -> str:
        return f"{self._redis.prefix}chatcmpl-alias:{tenant}:{alias}"

    async def put_aliases(self, tenant: str, aliases: list[str], cid: str) -> None:
        ttl_ms = int(self._ttl * 1000)
        await self._redis.set_many([(self._alias_key(tenant, a), cid.encode(), ttl_ms)
                                    for a in aliases])  # fmt: skip

    async def alias_of(self, tenant: str, alias: str) -> str | None:
        found = await self._redis.get(self._alias_key(tenant, alias))
        return None if found is None else found.decode(errors="replace")


def _not_found(cid: str) -> ConversationNotFound:
    return ConversationNotFound(
        f"No chat completion found with id '{cid[:80]}'.", code="chat_completion_not_found"
    )


def check_store(body: dict[str, Any]) -> dict[str, str] | None:
    """The metadata to keep with a `store: true` chat request (None: not stored); 400 for a
    bad `store` or `metadata`."""
    store = body.get("store")
    if store is None or store is False:
        return None
    if store is not True:
        raise InvalidRequest("'store' must be true or false", param="store")
    metadata = body.get("metadata")
    return {} if metadata is None else check_metadata(metadata)


def _page_query(query: bytes) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}


class StoredCompletions:
    """What `edge.app` answers on the stored completions' routes, one tenant at a time."""

    def __init__(self, store: CompletionStore, config: ConversationConfig) -> None:
        self.store = store
        self.max_bytes = config.max_bytes

    async def keep(
        self,
        tenant: str,
        completion: dict[str, Any],
        messages: list[dict[str, Any]],
        aliases: Iterable[str] = (),
    ) -> bool:
        """Store an answered completion; False when it is larger than `max_bytes`.
        `aliases`: the other ids its stream gave (SGLang gives each choice of `n` > 1 its
        own), which read it back too."""
        cid = completion.get("id")
        if not isinstance(cid, str) or not cid:
            return False
        blob = StoredCompletion(completion, messages).encode()
        if len(blob) > self.max_bytes:
            return False
        await self.store.put(tenant, cid, blob)
        others = sorted({a for a in aliases if a and a != cid})
        if others:
            await self.store.put_aliases(tenant, others, cid)
        return True

    async def _load(self, tenant: str, cid: str) -> StoredCompletion:
        return (await self._find(tenant, cid))[1]

    async def _find(self, tenant: str, cid: str) -> tuple[str, StoredCompletion]:
        """The completion `cid` names (its own id, or another id its stream gave): its id
        and what is stored."""
        blob = await self.store.get(tenant, cid)
        if blob is None:
            primary = await self.store.alias_of(tenant, cid)
            if primary is not None:
                cid, blob = primary, await self.store.get(tenant, primary)
        what = f"chat completion {cid[:80]!r} of tenant {tenant!r}"
        stored = StoredCompletion.read(blob, what)
        if stored is None:
            raise _not_found(cid)
        return cid, stored

    async def retrieve(self, tenant: str, cid: str) -> dict[str, Any]:
        """`GET /v1/chat/completions/{id}`."""
        return (await self._load(tenant, cid)).completion

    async def update(self, tenant: str, cid: str, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /v1/chat/completions/{id}`: replace its metadata; the completion."""
        unknown = sorted(set(body) - {"metadata"})
        if unknown:
            raise InvalidRequest(f"'{unknown[0]}' is not supported by this endpoint",
                                 param=unknown[0], code="unsupported_parameter")  # fmt: skip
        metadata = check_metadata(body.get("metadata"))
        primary, stored = await self._find(tenant, cid)
        stored.completion["metadata"] = metadata
        if not await self.store.replace(tenant, primary, stored.encode()):
            raise _not_found(cid)  # expired or deleted meanwhile
        return stored.completion

    async def delete(self, tenant: str, cid: str) -> dict[str, Any]:
        """`DELETE /v1/chat/completions/{id}`: OpenAI's deletion object."""
        if not await self.store.delete(tenant, cid):
            primary = await self.store.alias_of(tenant, cid)
            if primary is None or not await self.store.delete(tenant, primary):
                raise _not_found(cid)
        return {"object": "chat.completion.deleted", "id": cid, "deleted": True}

    async def messages(self, tenant: str, cid: str, query: bytes) -> dict[str, Any]:
        """`GET /v1/chat/completions/{id}/messages`: what its request sent, each with an id."""
        cid, stored = await self._find(tenant, cid)
        items = [{**m, "id": f"{cid}-{i}"} for i, m in enumerate(stored.messages)]
        return page(items, query, default_order="asc")

    async def listing(self, tenant: str, query: bytes) -> dict[str, Any]:
        """`GET /v1/chat/completions`: the tenant's stored completions, oldest first by
        default, filtered by `model` and `metadata[key]=value`. Refused without an API key:
        every key-less client is the one tenant `anonymous`, so its list would hand each of
        them all the others' completions (by id, each is read only by whoever got its id)."""
        if tenant == ANONYMOUS:
            raise Unauthorized(
                "Listing stored chat completions needs an API key: requests without one all "
                "share the tenant 'anonymous'. Read a completion by its id instead."
            )
        args = _page_query(query)
        order, limit = order_and_limit(args, "asc")
        model = args.get("model")
        wanted = {k[len("metadata[") : -1]: v for k, v in args.items()
                  if k.startswith("metadata[") and k.endswith("]")}  # fmt: skip
        ids = await self.store.newest(tenant, MAX_LIST_SCAN)
        if order == "asc":
            ids.reverse()
        if "after" in args:
            if args["after"] not in ids:
                raise InvalidRequest(f"'after': no completion {args['after'][:80]!r} here",
                                     param="after")  # fmt: skip
            ids = ids[ids.index(args["after"]) + 1 :]
        found: list[dict[str, Any]] = []
        # read in batches, only as far as the page needs (one more tells `has_more`)
        for start in range(0, len(ids), LIST_BATCH):
            for blob in await self.store.get_many(tenant, ids[start : start + LIST_BATCH]):
                stored = StoredCompletion.read(blob, f"a chat completion of tenant {tenant!r}")
                if stored is None:
                    continue
                completion = stored.completion
                metadata = completion.get("metadata") or {}
                if (model is None or completion.get("model") == model) and all(
                    metadata.get(k) == v for k, v in wanted.items()
                ):
                    found.append(completion)
            if len(found) > limit:
                break
        data = found[:limit]
        return {"object": "list", "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(found) > limit}  # fmt: skip


__all__ = [
    "MAX_LIST_SCAN",
    "CompletionStore",
    "MemoryCompletions",
    "RedisCompletions",
    "StoredCompletion",
    "StoredCompletions",
    "check_store",
]
