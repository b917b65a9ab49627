"""The one class through which `edge.state` talks to Redis: every call bounded by a timeout.

A call that times out or fails raises `StateUnavailable` (503 `state_unavailable`), so a request
that needs the state gets a clear answer and a request that does not (the response cache treats it
as a miss) goes on. Calls go through the same `RedisGuard` as admission's buckets: a dead or hung
server costs at most `timeout` per call for the first few calls, then the guard's breaker opens
and calls fail at once, without a round trip, until a background PING finds Redis answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from edge.admission.redis_guard import RedisGuard, RedisUnavailable
from edge.admission.settings import RedisSettings
from edge.errors import StateUnavailable

T = TypeVar("T")
log = logging.getLogger(__name__)

# A tenant's share (`Share`): a sorted set of its objects by last use (seconds) and a hash of
# their sizes, whose field "" holds their sum. `account` records one object written (its size)
# and drops, with their keys (`prefix` .. member), the least recently used others while the
# tenant holds more than `max_count` objects or `max_bytes`; those whose TTL ran out leave the
# count first. ARGV from `first`: member, size, now, ttl (s), max_count, max_bytes, prefix.
_ACCOUNT = """
local function account(index, sizes, first, size)
  local member, now, ttl = ARGV[first], tonumber(ARGV[first + 2]), tonumber(ARGV[first + 3])
  local max_count, max_bytes = tonumber(ARGV[first + 4]), tonumber(ARGV[first + 5])
  local prefix = ARGV[first + 6]
  local total = tonumber(redis.call('HGET', sizes, '') or '0')
  local old = redis.call('ZRANGEBYSCORE', index, '-inf', '(' .. (now - ttl))
  for _, m in ipairs(old) do
    total = total - tonumber(redis.call('HGET', sizes, m) or '0')
    redis.call('HDEL', sizes, m)
    redis.call('ZREM', index, m)
  end
  total = total - tonumber(redis.call('HGET', sizes, member) or '0') + size
  redis.call('ZADD', index, now, member)
  redis.call('HSET', sizes, member, size)
  while redis.call('ZCARD', index) > max_count or total > max_bytes do
    local oldest = redis.call('ZRANGE', index, 0, 1)
    local victim = oldest[1]
    if victim == member then
      victim = oldest[2]
    end
    if not victim then
      break
    end
    total = total - tonumber(redis.call('HGET', sizes, victim) or '0')
    redis.call('HDEL', sizes, victim)
    redis.call('ZREM', index, victim)
    redis.call('DEL', prefix .. victim)
  end
  redis.call('HSET', sizes, '', total)
  local ttl_ms = math.ceil(ttl * 1000)
  redis.call('PEXPIRE', index, ttl_ms)
  redis.call('PEXPIRE', sizes, ttl_ms)
end
"""
# Commit a conversation only while this turn still holds its lease (the value is the turn's
# token): a turn whose lease expired and was taken by another cannot overwrite the history.
# With KEYS[3] and KEYS[4] (its tenant's share), it is accounted there (`_ACCOUNT`).
_COMMIT = (
    _ACCOUNT
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  redis.call('DEL', KEYS[1])
  if #KEYS > 2 then
    account(KEYS[3], KEYS[4], 4, #ARGV[2])
  end
  return 1
end
return 0
"""
)
# SET PX of KEYS[1], accounted in its tenant's share (KEYS[2], KEYS[3]).
_SET_SHARED = (
    _ACCOUNT
    + """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
account(KEYS[2], KEYS[3], 3, #ARGV[1])
return 1
"""
)
# GETEX PX of KEYS[1]; when there, its use is noted in its tenant's share (KEYS[2], KEYS[3]),
# whose TTL restarts with it: the count lives as long as what it counts, or a tenant that only
# reads for longer than the TTL would write again from a count of nothing.
_GET_SHARED = """
local value = redis.call('GETEX', KEYS[1], 'PX', ARGV[1])
if value then
  redis.call('ZADD', KEYS[2], 'XX', ARGV[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[3], ARGV[1])
end
return value
"""
# DEL of KEYS[3] on, whose members ARGV (in the same order) leave their tenant's share
# (KEYS[1], KEYS[2]); how many of those keys existed.
_DEL_SHARED = """
local gone = 0
for i, member in ipairs(ARGV) do
  gone = gone + redis.call('DEL', KEYS[i + 2])
  local size = tonumber(redis.call('HGET', KEYS[2], member) or '0')
  if redis.call('HDEL', KEYS[2], member) > 0 then
    redis.call('HINCRBY', KEYS[2], '', -size)
  end
  redis.call('ZREM', KEYS[1], member)
end
return gone
"""
_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# Write a key unless it holds ARGV[3] (a deleted background response's mark, which a late
# final record must not overwrite), or, when ARGV[4] is given, a value that starts with it (a
# cancelled one's record, which a late failure must not overwrite).
# With KEYS[2] and KEYS[3] (its tenant's share), what it writes is accounted there (`_ACCOUNT`).
_SET_UNLESS = (
    _ACCOUNT
    + """
local held = redis.call('GET', KEYS[1])
if held == ARGV[3] then
  return 0
end
if held and #ARGV[4] > 0 and string.sub(held, 1, #ARGV[4]) == ARGV[4] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if #KEYS > 1 then
  account(KEYS[2], KEYS[3], 5, #ARGV[1])
end
return 1
"""
)
# Append to a list from index ARGV[2] on: entries an earlier try already added (its reply came
# too late) are not added twice, so an entry's index stays its sequence number. From index 0
# the list starts anew, and KEYS[2] (when given) names its writer, ARGV[3]: what the list held
# was another writer's (a deleted response's, whose id the next turn took), and a try again
# from 0 sends every entry. Past 0, a writer that is not the one named adds nothing.
_APPEND_AT = """
local at = tonumber(ARGV[2])
if at == 0 then
  redis.call('DEL', KEYS[1])
  if #KEYS > 1 then
    redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[1])
  end
elseif #KEYS > 1 and redis.call('GET', KEYS[2]) ~= ARGV[3] then
  return 0
end
local n = redis.call('LLEN', KEYS[1])
if n < at then
  return 0
end
for i = 4 + n - at, #ARGV do
  redis.call('RPUSH', KEYS[1], ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if #KEYS > 1 then
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
end
return 1
"""


class Unreadable(ValueError):
    """A stored value this edge cannot read: another version's format, another program's key
    under the same prefix, a partial restore. Readers treat it as not there (a 404)."""


UNREADABLE_WARN_S = 30.0
"""At most one warning about unreadable values per this many seconds (a client may ask again
and again)."""
_last_unreadable = -UNREADABLE_WARN_S


def warn_unreadable(what: str, err: Exception) -> None:
    """Log an unreadable value (rate-limited): an operator should know, a client gets a 404."""
    global _last_unreadable
    now = time.monotonic()
    if now - _last_unreadable >= UNREADABLE_WARN_S:
        _last_unreadable = now
        log.warning("%s holds a value this edge cannot read (%s); answered as not found", what,
                    err)  # fmt: skip


def read_or_none(decode: Callable[[bytes], T], blob: bytes | None, what: str) -> T | None:
    """`decode(blob)`, with None for no value or one this edge cannot read (logged)."""
    if blob is None:
        return None
    try:
        return decode(blob)
    except Unreadable as err:
        warn_unreadable(what, err)
        return None


FAILURES_TO_OPEN = 3
"""Failed or timed-out calls in a row that open the state store's breaker."""
ORPHANS_MAX = 1024
"""Leases this edge may have left behind that it remembers to release (`release_soon`); past
that, the oldest are left to expire with their TTL."""
SWEEP_S = 0.25
"""How often the remembered leases are released while Redis answers."""
SWEEP_BACKOFF_S = 1.0
"""The wait after a release that did not answer (the breaker may be about to open)."""
ORPHAN_GRACE_S = 5.0
"""How long a remembered lease is still tried after Redis said it is not held: a take that
timed out may land a moment later (held in a socket buffer or a proxy)."""


@dataclass(slots=True)
class _Orphan:
    until: float
    """When its TTL runs out anyway (monotonic s)."""
    missed_at: float | None = None
    """When Redis first answered that it is not held."""


@dataclass(frozen=True, slots=True)
class Share:
    """One tenant's share of one kind of object in Redis, bounded (`tenant_max_conversations`,
    `tenant_max_bytes`): `index`, a sorted set of its members by last use, and `sizes`, a hash
    of their sizes (field "": their sum). A member's key is `prefix` + member."""

    index: str
    sizes: str
    prefix: str
    ttl_s: float
    max_count: int
    max_bytes: int

    def args(self, member: str) -> list[Any]:
        """The `_ACCOUNT` arguments after its size (the script counts it)."""
        return [member, 0, time.time(), self.ttl_s, self.max_count, self.max_bytes, self.prefix]


class RedisState:
    """A guarded `redis.asyncio` client: every call ends within `timeout` seconds, and none is
    sent while the guard's breaker is open."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        prefix: str,
        on_state: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.prefix = prefix
        self.timeout = timeout
        timeout_ms = timeout * 1000
        # Only failures trip it: a slow answer within `timeout` is still an answer worth having.
        settings = RedisSettings(
            url=url, timeout_ms=timeout_ms, slow_ms=timeout_ms, failures_to_open=FAILURES_TO_OPEN
        )
        self.guard = RedisGuard(settings, name="state", on_state=on_state)
        self.client: aioredis.Redis = self.guard.client
        self._commit = self.client.register_script(_COMMIT)
        self._release = self.client.register_script(_RELEASE)
        self._extend = self.client.register_script(_EXTEND)
        self._append_at = self.client.register_script(_APPEND_AT)
        self._set_unless = self.client.register_script(_SET_UNLESS)
        self._set_shared = self.client.register_script(_SET_SHARED)
        self._get_shared = self.client.register_script(_GET_SHARED)
        self._del_shared = self.client.register_script(_DEL_SHARED)
        self._orphans: dict[tuple[str, bytes], _Orphan] = {}
        """Leases (key, token) whose take, commit or release did not answer: they may hold
        their conversation though no turn runs, so they are released once Redis answers."""
        self._sweeper: asyncio.Task[None] | None = None

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await self.guard.run(call)
        except RedisUnavailable as exc:
            raise StateUnavailable(
                f"the state store did not answer ({what}): {exc}; retry shortly"
            ) from None

    async def _string(self, what: str, call: Callable[[], Awaitable[Any]]) -> bytes | None:
        """A read of a string key. A key of another type (WRONGTYPE) reads as b"", which no
        decoder accepts: it is an unreadable value, not a Redis failure for the breaker."""

        async def read() -> Any:
            try:
                return await call()
            except ResponseError as exc:
                if str(exc).startswith("WRONGTYPE"):
                    return b""
                raise

        value = await self._call(what, read)
        return value if isinstance(value, bytes) else None

    async def get(self, key: str) -> bytes | None:
        return await self._string("get", lambda: self.client.get(key))

    async def set(self, key: str, value: bytes, ttl_ms: int) -> None:
        await self._call("set", lambda: self.client.set(key, value, px=ttl_ms))

    async def set_unless(
        self,
        key: str,
        value: bytes,
        ttl_ms: int,
        unless: bytes,
        unless_prefix: bytes = b"",
        share: Share | None = None,
        member: str = "",
    ) -> bool:
        """SET PX of `key` unless it holds `unless` or (when given) a value that starts with
        `unless_prefix`, atomically; whether it was written. With `share`, `key` is `member`
        of it (the tenant's least recently used may go)."""
        keys: list[str] = [key]
        args: list[Any] = [value, ttl_ms, unless, unless_prefix]
        if share is not None:
            keys += [share.index, share.sizes]
            args += share.args(member)
        done = await self._call("set unless", lambda: self._set_unless(keys=keys, args=args))
        return bool(done)

    async def set_new(self, key: str, value: bytes, ttl_ms: int) -> bool:
        """SET NX PX: True when the key did not exist (a lease taken)."""
        return bool(
            await self._call("set nx", lambda: self.client.set(key, value, nx=True, px=ttl_ms))
        )

    async def commit(
        self,
        lease: str,
        token: bytes,
        key: str,
        value: bytes,
        ttl_ms: int,
        share: Share | None = None,
        member: str = "",
    ) -> bool:
        """Write `key` and drop `lease` only while `lease` still holds `token`; with `share`,
        `key` is `member` of it (the tenant's least recently used may go)."""
        keys, args = [lease, key], [token, value, ttl_ms]
        if share is not None:
            keys += [share.index, share.sizes]
            args += share.args(member)
        done = await self._call("commit", lambda: self._commit(keys=keys, args=args))
        return bool(done)

    async def set_shared(
        self, key: str, value: bytes, ttl_ms: int, share: Share, member: str
    ) -> None:
        """SET PX of `key`, `member` of `share` (the tenant's least recently used may go),
        in one atomic step."""
        keys, args = [key, share.index, share.sizes], [value, ttl_ms, *share.args(member)]
        await self._call("set", lambda: self._set_shared(keys=keys, args=args))

    async def get_shared(self, key: str, ttl_ms: int, share: Share, member: str) -> bytes | None:
        """GETEX PX of `key` (its TTL restarted), its use noted in `share`: its most recently
        used now."""
        args = [ttl_ms, time.time(), member]
        return await self._string(
            "getex", lambda: self._get_shared(keys=[key, share.index, share.sizes], args=args)
        )

    async def delete_shared(self, share: Share, *members: str) -> int:
        """DEL of `members`' keys, each leaving `share`, in one atomic step; how many
        existed."""
        keys = [share.index, share.sizes, *(share.prefix + m for m in members)]
        gone: Any = await self._call("del", lambda: self._del_shared(keys=keys, args=list(members)))
        return int(gone)

    async def extend(self, lease: str, token: bytes, ttl_ms: int) -> bool:
        """Restart `lease`'s TTL while it still holds `token`; False when it does not."""
        done = await self._call("extend", lambda: self._extend(keys=[lease], args=[token, ttl_ms]))
        return bool(done)

    async def release(self, lease: str, token: bytes) -> bool:
        """Drop `lease` if it holds `token`; whether it did."""
        done = await self._call("release", lambda: self._release(keys=[lease], args=[token]))
        return bool(done)

    async def take_lease(self, lease: str, token: bytes, ttl_ms: int) -> bool:
        """SET NX PX of a lease (`set_new`). Leases this edge left behind on the same key go
        first; when the take does not answer, Redis may have applied it all the same (only
        its reply was late), so it is released once Redis answers (`release_soon`)."""
        if self._orphans:
            await self._free(lease)
        sent = self.guard.usable  # an open breaker sends nothing: nothing to undo then
        try:
            return await self.set_new(lease, token, ttl_ms)
        except StateUnavailable:
            if sent:
                self.release_soon(lease, token, ttl_ms)
            raise

    def release_soon(self, lease: str, token: bytes, ttl_ms: int) -> None:
        """Release `lease` while it holds `token`, in the background, once Redis answers: a
        lease whose take, commit or release failed, which no turn holds any longer. Tried
        every `SWEEP_S` while the breaker is closed, until it is released, Redis says it is
        not held (for `ORPHAN_GRACE_S`), or its TTL runs out. Never raises."""
        key = (lease, token)
        self._orphans.pop(key, None)
        self._orphans[key] = _Orphan(time.monotonic() + ttl_ms / 1000)
        while len(self._orphans) > ORPHANS_MAX:
            del self._orphans[next(iter(self._orphans))]
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    @property
    def orphans(self) -> int:
        """Leases waiting to be released (`release_soon`)."""
        return len(self._orphans)

    async def _free(self, lease: str) -> None:
        """Release this edge's leases left behind on `lease` now (StateUnavailable: not
        answered; they stay remembered)."""
        for key in [k for k in self._orphans if k[0] == lease]:
            await self._release_orphan(key)

    async def _release_orphan(self, key: tuple[str, bytes]) -> None:
        orphan = self._orphans.get(key)
        if orphan is None:
            return
        now = time.monotonic()
        if now < orphan.until:
            if not await self.release(*key):
                if orphan.missed_at is None:
                    orphan.missed_at = now
                if now - orphan.missed_at < ORPHAN_GRACE_S:
                    return
        if self._orphans.get(key) is orphan:
            del self._orphans[key]

    async def _sweep(self) -> None:
        wait = SWEEP_S
        while self._orphans:
            await asyncio.sleep(wait)
            wait = SWEEP_S
            if not self.guard.usable:  # nothing can be sent; the breaker's probe closes it
                now = time.monotonic()
                for key in [k for k, o in self._orphans.items() if o.until <= now]:
                    del self._orphans[key]
                continue
            for key in list(self._orphans):
                try:
                    await self._release_orphan(key)
                except StateUnavailable:
                    wait = SWEEP_BACKOFF_S
                    break

    async def replace(self, key: str, value: bytes) -> bool:
        """SET XX KEEPTTL: change an existing key, its TTL as it was; False when none."""
        done = await self._call(
            "set xx", lambda: self.client.set(key, value, xx=True, keepttl=True)
        )
        return bool(done)

    async def index_newest(self, index: str, count: int) -> list[str]:
        """The `count` highest-scored members of `index`, highest first."""
        members: Any = await self._call(
            "index read", lambda: self.client.zrevrange(index, 0, count - 1)
        )
        return [m.decode() if isinstance(m, bytes) else str(m) for m in members]

    async def list_append_at(
        self,
        key: str,
        at: int,
        values: list[bytes],
        ttl_ms: int,
        writer: tuple[str, str] | None = None,
    ) -> bool:
        """Append `values` as the list's entries from index `at` on (those already there are
        not added again; from 0, it holds `values` only) and restart its TTL; False when it
        holds fewer than `at`. `writer` (a key, a token): from 0 the token is kept there, past
        0 a list whose key holds another token takes nothing (False)."""
        keys = [key] if writer is None else [key, writer[0]]
        token = "" if writer is None else writer[1]
        done = await self._call(
            "list append", lambda: self._append_at(keys=keys, args=[ttl_ms, at, token, *values])
        )
        return bool(done)

    async def list_from(self, key: str, start: int) -> list[bytes] | None:
        """The list's entries from index `start` on; None when there is no list."""

        async def run() -> list[bytes] | None:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.exists(key)
                pipe.lrange(key, start, -1)
                exists, entries = await pipe.execute()
            return [bytes(e) for e in entries] if exists else None

        return await self._call("list read", run)

    async def set_many(self, items: list[tuple[str, bytes, int]]) -> None:
        """SET PX of each (key, value, ttl_ms), in one round trip (not atomic)."""

        async def run() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                for key, value, ttl_ms in items:
                    pipe.set(key, value, px=ttl_ms)
                await pipe.execute()

        await self._call("set many", run)

    async def get_and_set(self, key: str, other: str, value: bytes, ttl_ms: int) -> bytes | None:
        """GET `key` and SET `other` PX, in one round trip (a read and a heartbeat)."""

        async def run() -> bytes | None:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.get(key)
                pipe.set(other, value, px=ttl_ms)
                found, _ = await pipe.execute()
            return found if isinstance(found, bytes) else None

        return await self._call("get and set", run)

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        values: Any = await self._call("mget", lambda: self.client.mget(keys))
        return [v if isinstance(v, bytes) else None for v in values]

    async def delete(self, *keys: str) -> int:
        """Delete `keys`; how many existed."""
        count: Any = await self._call("del", lambda: self.client.delete(*keys))
        return int(count)

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.guard.aclose()


__all__ = ["RedisState", "Share", "Unreadable", "warn_unreadable"]
