"""A request the edge refuses before any backend has it (503: the admission queue full or past
its deadline, no backend a candidate) gives its tenant back what its admission took: the edge's
own overload does not spend the tenant's quota, so its retry is not told it is over it."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from backends.registry import Backend
from edge.admission.settings import AdmissionSettings, RedisSettings, ThrottleSettings
from edge.admission.stage import Admission
from edge.exchange import Exchange, RequestHeaders
from edge.stages.validate import COMPLETIONS
from edge.stages.view import build_view
from edge.telemetry import Metrics
from tests.edge.admission.test_app_admission import bearer, tenant
from tests.edge.conftest import TinyUpstream, client, fast_config, held_sse, run_edge
from tests.helpers import wait_until

BODY = {"model": "tiny-model", "prompt": "Hello there", "stream": True}
REDIS = {"timeout_ms": 1000.0, "slow_ms": 500.0}


def one(**limits: float) -> AdmissionSettings:
    """`one`: a burst of one request that does not refill within a test, 1000 tokens a minute."""
    return AdmissionSettings(
        tenants=[
            tenant(
                "one",
                "silver",
                "sk-one",
                requests_per_second=0.0001,
                burst=1,
                tokens_per_minute=1000,
            )
        ],  # fmt: skip
        **limits,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_request_the_queue_refuses_is_not_charged(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    release = asyncio.Event()
    async with TinyUpstream(held_sse(release)) as up:
        config = fast_config([up.url], loads_interval=60.0)
        redis = (
            RedisSettings(url=redis_url, prefix=redis_prefix, **REDIS)
            if store == "redis"
            else RedisSettings()
        )  # type: ignore[arg-type]
        config.admission = one(
            redis=redis,
            throttle=ThrottleSettings(
                max_queue_depth=1, depth="in_flight", queue_timeout_s=0.3, recheck_s=0.02
            ),
        )
        async with run_edge(config) as edge, client(edge) as http:
            backend = edge.wiring.registry.backends[0]
            running = asyncio.ensure_future(http.post("/v1/completions", json=BODY))  # anonymous
            await wait_until(lambda: backend.in_flight == 1)
            refused = await http.post("/v1/completions", json=BODY, headers=bearer("sk-one"))
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
            release.set()
            assert (await running).status_code == 200
            again = await http.post("/v1/completions", json=BODY, headers=bearer("sk-one"))
            assert again.status_code == 200, again.text
            assert again.headers["x-ratelimit-remaining-requests"] == "0"
            view = await edge.wiring.admission.tenant("one")
            assert view is not None
            # only the answered request's prompt and completion are gone, not the refused one's
            spent = 1000 - view["buckets"]["tokens"]["remaining"]
            assert 0 < spent < 20, view
            later = await http.post("/v1/completions", json=BODY, headers=bearer("sk-one"))
            assert later.status_code == 429  # the burst of one is spent, once


async def test_a_request_no_backend_can_take_is_not_charged() -> None:
    config = fast_config(["http://127.0.0.1:9"])  # nothing listens there
    config.admission = one()
    async with run_edge(config) as edge, client(edge) as http:
        backend = edge.wiring.registry.backends[0]
        await wait_until(lambda: not backend.healthy)
        for _ in range(3):
            r = await http.post("/v1/completions", json=BODY, headers=bearer("sk-one"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend"
        view = await edge.wiring.admission.tenant("one")
        assert view is not None
        assert view["buckets"]["requests"]["remaining"] == 1
        assert view["buckets"]["tokens"]["remaining"] == 1000


def exchange(view_body: dict[str, object]) -> Exchange:
    ex = Exchange(
        route=COMPLETIONS, t0=0.0, transport="h1", early_data=False, handshake_wait=0.0,
        request_id="r", headers=RequestHeaders(), trace=None, tenant="one", tier="silver",
        tier_rank=1,
    )  # fmt: skip
    ex.view = build_view(COMPLETIONS, view_body, None)
    return ex


async def test_a_refund_is_given_once_and_only_for_what_was_taken() -> None:
    unlimited = AdmissionSettings(tenants=[tenant("one", "silver", "sk-one")])
    admission = Admission(unlimited, metrics=Metrics(CollectorRegistry()))
    before = exchange({"prompt": [1, 2, 3]})
    await admission.admit(before, admission.identify(b"Bearer sk-one"))  # nothing taken
    limited = AdmissionSettings(
        tenants=[
            tenant(
                "one",
                "silver",
                "sk-one",
                requests_per_second=0.0001,
                burst=3,
                tokens_per_minute=100,
            )
        ],  # fmt: skip
    )
    admission.set_tenants(limited)
    taken = [exchange({"prompt": [1, 2, 3]}) for _ in range(2)]
    for ex in taken:
        await admission.admit(ex, admission.identify(b"Bearer sk-one"))

    async def levels() -> tuple[int, int]:
        view = await admission.tenant("one")
        assert view is not None
        buckets = view["buckets"]
        return buckets["requests"]["remaining"], buckets["tokens"]["remaining"]

    assert await levels() == (1, 94)
    assert await admission.place(before, lambda: []) == []  # admitted unlimited: no refund
    assert await levels() == (1, 94)
    for _ in range(2):  # the caller's 503 is one; a second look gives nothing back again
        assert await admission.place(taken[0], lambda: []) == []
    assert await levels() == (2, 97)
    taken[1].backend = Backend(name="b", url="http://b:1")  # a backend had it: it is spent
    assert await admission.place(taken[1], lambda: []) == []
    assert await levels() == (2, 97)
