"""The admission queue under overload, through the app against a one-slot stand-in: tenants of
one tier share it fairly, whatever one of them sends."""

from __future__ import annotations

import asyncio

import httpx

from backends.sim import SimServer
from edge.admission.settings import AdmissionSettings, AnonymousSettings, ThrottleSettings
from tests.edge.admission.test_app_admission import bearer, tenant
from tests.edge.admission.test_queue_app import chat, slow_sim
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    held_sse,
    run_edge,
)
from tests.edge.test_app_sim import metrics_text
from tests.helpers import wait_until


async def test_one_tenant_flooding_its_tier_does_not_shut_another_of_the_tier_out() -> None:
    """Tenant `flood` keeps the queue full; tenant `calm`, of the same tier, still gets a place
    (the flooder's last waiter gives it up) and goes before the flooder's later waiters."""
    async with SimServer(slow_sim("b1")) as sim:
        config = fast_config([sim.url], loads_interval=60.0)
        config.admission = AdmissionSettings(
            anonymous=AnonymousSettings(tier="bronze"),
            throttle=ThrottleSettings(
                max_queue_depth=1, depth="in_flight", queue_size=3, queue_timeout_s=60.0
            ),
            tenants=[
                tenant("flood", "silver", "sk-flood"),
                tenant("calm", "silver", "sk-calm"),
            ],
        )
        async with run_edge(config) as edge, client(edge) as http:
            queue = edge.wiring.admission.queue
            backend = edge.wiring.registry.backends[0]
            assert queue is not None
            done: list[str] = []

            async def send(name: str, key: str, tokens: int) -> httpx.Response:
                body = chat(tokens, stream=True)
                r = await http.post("/v1/chat/completions", json=body, headers=bearer(key))
                done.append(name)
                return r

            long = asyncio.ensure_future(send("flood-0", "sk-flood", 250))
            await wait_until(lambda: backend.in_flight == 1)
            tasks = []
            for i in range(1, 4):  # the queue's three places, all the flooder's
                tasks.append(asyncio.ensure_future(send(f"flood-{i}", "sk-flood", 3)))
                await wait_until(lambda n=i: queue.waiting == n)  # type: ignore[misc]
            calm = asyncio.ensure_future(send("calm", "sk-calm", 3))
            await wait_until(lambda: "flood-3" in done or "calm" in done)
            assert not long.done(), "the long request must outlast the queueing"
            answers = await asyncio.gather(long, *tasks, calm)
            codes = [a.status_code for a in answers]
            assert codes == [200, 200, 200, 503, 200]  # flood-3 gave its place to calm
            assert answers[3].json()["error"]["code"] == "overloaded"
            assert done == ["flood-3", "flood-0", "flood-1", "calm", "flood-2"]


async def test_a_waiter_whose_backends_all_go_down_is_counted_refused_not_placed() -> None:
    """A request waiting in the queue when its only backend goes down gets the 503
    `no_healthy_backend`; its wait is `outcome="refused"` in
    `quicedge_admission_queue_wait_seconds`, not `placed`: no backend took it."""
    release = asyncio.Event()
    healthy = True
    held = held_sse(release)

    async def answer(recorded: Recorded) -> Reply:
        if recorded.path == "/health" and not healthy:
            return Reply(status=503, chunked=False)
        return await held(recorded)  # type: ignore[misc]

    async with TinyUpstream(answer) as up:
        config = fast_config([up.url], loads_interval=60.0)
        config.admission = AdmissionSettings(
            throttle=ThrottleSettings(
                max_queue_depth=1, depth="in_flight", queue_timeout_s=30.0, recheck_s=0.02
            )
        )
        body = {"model": "tiny-model", "prompt": "Hello", "stream": True}
        async with run_edge(config) as edge, client(edge) as http:
            queue = edge.wiring.admission.queue
            backend = edge.wiring.registry.backends[0]
            assert queue is not None
            running = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await wait_until(lambda: backend.in_flight == 1)
            waiting = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await wait_until(lambda: queue.waiting == 1)
            healthy = False
            r = await waiting
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "no_healthy_backend"
            release.set()
            await running
            text = await metrics_text(edge)
            counts = {
                line.split("{")[1].split("}")[0]: float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("quicedge_admission_queue_wait_seconds_count")
            }
            assert counts == {'outcome="refused",tier="bronze"': 1.0}
