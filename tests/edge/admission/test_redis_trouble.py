"""Shared quotas through a real Redis, and what happens when that Redis dies or stalls: every
request is still answered, limits fall back to per-process buckets at `fallback_share` of the
quota, and the shared buckets are used again once Redis is back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from backends.sim import SimServer
from edge.admission.settings import AdmissionSettings, RedisSettings
from tests.edge.admission.test_app_admission import CHAT, bearer, tenant
from tests.edge.conftest import Edge, client, fast_config, run_edge
from tests.edge.test_app_sim import metrics_text, sim_config
from tests.helpers import RedisServer, wait_until

# Generous deadlines for a loaded test machine: the mechanism is the same at 5 ms.
REDIS = {"timeout_ms": 1000.0, "slow_ms": 500.0, "backoff_s": 0.05, "backoff_max_s": 0.2}


def admission(url: str, prefix: str, *, burst: int, share: float = 0.5) -> AdmissionSettings:
    return AdmissionSettings(
        redis=RedisSettings(url=url, prefix=prefix, fallback_share=share, **REDIS),  # type: ignore[arg-type]
        # a refill this slow is no refill at all during a test: the counts below are exact
        tenants=[tenant("acme", "silver", "sk-acme", requests_per_second=0.0001, burst=burst)],
    )


@contextlib.asynccontextmanager
async def edge_with(settings: AdmissionSettings, backend: str) -> AsyncIterator[Edge]:
    config = fast_config([backend])
    config.admission = settings
    async with run_edge(config) as edge:
        yield edge


async def statuses(edge: Edge, n: int) -> list[int]:
    async with client(edge) as http:
        out = []
        for _ in range(n):
            r = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-acme"))
            assert r.status_code in (200, 429), r.text
            out.append(r.status_code)
        return out


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own, so that it can be killed and made slow."""
    server = RedisServer()
    yield server
    server.stop()


async def test_two_edges_share_one_tenant_quota(redis_url: str, redis_prefix: str) -> None:
    async with SimServer(sim_config("b1")) as sim:
        settings = admission(redis_url, redis_prefix, burst=6)
        async with edge_with(settings, sim.url) as a, edge_with(settings, sim.url) as b:
            codes = []
            for i in range(10):
                codes += await statuses(a if i % 2 else b, 1)
            assert codes == [200] * 6 + [429] * 4
            for edge in (a, b):
                assert edge.wiring.admission.guard is not None
                assert edge.wiring.admission.guard.state == "closed"


async def test_redis_killed_then_back(own_redis: RedisServer, redis_prefix: str) -> None:
    async with SimServer(sim_config("b1")) as sim:
        settings = admission(own_redis.url, redis_prefix, burst=10, share=0.5)
        async with edge_with(settings, sim.url) as edge:
            guard = edge.wiring.admission.guard
            assert guard is not None
            assert await statuses(edge, 4) == [200] * 4  # shared bucket: 6 of 10 left
            own_redis.stop()
            # every decision is now local, at half the quota: 5 of the burst of 10, which the
            # rate-limit headers say
            async with client(edge) as http:
                first = await http.post(
                    "/v1/chat/completions", json=CHAT, headers=bearer("sk-acme")
                )
            assert first.status_code == 200
            assert first.headers["x-ratelimit-limit-requests"] == "5"
            assert first.headers["x-ratelimit-remaining-requests"] == "4"
            assert await statuses(edge, 7) == [200] * 4 + [429] * 3
            assert guard.state in ("open", "half_open")
            text = await metrics_text(edge)
            assert 'quicedge_redis_breaker_trips_total{store="admission"} 1.0' in text
            # six decided by the local buckets; the last two refused before that, by the
            # refusal the sixth left behind
            assert 'quicedge_admission_local_decisions_total{tenant="acme"} 6.0' in text
            restarted = RedisServer(port=own_redis.port)
            try:
                await wait_until(lambda: guard.state == "closed", timeout=20)
                # a fresh Redis holds a full bucket: the shared quota is in force again
                assert await statuses(edge, 12) == [200] * 10 + [429] * 2
                level = redis.Redis(port=restarted.port).hget(redis_prefix + "acme:requests", "l")
                assert level is not None and float(level) == pytest.approx(0, abs=0.01)
                text = await metrics_text(edge)
                assert 'quicedge_redis_breaker_state{store="admission"} 0.0' in text
            finally:
                restarted.stop()


async def test_redis_paused_is_routed_around_then_used_again(
    own_redis: RedisServer, redis_prefix: str
) -> None:
    """A stalled Redis (CLIENT PAUSE: it accepts connections and answers nothing) must not
    hold requests: after `failures_to_open` slow calls the breaker opens and requests are
    decided locally at once."""
    async with SimServer(sim_config("b1")) as sim:
        settings = admission(own_redis.url, redis_prefix, burst=40, share=0.25)
        async with edge_with(settings, sim.url) as edge:
            guard = edge.wiring.admission.guard
            assert guard is not None
            assert await statuses(edge, 2) == [200, 200]
            pauser = redis.Redis(port=own_redis.port)
            # the pause ends by itself (CLIENT UNPAUSE would wait behind it too)
            pauser.execute_command("CLIENT", "PAUSE", "8000", "ALL")
            try:
                loop = asyncio.get_running_loop()
                start = loop.time()
                # local buckets at a quarter of the quota: 10 of the burst of 40
                assert await statuses(edge, 12) == [200] * 10 + [429] * 2
                assert guard.state in ("open", "half_open")
                # at most `failures_to_open` requests waited for Redis, each at most its deadline
                assert loop.time() - start < 3 * 1.0 + 10.0
            finally:
                pauser.close()
            await wait_until(lambda: guard.state == "closed", timeout=20)
            # back on the shared bucket: 38 left, less any take that timed out here but that
            # Redis applied when the pause ended (a deadline cannot tell which happened)
            codes = await statuses(edge, 40)
            assert codes[:35] == [200] * 35 and codes[-2:] == [429, 429]
            assert codes == sorted(codes)
