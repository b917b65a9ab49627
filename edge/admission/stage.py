"""The admission stage: who the tenant is, whether its quota admits the request, and on which
backends it may be placed now. `edge.app` calls `identify` on the headers, `admit` after parsing,
`place` for the candidates of each attempt and `finish` when the request ends.

A tenant refused for its requests bucket cannot pass before that bucket refills (other edges only
take from it; a request this process gives back ends the refusal), so until then `identify`
refuses its requests at once: before their body is read, and without asking the store again. A
flood of over-quota requests costs a header lookup each."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from backends.registry import Backend
from edge.admission.headers import Standing, ratelimit_headers, retry_after
from edge.admission.limiter import RateLimiter
from edge.admission.redis_guard import RedisGuard
from edge.admission.settings import AdmissionSettings, ThrottleSettings
from edge.admission.tenants import Tenant, TenantDirectory
from edge.admission.throttle import AdmissionQueue, Throttle
from edge.errors import Overloaded, TooManyRequests, Unauthorized
from edge.exchange import Exchange
from edge.telemetry import Metrics


class Admission:
    def __init__(self, settings: AdmissionSettings, *, metrics: Metrics) -> None:
        settings.validate()
        self.settings = settings
        self.metrics = metrics
        self.directory = TenantDirectory(settings)
        self._by_name = self._names(self.directory)
        self.guard: RedisGuard | None = None
        if settings.redis.url is not None:
            self.guard = RedisGuard(settings.redis, on_state=self._redis_state)
            metrics.redis_state.labels("admission").set(0)
        self.limiter = RateLimiter(
            guard=self.guard,
            prefix=settings.redis.prefix,
            fallback_share=settings.redis.fallback_share,
            on_local=lambda name: metrics.admission_local.labels(name).inc(),
        )
        self.queue: AdmissionQueue | None = None
        if settings.throttle.max_queue_depth is not None:
            self.queue = AdmissionQueue(
                settings.throttle, Throttle(settings.throttle), on_wait=self._queued
            )
        self._in_flight: dict[str, int] = {}
        self._refused_until: dict[str, float] = {}
        """Tenant → when its requests bucket holds a request again (monotonic seconds)."""
        self._refused_standings: dict[str, tuple[float, tuple[Standing, ...]]] = {}
        """Tenant → when it was refused and where its buckets stood then (as they applied:
        scaled while Redis is out), for the rate-limit headers of the refusals from memory."""

    @staticmethod
    def _names(directory: TenantDirectory) -> dict[str, Tenant]:
        by_name = {t.name: t for t in directory.tenants}
        if directory.anonymous is not None:
            by_name[directory.anonymous.name] = directory.anonymous
        return by_name

    def set_tenants(self, settings: AdmissionSettings) -> None:
        """A reloaded config's tenants and anonymous tenant, for the requests that come next.

        Requests already admitted keep their slots (counted by tenant name) and are debited
        with the new shapes when they end; remembered refusals are dropped, since a tenant's
        quota may have grown. `[admission.throttle]` is `set_throttle`'s; `[admission.redis]`
        needs a restart."""
        settings.validate()
        directory = TenantDirectory(settings)
        self.directory, self._by_name = directory, self._names(directory)
        self._forget_refusals()

    def set_throttle(self, settings: ThrottleSettings) -> None:
        """A reloaded `[admission.throttle]`: the requests that look for a backend next, those
        waiting in the queue included, see the new depths, queue size and timeout. Turned off,
        the requests waiting go at once; turned on, a queue starts."""
        settings.validate()
        queue = self.queue
        if queue is not None:
            queue.reconfigure(settings)
        if settings.max_queue_depth is None:
            self.queue = None
        elif queue is None:
            self.queue = AdmissionQueue(settings, Throttle(settings), on_wait=self._queued)

    # -- the admin view ---------------------------------------------------------------------
    def tenants(self) -> dict[str, Any]:
        """`GET /tenants`: every tenant's tier, quotas and requests in flight here, the ones
        refused by memory for a while, and the admission queue."""
        now = time.monotonic()
        queue = self.queue
        return {
            "store": "redis" if self.guard is not None else "memory",
            "tenants": [self._tenant_view(t, now) for t in self._by_name.values()],
            "queue": None if queue is None else {
                "waiting": queue.waiting,
                "max_queue_depth": queue.settings.max_queue_depth,
                "queue_size": queue.settings.queue_size,
            },
        }  # fmt: skip

    def _tenant_view(self, tenant: Tenant, now: float) -> dict[str, Any]:
        requests, tokens = tenant.requests, tenant.tokens
        until = self._refused_until.get(tenant.name)
        return {
            "name": tenant.name, "tier": tenant.tier,
            "requests_per_second": requests.rate if requests is not None else None,
            "burst": int(requests.capacity) if requests is not None else None,
            "tokens_per_minute": round(tokens.rate * 60) if tokens is not None else None,
            "max_concurrent": tenant.max_concurrent,
            "in_flight": self._in_flight.get(tenant.name, 0),
            "refused_for_s": round(until - now, 3) if until is not None and until > now else 0.0,
        }  # fmt: skip

    async def tenant(self, name: str) -> dict[str, Any] | None:
        """`GET /tenants/{name}`: the tenant's view and where its buckets stand now (with Redis,
        the shared ones: one round trip); None for a name no tenant has."""
        tenant = self._by_name.get(name)
        if tenant is None:
            return None
        view = self._tenant_view(tenant, time.monotonic())
        view["buckets"] = {
            s.name: {
                "limit": math.floor(s.bucket.capacity),
                "remaining": max(0, math.floor(s.level)),
                "reset_s": round(max(0.0, s.bucket.capacity - s.level) / s.bucket.rate, 3),
            }
            for s in await self.limiter.standing(tenant)
        }  # fmt: skip
        return view

    def _redis_state(self, name: str, old: str, state: str) -> None:
        self.metrics.redis_breaker(name, old, state)
        if "closed" in (old, state):  # the buckets now come from elsewhere: refusals are void
            self._forget_refusals()

    def _forget_refusals(self) -> None:
        self._refused_until.clear()
        self._refused_standings.clear()

    def _remember_refusal(self, name: str, wait: float, standings: tuple[Standing, ...]) -> None:
        """The tenant's requests bucket refused it: refuse it from memory for `wait` s."""
        now = time.monotonic()
        self._refused_until[name] = now + wait
        self._refused_standings[name] = (now, standings)

    def _standings_since(self, tenant: Tenant, wait: float, now: float) -> tuple[Standing, ...]:
        """Where the buckets of a tenant refused from memory stand now, from where its refusal
        left them: the requests bucket a request short of one until it holds one in `wait` s,
        the others refilled since (in the shapes that applied then)."""
        at, standings = self._refused_standings.get(tenant.name, (now, ()))
        out: list[Standing] = []
        for s in standings:
            rate, cap = s.bucket.rate, s.bucket.capacity
            level = 1 - wait * rate if s.name == "requests" else s.level + (now - at) * rate
            out.append(Standing(s.name, s.bucket, min(cap, level)))
        if not out and tenant.requests is not None:
            out.append(Standing("requests", tenant.requests, 1 - wait * tenant.requests.rate))
        return tuple(out)

    def _queued(self, tier: str, waited: float, placed: bool) -> None:
        self.metrics.admission_queue_wait.labels(tier, "placed" if placed else "refused").observe(
            waited
        )

    def identify(self, authorization: bytes | None) -> Tenant:
        try:
            tenant = self.directory.identify(authorization)
        except Unauthorized:
            self.metrics.admission_rejections.labels("-", "unauthorized").inc()
            raise
        if self._refused_until:
            until = self._refused_until.get(tenant.name)
            if until is not None:
                now = time.monotonic()
                wait = until - now
                if wait > 0 and tenant.requests is not None:
                    self._reject(tenant.name, "requests")
                    standings = self._standings_since(tenant, wait, now)
                    raise self._over_quota(tenant.name, "requests", wait, standings)
                del self._refused_until[tenant.name]
                self._refused_standings.pop(tenant.name, None)
        return tenant

    @staticmethod
    def _over_quota(
        name: str, reason: str, wait: float, standings: tuple[Standing, ...] = ()
    ) -> TooManyRequests:
        after = max(1, math.ceil(wait))
        what = "requests per second" if reason == "requests" else "tokens per minute"
        return TooManyRequests(
            f"Rate limit reached for tenant {name} on {what}; retry in {after}s.",
            headers=(*retry_after(wait), *ratelimit_headers(standings)),
        )

    async def admit(self, ex: Exchange, tenant: Tenant) -> None:
        """Charge the tenant's buckets for the request; 429 with Retry-After when over quota."""
        assert ex.view is not None
        name = tenant.name
        cap = tenant.max_concurrent
        if cap is not None:
            held = self._in_flight.get(name, 0)
            if held >= cap:
                self._reject(name, "concurrency")
                raise await self._over_concurrency(tenant, cap)
            # The slot is taken before the take awaits (a Redis round trip): requests arriving
            # meanwhile must see it, or all of them pass the check together.
            self._in_flight[name] = held + 1
        view = ex.view
        prompt = view.approx_tokens if view.batch_tokens is None else view.batch_tokens
        if tenant.limited:
            try:
                verdict, reason, standings = await self.limiter.take(tenant, prompt)
            except BaseException:  # cancelled (client gone) or failed: the slot is not used
                self._release(name, cap)
                raise
            if not verdict.allowed:
                self._release(name, cap)
                self._reject(name, reason)
                if reason == "requests":
                    self._remember_refusal(name, verdict.retry_after, standings)
                raise self._over_quota(name, reason, verdict.retry_after, standings)
            ex.ratelimit = ratelimit_headers(standings)
        ex.holds_slot = cap is not None
        self.metrics.tenant_requests.labels(name, tenant.tier).inc()
        self.metrics.tenant_tokens.labels(name, "prompt").inc(prompt)

    async def _over_concurrency(self, tenant: Tenant, cap: int) -> TooManyRequests:
        """The 429 for a tenant at its `max_concurrent`: a second's wait (a slot frees when a
        request ends, which no bucket predicts) and, for a tenant with a quota, its rate-limit
        headers as every 429 has them, from where its buckets stand (nothing is taken)."""
        standings = await self.limiter.standing(tenant) if tenant.limited else ()
        return TooManyRequests(
            f"tenant {tenant.name} has {cap} requests in flight, its maximum; retry when one ends",
            headers=(*retry_after(1.0), *ratelimit_headers(standings)),
        )

    def _release(self, name: str, cap: int | None) -> None:
        """Give back a slot `admit` took for a request it then refused."""
        if cap is not None:
            self._in_flight[name] -= 1

    async def charge_call(self, tenant: Tenant) -> list[tuple[bytes, bytes]]:
        """Charge a call that is not an inference request (the stored objects' routes) to the
        tenant's requests bucket: one request, no tokens; 429 with Retry-After when over it, so
        a flood of them is held to the tenant's rate as its requests are. The answer's
        rate-limit headers (a client polling a background response paces itself on them)."""
        if not tenant.limited or tenant.requests is None:
            return []
        verdict, reason, standings = await self.limiter.take(tenant, 0, tokens=False)
        if not verdict.allowed:
            self._reject(tenant.name, reason)
            if reason == "requests":
                self._remember_refusal(tenant.name, verdict.retry_after, standings)
            raise self._over_quota(tenant.name, reason, verdict.retry_after, standings)
        return ratelimit_headers(standings)

    def _reject(self, name: str, reason: str) -> None:
        self.metrics.admission_rejections.labels(name, reason).inc()

    async def place(self, ex: Exchange, candidates: Callable[[], list[Backend]]) -> list[Backend]:
        """The backends this attempt may use (waiting in the admission queue when all are full).

        None (the caller's 503), or the queue's 503, for a request no backend has had: what its
        admission took is given back, the edge's own overload is not the tenant's spending."""
        try:
            if self.queue is None:
                found = candidates()
            else:
                found = await self.queue.place(ex.tier_rank, ex.tier, candidates, ex.tenant)
        except Overloaded:
            await self._refund(ex)
            raise
        if not found:
            await self._refund(ex)
        return found

    async def _refund(self, ex: Exchange) -> None:
        """Give back the request and prompt `admit` took for `ex`, once, if no backend had it."""
        if ex.ratelimit is None or ex.backend is not None:  # nothing taken, or a backend had it
            return
        ex.ratelimit = None  # the buckets no longer stand as admission left them; and once only
        tenant = self._by_name.get(ex.tenant)
        if tenant is None or not tenant.limited or ex.view is None:
            return
        view = ex.view
        prompt = view.approx_tokens if view.batch_tokens is None else view.batch_tokens
        await self.limiter.refund(tenant, prompt)
        # Its requests bucket holds a request again: a refusal remembered since (another of the
        # tenant's requests, while this one held it) no longer says when the next may pass.
        if self._refused_until.pop(tenant.name, None) is not None:
            self._refused_standings.pop(tenant.name, None)

    def finish(self, ex: Exchange, completion_tokens: int | None) -> None:
        """The request ended (any way): free its slot, debit its answer, wake the queue."""
        name = ex.tenant
        if ex.holds_slot:
            ex.holds_slot = False
            self._in_flight[name] -= 1
        if completion_tokens:
            self.metrics.tenant_tokens.labels(name, "completion").inc(completion_tokens)
            tenant = self._by_name.get(name)
            if tenant is not None:
                self.limiter.debit(tenant, completion_tokens)
        if self.queue is not None:
            self.queue.wake()

    async def aclose(self) -> None:
        await self.limiter.aclose()
        if self.guard is not None:
            await self.guard.aclose()


__all__ = ["Admission"]
