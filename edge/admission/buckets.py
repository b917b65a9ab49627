"""Token buckets: one small interface, a memory store and a Redis store (one atomic round trip).

A take checks every bucket it names and takes from all of them only if all have enough, so a
request is never half-charged. A bucket may go into debt: a prompt larger than the bucket is
admitted when the bucket is full, and completion tokens are debited after the fact; the debt is
paid back by refill before the tenant's next request passes. `retry_after` is the time until the
emptiest bucket holds what was asked.

The Redis store runs one Lua script (redis-py `register_script`, EVALSHA with a reload on
NOSCRIPT) that reads the buckets' hashes, refills them from Redis's own clock (`TIME`, so edges
with skewed clocks agree), decides, writes and sets a TTL, all in one round trip.

Why no library: `limits` offers fixed and sliding windows, not a refilling bucket with a burst,
and two limits (requests, tokens) are two round trips that are not atomic together;
`pyrate-limiter`'s Redis bucket keeps one sorted-set member per unit of weight, so a 4,000-token
prompt would write 4,000 members; `aiolimiter` is in-process only. The script here is ~40 lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from edge.admission.redis_guard import RedisGuard
from edge.admission.tenants import Bucket


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    retry_after: float = 0.0
    """Seconds until the bucket that refused holds enough (0 when allowed)."""
    refused: int = -1
    """Index of the bucket that refused (-1 when allowed)."""
    levels: tuple[float, ...] = ()
    """Each bucket's level after the take (before it, when refused), in the charges' order:
    what the rate-limit headers call remaining."""


ALLOWED = Verdict(True)

Charge = tuple[str, Bucket, float]
"""(key, bucket shape, cost) for one bucket in a take."""


class BucketStore(Protocol):
    async def take(self, charges: Sequence[Charge]) -> Verdict:
        """Take every cost if every bucket holds at least min(cost, capacity); else nothing."""
        ...

    async def debit(self, key: str, bucket: Bucket, cost: float) -> None:
        """Take `cost` unconditionally (the bucket may go into debt)."""
        ...

    async def give(self, charges: Sequence[Charge]) -> None:
        """Give every cost back (a take the edge undid), no bucket above its size."""
        ...


class MemoryBuckets:
    """Buckets in this process: a dict of key → [level, last refill time]."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._levels: dict[str, list[float]] = {}

    def _level(self, key: str, bucket: Bucket, now: float) -> list[float]:
        state = self._levels.get(key)
        if state is None:
            state = self._levels[key] = [bucket.capacity, now]
        else:
            state[0] = min(bucket.capacity, state[0] + max(0.0, now - state[1]) * bucket.rate)
            state[1] = now
        return state

    def take_now(self, charges: Sequence[Charge]) -> Verdict:
        now = self._clock()
        states = [self._level(key, bucket, now) for key, bucket, _ in charges]
        wait, refused = 0.0, -1
        for i, ((_, bucket, cost), state) in enumerate(zip(charges, states, strict=True)):
            need = min(cost, bucket.capacity)
            if state[0] < need:
                w = (need - state[0]) / bucket.rate
                if w > wait:
                    wait, refused = w, i
        if refused >= 0:
            return Verdict(False, wait, refused, tuple(state[0] for state in states))
        for (_, _, cost), state in zip(charges, states, strict=True):
            state[0] -= cost
        return Verdict(True, levels=tuple(state[0] for state in states))

    async def take(self, charges: Sequence[Charge]) -> Verdict:
        return self.take_now(charges)

    def debit_now(self, key: str, bucket: Bucket, cost: float) -> None:
        """Take `cost` (a negative one gives back, up to the bucket's size)."""
        state = self._level(key, bucket, self._clock())
        state[0] = min(bucket.capacity, state[0] - cost)

    async def debit(self, key: str, bucket: Bucket, cost: float) -> None:
        self.debit_now(key, bucket, cost)

    def give_now(self, charges: Sequence[Charge]) -> None:
        for key, bucket, cost in charges:
            self.debit_now(key, bucket, -cost)

    async def give(self, charges: Sequence[Charge]) -> None:
        self.give_now(charges)

    def level(self, key: str) -> float | None:
        """The bucket's level at its last use (tests and the admin view)."""
        state = self._levels.get(key)
        return None if state is None else state[0]


# KEYS: one hash per bucket. ARGV: check (1/0), then rate, capacity, cost per bucket (a negative
# cost gives back, never above the capacity).
# Returns {allowed (1/0), retry_after (string: Lua numbers become integers on the way out),
# index of the refusing bucket (1-based, 0 when allowed), then each bucket's level after the
# take (before it, when refused), as strings}.
TAKE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local check = ARGV[1] == '1'
local levels = {}
local ahead = {}
local wait, refused = 0, 0
for i = 1, #KEYS do
  local rate = tonumber(ARGV[i * 3 - 1])
  local cap = tonumber(ARGV[i * 3])
  local cost = tonumber(ARGV[i * 3 + 1])
  local h = redis.call('HMGET', KEYS[i], 'l', 't')
  local level = tonumber(h[1])
  if level == nil then
    level = cap
  else
    local last = tonumber(h[2])
    -- written at a time ahead of this clock (a failover to a host whose clock is behind, a
    -- clock stepped back): nothing refills, and the refill counts from now on
    if last > now then ahead[i] = true end
    level = math.min(cap, level + math.max(0, now - last) * rate)
  end
  levels[i] = level
  local need = math.min(cost, cap)
  if check and level < need then
    local w = (need - level) / rate
    if w > wait then wait, refused = w, i end
  end
end
if refused > 0 then
  local out = {0, tostring(wait), refused}
  for i = 1, #KEYS do
    out[i + 3] = tostring(levels[i])
    if ahead[i] then
      -- else a refusal writes nothing, and the bucket never refills until the clock is back
      local rate = tonumber(ARGV[i * 3 - 1])
      local cap = tonumber(ARGV[i * 3])
      redis.call('HSET', KEYS[i], 'l', tostring(levels[i]), 't', tostring(now))
      redis.call('PEXPIRE', KEYS[i], math.ceil((cap - levels[i]) / rate * 1000) + 1000)
    end
  end
  return out
end
local out = {1, '0', 0}
for i = 1, #KEYS do
  local rate = tonumber(ARGV[i * 3 - 1])
  local cap = tonumber(ARGV[i * 3])
  local level = math.min(cap, levels[i] - tonumber(ARGV[i * 3 + 1]))
  redis.call('HSET', KEYS[i], 'l', tostring(level), 't', tostring(now))
  -- long enough to refill fully from the current debt; a full bucket needs no key at all
  redis.call('PEXPIRE', KEYS[i], math.ceil((cap - level) / rate * 1000) + 1000)
  out[i + 3] = tostring(level)
end
return out
"""


class RedisBuckets:
    """Buckets in Redis, shared by every edge process; each take is one EVALSHA.

    Calls go through the `RedisGuard`, which raises `RedisUnavailable` when Redis cannot answer
    in time or its breaker is open; the caller decides what happens then."""

    def __init__(self, guard: RedisGuard, prefix: str) -> None:
        self._guard = guard
        self._script = guard.client.register_script(TAKE_SCRIPT)
        self.prefix = prefix

    async def take(self, charges: Sequence[Charge]) -> Verdict:
        keys, args = self._encode(charges, check=True)

        async def call() -> Verdict:
            # Read inside the guarded call: an answer of another shape fails like a Redis error.
            allowed, wait, refused, *levels = await self._script(keys=keys, args=args)
            took = tuple(float(level) for level in levels)
            if len(took) != len(keys):
                raise ValueError(f"the take script answered {len(took)} levels for {len(keys)}")
            if int(allowed):
                return Verdict(True, levels=took)
            return Verdict(False, float(wait), int(refused) - 1, took)

        return await self._guard.run(call)

    async def debit(self, key: str, bucket: Bucket, cost: float) -> None:
        keys, args = self._encode([(key, bucket, cost)], check=False)
        await self._guard.run(lambda: self._script(keys=keys, args=args))

    async def give(self, charges: Sequence[Charge]) -> None:
        keys, args = self._encode([(k, b, -c) for k, b, c in charges], check=False)
        await self._guard.run(lambda: self._script(keys=keys, args=args))

    def _encode(self, charges: Sequence[Charge], *, check: bool) -> tuple[list[str], list[str]]:
        keys = [self.prefix + key for key, _, _ in charges]
        args = ["1" if check else "0"]
        for _, bucket, cost in charges:
            args += [repr(bucket.rate), repr(bucket.capacity), repr(float(cost))]
        return keys, args


__all__ = ["ALLOWED", "BucketStore", "Charge", "MemoryBuckets", "RedisBuckets", "Verdict"]
