"""Per-tenant rate limits: a requests bucket and a tokens bucket, shared through Redis when one
is configured, with per-process buckets at `fallback_share` of each quota while it is not.

Prompt tokens are charged at admission from the request's approximate count. Completion tokens
are debited once, when the answer ends, from the usage the backend reported (or, when it
reported none, the content chunks relayed, about one token each): one store call per
request rather than one per streamed chunk, which for Redis would be a round trip per token.
The bucket goes into debt for them, so a long answer slows the tenant's next requests rather
than cutting the current one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from edge.admission.buckets import ALLOWED, Charge, MemoryBuckets, RedisBuckets, Verdict
from edge.admission.headers import Standing
from edge.admission.redis_guard import RedisGuard, RedisUnavailable
from edge.admission.tenants import Tenant

REASONS = ("requests", "tokens")
"""Which bucket refused, by charge index."""


class RateLimiter:
    def __init__(
        self,
        *,
        guard: RedisGuard | None,
        prefix: str,
        fallback_share: float,
        on_local: Callable[[str], None] | None = None,
    ) -> None:
        self.guard = guard
        self.shared = RedisBuckets(guard, prefix) if guard is not None else None
        self.local = MemoryBuckets()
        self.share = fallback_share
        self._on_local = on_local
        self._debits: set[asyncio.Task[None]] = set()

    async def take(
        self, tenant: Tenant, prompt_tokens: int, *, tokens: bool = True
    ) -> tuple[Verdict, str, tuple[Standing, ...]]:
        """Charge one request and its prompt (`tokens=False`: the request only); (verdict, the
        refusing bucket's reason, where each bucket stands now)."""
        charges, reasons = self._charges(tenant, prompt_tokens, tokens=tokens)
        if not charges:
            return ALLOWED, "", ()
        verdict, applied = await self._take(tenant, charges)
        standings = tuple(
            Standing(reason, bucket, level)
            for reason, (_, bucket, _), level in zip(reasons, applied, verdict.levels, strict=False)
        )
        return verdict, (reasons[verdict.refused] if not verdict.allowed else ""), standings

    @staticmethod
    def _charges(
        tenant: Tenant, prompt_tokens: int, *, tokens: bool
    ) -> tuple[list[Charge], list[str]]:
        charges: list[Charge] = []
        reasons: list[str] = []
        if tenant.requests is not None:
            charges.append((tenant.name + ":requests", tenant.requests, 1.0))
            reasons.append("requests")
        if tenant.tokens is not None and tokens:
            charges.append((tenant.name + ":tokens", tenant.tokens, float(prompt_tokens)))
            reasons.append("tokens")
        return charges, reasons

    async def standing(self, tenant: Tenant) -> tuple[Standing, ...]:
        """Where the tenant's buckets stand now (a take of nothing: the refill is written back,
        which changes nothing), for the admin view."""
        buckets = [("requests", tenant.requests), ("tokens", tenant.tokens)]
        charges = [(f"{tenant.name}:{name}", b, 0.0) for name, b in buckets if b is not None]
        if not charges:
            return ()
        verdict, applied = await self._take(tenant, charges, count=False)
        names = [name for name, b in buckets if b is not None]
        return tuple(Standing(name, bucket, level) for name, (_, bucket, _), level
                     in zip(names, applied, verdict.levels, strict=False))  # fmt: skip

    async def _take(
        self, tenant: Tenant, charges: list[Charge], *, count: bool = True
    ) -> tuple[Verdict, list[Charge]]:
        """The verdict, and the charges as they applied (scaled while Redis is out; `count`:
        a request taken from the local buckets is counted)."""
        if self.shared is None:
            return self.local.take_now(charges), charges
        assert self.guard is not None
        if self.guard.usable:
            with contextlib.suppress(RedisUnavailable):
                return await self.shared.take(charges), charges
        if self._on_local is not None and count:
            self._on_local(tenant.name)
        scaled = [(k, b.scaled(self.share), c) for k, b, c in charges]
        return self.local.take_now(scaled), scaled

    def debit(self, tenant: Tenant, tokens: int) -> None:
        """Debit completion tokens; never waits (a Redis debit runs as its own bounded task)."""
        bucket = tenant.tokens
        if bucket is None or tokens <= 0:
            return
        key = tenant.name + ":tokens"
        if self.shared is None:
            self.local.debit_now(key, bucket, tokens)
            return
        assert self.guard is not None
        if not self.guard.usable:
            self.local.debit_now(key, bucket.scaled(self.share), tokens)
            return
        task = asyncio.get_running_loop().create_task(self._debit(key, tenant, tokens))
        self._debits.add(task)
        task.add_done_callback(self._debits.discard)

    async def _debit(self, key: str, tenant: Tenant, tokens: int) -> None:
        assert self.shared is not None and tenant.tokens is not None
        try:
            await self.shared.debit(key, tenant.tokens, tokens)
        except RedisUnavailable:
            self.local.debit_now(key, tenant.tokens.scaled(self.share), tokens)

    async def refund(self, tenant: Tenant, prompt_tokens: int) -> None:
        """Give back what `take` charged for a request (one request, its prompt), to the buckets
        in use now, none above its size (with Redis, one round trip within its deadline)."""
        charges, _ = self._charges(tenant, prompt_tokens, tokens=True)
        if not charges:
            return
        if self.shared is not None:
            assert self.guard is not None
            if self.guard.usable:
                with contextlib.suppress(RedisUnavailable):
                    await self.shared.give(charges)
                    return
            charges = [(k, b.scaled(self.share), c) for k, b, c in charges]
        self.local.give_now(charges)

    async def aclose(self) -> None:
        if self._debits:
            await asyncio.wait(set(self._debits), timeout=1.0)


__all__ = ["REASONS", "RateLimiter"]
