"""The admission queue orders requests that want the same backends: a request whose backends
have room is not held behind a waiter that cannot use them (another tier's backends, another
model's pool, a retry's untried ones). The backends a waiter wants are its own to take first;
a request after it may take only the others."""

from __future__ import annotations

import asyncio

from backends.registry import Backend
from edge.admission.settings import AdmissionSettings, AnonymousSettings, ThrottleSettings
from edge.admission.throttle import AdmissionQueue, Throttle
from edge.routing.breakers import BreakerConfig
from tests.edge.admission.test_app_admission import bearer, tenant
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    held_sse,
    run_edge,
    sse_reply,
)
from tests.helpers import wait_until


def settings(**values: float) -> ThrottleSettings:
    base = {"max_queue_depth": 1, "queue_size": 8, "queue_timeout_s": 2.0, "recheck_s": 5.0}
    base.update(values)
    return ThrottleSettings(**base)  # type: ignore[arg-type]


async def test_a_request_for_free_backends_passes_a_waiter_for_full_ones() -> None:
    full = Backend(name="a", url="http://a:1", in_prefill=1)  # depth 1 of 1
    free = Backend(name="b", url="http://b:1")
    queue = AdmissionQueue(settings(), Throttle(settings()))
    order: list[str] = []

    async def on_full(name: str) -> list[Backend]:
        placed = await queue.place(0, "gold", lambda: [full])
        full.in_prefill += 1  # it takes the room it was given
        order.append(name)
        return placed

    waiting = asyncio.ensure_future(on_full("first"))
    await wait_until(lambda: queue.waiting == 1)
    # same tier, a lower one: neither may use `full`, and `free` has room
    assert await queue.place(0, "gold", lambda: [free]) == [free]
    assert await queue.place(2, "bronze", lambda: [free]) == [free]
    assert queue.waiting == 1 and not waiting.done()
    # one that wants `full` and `free` takes `free`, which the gold waiter does not want
    assert await queue.place(2, "bronze", lambda: [full, free]) == [free]
    # one that wants `full` only waits behind the gold waiter, and leaves after it
    later = asyncio.ensure_future(on_full("later"))
    await wait_until(lambda: queue.waiting == 2)
    for _ in range(2):
        full.in_prefill = 0  # a request on `full` ended
        queue.wake()
        await wait_until(lambda n=len(order): len(order) > n)  # type: ignore[misc]
    assert await waiting == [full] and await later == [full]
    assert order == ["first", "later"] and queue.waiting == 0


async def test_a_waiter_behind_another_pool_is_woken_when_its_own_room_frees() -> None:
    a = Backend(name="a", url="http://a:1", in_prefill=1)
    b = Backend(name="b", url="http://b:1", in_prefill=1)
    queue = AdmissionQueue(settings(), Throttle(settings()))
    first = asyncio.ensure_future(queue.place(0, "gold", lambda: [a]))
    await wait_until(lambda: queue.waiting == 1)
    second = asyncio.ensure_future(queue.place(1, "silver", lambda: [b]))
    await wait_until(lambda: queue.waiting == 2)
    b.in_prefill = 0
    queue.wake()  # a request on `b` ended: the silver waiter goes, the gold one still waits
    assert await second == [b]
    assert not first.done() and queue.waiting == 1
    first.cancel()


async def test_bronze_on_its_own_backends_is_not_held_by_gold_waiting_for_its_own() -> None:
    """Backends split by tier (`#tiers=`), the throttle on: gold's backend is full and a gold
    request waits for it; a bronze request, whose backend is idle, is served meanwhile."""
    release = asyncio.Event()

    def quick(recorded: Recorded) -> Reply:
        return health_ok(recorded) or sse_reply(["ok"])

    async with TinyUpstream(held_sse(release)) as gold, TinyUpstream(quick) as rest:
        config = fast_config(
            [gold.url + "#tiers=gold", rest.url + "#tiers=silver+bronze"], loads_interval=60.0
        )
        config.admission = AdmissionSettings(
            anonymous=AnonymousSettings(tier="bronze"),
            throttle=ThrottleSettings(
                max_queue_depth=1, depth="in_flight", queue_timeout_s=2.0, recheck_s=0.02
            ),
            tenants=[tenant("vip", "gold", "sk-vip")],
        )
        body = {"model": "tiny-model", "prompt": "Hello", "stream": True}
        # the breakers keep each tier on its backends (the tests' edges run without them)
        async with run_edge(config, breakers=BreakerConfig()) as edge, client(edge) as http:
            queue = edge.wiring.admission.queue
            backend = edge.wiring.registry.backends[0]
            assert queue is not None

            def gold_request() -> asyncio.Future[object]:
                post = http.post("/v1/completions", json=body, headers=bearer("sk-vip"))
                return asyncio.ensure_future(post)

            running = gold_request()
            await wait_until(lambda: backend.in_flight == 1)
            queued = gold_request()
            await wait_until(lambda: queue.waiting == 1)
            r = await http.post("/v1/completions", json=body)  # anonymous: bronze
            assert r.status_code == 200, r.text
            assert queue.waiting == 1 and not queued.done()
            release.set()
            for done in await asyncio.gather(running, queued):
                assert done.status_code == 200  # type: ignore[attr-defined]
