"""The response cache: deterministic answers replayed from memory (L1) or Redis (L2).

A request may be answered from the cache only when all of these hold:

- its tenant is allowed (`state.cache.allow_tenants`; empty, the default, allows none);
- it opted in: `x-quicedge-cache: use`, or its route is in `state.cache.routes` (then
  `x-quicedge-cache: off` opts out);
- it is deterministic: `temperature` 0, an explicit `seed`, or `top_k` 1 (greedy); for `/generate`
  the same keys of `sampling_params` (`sampling_seed` for the seed);
- it is not a stored-conversation turn (whose reply must be appended to its history).

The key is a SHA-256 of the tenant, the route, the model, the pool and version routing chose
for the request (a gray release's stable or canary), the model's version (pinned in
`state.cache.model_versions`; else the one the pool's backends serve now, as the edge knows it,
or the last that answered, `ResponseCache.key`) and the
request body with its keys sorted and `rid`/`user`/`metadata` left out. An entry is the whole
answer: the SSE bytes of a stream, or the JSON body, replayed in the same shape (and the stored
`content-type`) with `x-quicedge-cache: hit-l1|hit-l2` (`miss` on a request that looked and did
not find). Only a complete answer is stored: a 200 whose stream reached `[DONE]` with no error
event and no `abort` finish (`aborted`), that no stream rule cut, from a request the client did
not abandon, no larger than `state.cache.max_entry_bytes`. A hit meets the stream rules in force
when it is replayed, streamed or whole.

L1 is a `cachetools.LRUCache` bounded in bytes (`l1_max_bytes`, counting each entry's body and
key); L2 is Redis with a TTL. `CacheTier` is the interface a third tier (object storage) would
implement; none ships.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from cachetools import LRUCache
from prometheus_client import CollectorRegistry, Counter, Gauge

from backends.backend import Backend
from edge.errors import StateUnavailable
from edge.state.config import CacheConfig
from edge.state.redis_store import RedisState

CACHE_HEADER = "x-quicedge-cache"
_IGNORED = frozenset({"rid", "user", "metadata"})
"""Request members that do not change the answer."""
_ENTRY_OVERHEAD = 200
"""Bytes counted per L1 entry beyond its body and key (the objects that hold them)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored answer."""

    stream: bool
    body: bytes
    expires: float
    """`time.time()` after which it is stale."""
    content_type: bytes = b"application/json"

    def encode(self) -> bytes:
        kind = b"S" if self.stream else b"J"
        return kind + b"%.3f\n" % self.expires + self.content_type + b"\n" + self.body

    @classmethod
    def decode(cls, blob: bytes) -> Entry | None:
        head, sep, rest = blob.partition(b"\n")
        content_type, sep2, body = rest.partition(b"\n")
        if not sep or not sep2 or head[:1] not in (b"S", b"J"):
            return None
        try:
            expires = float(head[1:])
        except ValueError:
            return None
        return cls(head[:1] == b"S", body, expires, content_type)


class CacheTier(Protocol):
    """A shared tier behind L1: Redis (L2) here; object storage (L3) would be another."""

    name: str

    async def get(self, key: str) -> Entry | None: ...
    async def put(self, key: str, entry: Entry) -> None: ...


class RedisTier:
    name = "l2"

    def __init__(self, redis: RedisState, ttl: float) -> None:
        self._redis = redis
        self._ttl_ms = int(ttl * 1000)

    async def get(self, key: str) -> Entry | None:
        blob = await self._redis.get(f"{self._redis.prefix}cache:{key}")
        return Entry.decode(blob) if blob is not None else None

    async def put(self, key: str, entry: Entry) -> None:
        await self._redis.set(f"{self._redis.prefix}cache:{key}", entry.encode(), self._ttl_ms)


def _zero(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def _seeded(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def deterministic(route: str, body: dict[str, Any]) -> bool:
    """Whether the same request always gets the same answer (greedy, or a fixed seed)."""
    params = body.get("sampling_params") if route == "/generate" else body
    if not isinstance(params, dict):
        return False
    seed = params.get("sampling_seed" if route == "/generate" else "seed")
    return _zero(params.get("temperature")) or _seeded(seed) or params.get("top_k") == 1


def known_version(version: str | None) -> str:
    """A version that tells weights apart: SGLang reports `default` when it was given none,
    which says nothing ("")."""
    return "" if version is None or version == "default" else version


def weight_version_of(route: str, body: bytes) -> str | None:
    """The model version a JSON answer reports (SGLang's `weight_version`), if any."""
    marker = body.find(b'"weight_version"')
    if marker < 0:
        return None
    try:
        obj = orjson.loads(body)
    except ValueError:
        return None
    holder = obj.get("meta_info") if route == "/generate" else obj.get("metadata")
    version = holder.get("weight_version") if isinstance(holder, dict) else None
    return version if isinstance(version, str) else None


def aborted(route: str, answer: bytes | None, *, stream: bool = False) -> bool:
    """Whether an answer (a whole JSON body, or a stream's SSE bytes) says its backend aborted
    it: SGLang ends an aborted stream as any other, a `finish_reason` `abort` (`/generate`:
    `{"type": "abort"}`) and then `[DONE]`, with no error event. In a stream, the abort is
    not always the last data event: a usage chunk (`include_usage`) or another choice's
    chunks may follow it."""
    if answer is None or b'"abort"' not in answer:
        return False
    if stream:
        for event in answer.split(b"\n\n"):
            if b'"abort"' in event:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:") and _aborted(route, line[5:].strip()):
                        return True
        return False
    return _aborted(route, answer)


def _aborted(route: str, answer: bytes) -> bool:
    """Whether one JSON answer or event says its backend aborted it."""
    try:
        obj = orjson.loads(answer)
    except ValueError:
        return False
    for item in obj if isinstance(obj, list) else [obj]:  # a /generate batch is a list
        if not isinstance(item, dict):
            continue
        if route == "/generate":
            meta = item.get("meta_info")
            reasons = [meta.get("finish_reason")] if isinstance(meta, dict) else []
        else:
            choices = item.get("choices")
            reasons = [c.get("finish_reason") for c in choices if isinstance(c, dict)] if (
                isinstance(choices, list)) else []  # fmt: skip
        for reason in reasons:
            if reason == "abort" or (isinstance(reason, dict) and reason.get("type") == "abort"):
                return True
    return False


class ResponseCache:
    """L1 then the shared tiers; counts every look-up and store."""

    def __init__(
        self,
        config: CacheConfig,
        *,
        tiers: list[CacheTier],
        registry: CollectorRegistry,
        clock: Any = time.time,
    ) -> None:
        self.config = config
        self.tiers = tiers
        self._clock = clock
        self.l1: LRUCache[str, Entry] = LRUCache(
            maxsize=max(config.l1_max_bytes, 1), getsizeof=_size_of
        )
        self._pinned = dict(pin.split("=", 1) for pin in config.model_versions)
        self._learned: dict[str, str] = {}
        self.fleet: Callable[[], Iterable[Backend]] | None = None
        """The backends (`edge.wiring` sets it): the version their pool serves now keys a
        look-up, so a rollout that gives the backends new weights invalidates at once."""
        self.requests = Counter(
            "quicedge_cache_requests_total",
            "Response-cache look-ups by tier (l1, l2) and outcome (hit, miss, error)",
            ["tier", "outcome"],
            registry=registry,
        )
        self.stores = Counter(
            "quicedge_cache_stores_total",
            "Answers offered to the response cache by outcome (stored, too_large, incomplete, "
            "error)",
            ["outcome"],
            registry=registry,
        )
        self.l1_bytes = Gauge(
            "quicedge_cache_l1_bytes", "Bytes held by the in-process cache tier", registry=registry
        )

    def version(self, model: str) -> str:
        return self._pinned.get(model) or self._learned.get(model) or ""

    def learn(self, model: str, version: str) -> None:
        """A backend reported `version` for `model`: later keys use it, older entries miss.
        SGLang reports `default` when it was given no version: that says nothing."""
        if model not in self._pinned and version != "default":
            self._learned[model] = version

    def key(
        self,
        tenant: str,
        route: str,
        model: str,
        normalised: bytes,
        *,
        pool: str = "",
        served: str = "",
        answered: str | None = None,
    ) -> str:
        """`pool` is the pool routing resolved `model` to (an alias's, `default`'s) and
        `served` the version it chose for this request (a gray release's stable or canary),
        which neither a pin nor a learned version tells apart; with it, the learned version
        adds nothing (it follows whichever version answered last). A pin names the model
        as the request does, or its pool. Otherwise, an answer to store is keyed by the
        version that gave it (`answered`, "" when unknown), and a look-up (`answered` None)
        by the one version the pool's backends serve now, else the one that answered last."""
        pinned = self._pinned.get(model) or self._pinned.get(pool, "")
        if not served and not pinned:
            if answered is None:
                answered = self._fleet_version(pool)
            served = answered or self._learned.get(model, "")
        digest = hashlib.sha256()
        for part in (tenant, route, model, pool, pinned, served):
            data = part.encode()
            digest.update(b"%d:" % len(data) + data)
        digest.update(normalised)
        return digest.hexdigest()

    def _fleet_version(self, pool: str) -> str:
        """The version every backend of `pool` (not draining) reports; "" when they differ
        (a rollout under way), or none reports one."""
        if not pool or self.fleet is None:
            return ""
        found: set[str] = set()
        for backend in self.fleet():
            if backend.model == pool and not backend.draining:
                found.add(known_version(backend.model_version))
                if len(found) > 1:
                    return ""
        return found.pop() if found else ""

    @staticmethod
    def normalise(body: dict[str, Any]) -> bytes:
        return orjson.dumps(
            {k: v for k, v in body.items() if k not in _IGNORED}, option=orjson.OPT_SORT_KEYS
        )

    async def get(self, key: str) -> tuple[Entry, str] | None:
        """The entry and the tier that had it; an L2 hit is copied into L1."""
        now = self._clock()
        entry = self.l1.get(key)
        if entry is not None and entry.expires > now:
            self.requests.labels("l1", "hit").inc()
            return entry, "l1"
        if entry is not None:  # expired
            self.l1.pop(key, None)
            self.l1_bytes.set(self.l1.currsize)
        self.requests.labels("l1", "miss").inc()
        for tier in self.tiers:
            try:
                found = await tier.get(key)
            except StateUnavailable:
                self.requests.labels(tier.name, "error").inc()
                continue
            if found is None or found.expires <= now:
                self.requests.labels(tier.name, "miss").inc()
                continue
            self.requests.labels(tier.name, "hit").inc()
            self._put_l1(key, found)
            return found, tier.name
        return None

    def _put_l1(self, key: str, entry: Entry) -> None:
        if self.config.l1_max_bytes > 0 and _size_of(entry) <= self.l1.maxsize:
            self.l1[key] = entry
        self.l1_bytes.set(self.l1.currsize)

    async def put(self, key: str, *, stream: bool, body: bytes, content_type: bytes) -> None:
        entry = Entry(stream, body, self._clock() + self.config.ttl, content_type)
        self._put_l1(key, entry)
        outcome = "stored"
        for tier in self.tiers:
            try:
                await tier.put(key, entry)
            except StateUnavailable:
                outcome = "error"
        self.stores.labels(outcome).inc()


def _size_of(entry: Entry) -> int:
    return len(entry.body) + _ENTRY_OVERHEAD + 64  # 64: the hex key


__all__ = [
    "CACHE_HEADER",
    "CacheTier",
    "Entry",
    "RedisTier",
    "ResponseCache",
    "aborted",
    "deterministic",
    "known_version",
    "weight_version_of",
]
