"""Settings of the state the edge keeps: the store, stored conversations, the response cache.

TOML: a `[state]` table with `[state.conversations]` and `[state.cache]` sub-tables; every key is a
field below. Times are in seconds, sizes in bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from redis.connection import parse_url

from edge.stages.validate import CHAT, COMPLETIONS, GENERATE

MiB = 1024 * 1024

CACHEABLE_ROUTES = frozenset({CHAT, COMPLETIONS, GENERATE})
"""The routes the response cache serves (`edge.state.stage`); `state.cache.routes` names some."""


def _check_keys(section: str, cls: type, data: Mapping[str, Any]) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{section}: unknown setting(s) {', '.join(unknown)}")


def _typed(section: str, name: str, default: object, value: object) -> object:
    """One TOML value checked against the field's default's type (ints pass for floats)."""
    where = f"{section}.{name}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: must be true or false, got {value!r}")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: must be an integer, got {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: must be a number, got {value!r}")
        return float(value)
    elif isinstance(default, list):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}: must be a list of strings, got {value!r}")
        return list(value)
    elif isinstance(default, str) or default is None:
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}: must be a string, got {value!r}")
    return value


@dataclass(slots=True)
class ConversationConfig:
    """Stored conversations (`/v1/responses` `previous_response_id`, `x-quicedge-conversation`)."""

    enabled: bool = True
    """Serve stored conversations. Harmless when on: only a client that asks for one gets one."""
    ttl: float = 1800.0
    """Seconds a conversation lives after its last use (30 min); every turn refreshes it."""
    max_bytes: int = 1 * MiB
    """Largest stored history of one conversation, in bytes of its JSON messages (1 MiB); what
    its turns keep besides to give their responses back is held to as much again."""
    overflow: Literal["truncate", "reject"] = "truncate"
    """Past `max_bytes`: `truncate` drops the oldest whole turns (the first turn's system message
    stays), `reject` answers 413 `conversation_too_large`."""
    lease: float = 300.0
    """Seconds one turn holds its conversation (409 `conversation_busy` for another turn
    meanwhile); a turn that outlives it cannot commit, so a history never interleaves."""
    memory_max_conversations: int = 100_000
    """Conversations the in-process store holds at most; past it, the tenant holding the most
    loses its least recently used (one tenant cannot evict another's)."""
    memory_max_bytes: int = 512 * MiB
    """Bytes the in-process store holds at most for each of conversations' histories, stored
    chat completions and background responses' event logs; past it, the tenant holding the
    most bytes loses its least recently used (event logs: the one written longest ago). At
    least four times `max_bytes` (a history and its turns' kept fields, or one event log)."""
    tenant_max_conversations: int = 10_000
    """Conversations one tenant keeps at most, in memory or in Redis, and as many stored chat
    completions; past it, that tenant's least recently used goes (another tenant's never)."""
    tenant_max_bytes: int = 256 * MiB
    """Bytes one tenant's conversations hold at most (their stored values), in memory or in
    Redis, and as many its stored chat completions; past it, as for the count. At least four
    times `max_bytes`."""
    background_max: float = 3600.0
    """Seconds a background answer may run; its turn renews its lease meanwhile."""
    background_running: int = 256
    """Background answers one process generates at once; past it, 503 `overloaded` (they hold
    no connection, so nothing else bounds them)."""

    def validate(self) -> None:
        for name in ("ttl", "lease", "background_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"state.conversations.{name}: must be > 0")
        if self.max_bytes < 1024:
            raise ValueError("state.conversations.max_bytes: must be >= 1024")
        if self.overflow not in ("truncate", "reject"):
            raise ValueError("state.conversations.overflow: must be truncate or reject")
        if self.memory_max_conversations < 1:
            raise ValueError("state.conversations.memory_max_conversations: must be >= 1")
        if self.memory_max_bytes < 4 * self.max_bytes:
            raise ValueError(
                "state.conversations.memory_max_bytes: must be at least 4 x max_bytes "
                f"({4 * self.max_bytes}), got {self.memory_max_bytes}"
            )
        if self.tenant_max_conversations < 1:
            raise ValueError("state.conversations.tenant_max_conversations: must be >= 1")
        if self.tenant_max_bytes < 4 * self.max_bytes:
            raise ValueError(
                "state.conversations.tenant_max_bytes: must be at least 4 x max_bytes "
                f"({4 * self.max_bytes}), got {self.tenant_max_bytes}"
            )
        if self.background_running < 1:
            raise ValueError("state.conversations.background_running: must be >= 1")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ConversationConfig:
        _check_keys("state.conversations", cls, data)
        config = cls()
        for name, value in data.items():
            setattr(config, name, _typed("state.conversations", name, getattr(config, name), value))
        config.validate()
        return config


@dataclass(slots=True)
class CacheConfig:
    """The response cache for deterministic requests (temperature 0, or a seed)."""

    allow_tenants: list[str] = field(default_factory=list)
    """Tenants whose requests may be cached; `["*"]` allows every tenant. Empty (the default)
    turns the cache off whatever a request asks."""
    routes: list[str] = field(default_factory=list)
    """Routes cached without the request header (`x-quicedge-cache: use`); a request can still
    opt out with `x-quicedge-cache: off`."""
    ttl: float = 600.0
    """Seconds an entry lives in L2 (Redis) and in L1."""
    l1_max_bytes: int = 64 * MiB
    """Bytes the in-process LRU holds at most (entries' bodies and keys)."""
    max_entry_bytes: int = 1 * MiB
    """Largest answer stored; a longer one is relayed and not cached."""
    l2: bool = True
    """Use Redis as L2 when `state.store` is `redis`."""
    model_versions: list[str] = field(default_factory=list)
    """`model=version` pins, part of every key of that model: changing one invalidates its
    entries. Versions the backends report (`weight_version`) are learned too."""

    def validate(self) -> None:
        if self.ttl <= 0:
            raise ValueError("state.cache.ttl: must be > 0")
        if self.l1_max_bytes < 0 or self.max_entry_bytes < 1:
            raise ValueError("state.cache.l1_max_bytes/max_entry_bytes: must be positive")
        for route in self.routes:  # another (a typo) matched no request: nothing was cached
            if route not in CACHEABLE_ROUTES:
                raise ValueError(
                    f"state.cache.routes: {route!r} is not a cached route; choose from "
                    + ", ".join(sorted(CACHEABLE_ROUTES))
                )
        for pin in self.model_versions:
            name, sep, version = pin.partition("=")
            if not sep or not name or not version:
                raise ValueError(f"state.cache.model_versions: {pin!r} is not model=version")

    @property
    def enabled(self) -> bool:
        return bool(self.allow_tenants)

    def allows(self, tenant: str) -> bool:
        return "*" in self.allow_tenants or tenant in self.allow_tenants

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> CacheConfig:
        _check_keys("state.cache", cls, data)
        config = cls()
        for name, value in data.items():
            setattr(config, name, _typed("state.cache", name, getattr(config, name), value))
        config.validate()
        return config


@dataclass(slots=True)
class StateConfig:
    """Where the edge keeps state, and the features that use it."""

    store: Literal["memory", "redis"] = "memory"
    """`memory`: one process (the default); `redis`: shared by workers and machines."""
    redis_url: str | None = None
    """`redis://HOST:PORT/DB`, needed when `store` is `redis`."""
    redis_timeout: float = 0.25
    """Seconds one Redis call may take before the request gets 503 `state_unavailable`
    (a stored conversation) or goes on uncached (the response cache)."""
    key_prefix: str = "quicedge:"
    """Prefix of every Redis key, so several deployments can share one Redis."""
    conversations: ConversationConfig = field(default_factory=ConversationConfig)
    """`[state.conversations]`."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """`[state.cache]`."""

    def validate(self) -> None:
        if self.store not in ("memory", "redis"):
            raise ValueError("state.store: must be memory or redis")
        if self.store == "redis" and not self.redis_url:
            raise ValueError("state.redis_url: needed when state.store is redis")
        if self.redis_url:
            _check_redis_url("state.redis_url", self.redis_url)
        if self.redis_timeout <= 0:
            raise ValueError("state.redis_timeout: must be > 0")
        self.conversations.validate()
        self.cache.validate()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> StateConfig:
        """From the TOML `[state]` table; unknown keys and wrong types are errors by name."""
        if not isinstance(data, Mapping):
            raise ValueError("state: must be a table")
        _check_keys("state", cls, data)
        config = cls()
        for name, value in data.items():
            if name == "conversations":
                config.conversations = ConversationConfig.from_mapping(_table(name, value))
            elif name == "cache":
                config.cache = CacheConfig.from_mapping(_table(name, value))
            else:
                setattr(config, name, _typed("state", name, getattr(config, name), value))
        config.validate()
        return config


def _check_redis_url(where: str, url: str) -> None:
    """`url` read as the Redis client reads it (ValueError naming `where`, not the URL, which may
    hold a password): a bad port passed the checks and then ended each worker at its start."""
    try:
        parse_url(url)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _table(name: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"state.{name}: must be a table")
    return value


__all__ = ["CacheConfig", "ConversationConfig", "StateConfig"]
