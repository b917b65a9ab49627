"""The admission queue under overload, through the app against a scripted backend held at one
request: tenants of one tier share it fairly, whatever one of them sends; its metric."""

from __future__ import annotations

import asyncio
import json

import httpx

from edge.admission.settings import AdmissionSettings, ThrottleSettings
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
from tests.edge.test_app_sim import metrics_text
from tests.helpers import wait_until


async def test_one_tenant_flooding_its_tier_does_not_shut_another_of_the_tier_out() -> None:
    """Tenant `flood` keeps the queue full; tenant `calm`, of the same tier, still gets a place
    (the flooder's last waiter gives it up) and goes before the flooder's later waiters."""
    release = asyncio.Event()

    async def answer(recorded: Recorded) -> Reply:
        reply = health_ok(recorded)
        if reply is not None:
            return reply
        if json.loads(recorded.body)["prompt"] == "flood-0":
            await release.wait()
        return sse_reply(("ok",))

    async with TinyUpstream(answer) as up:
        config = fast_config([up.url], loads_interval=60.0)
        config.admission = AdmissionSettings(
            throttle=ThrottleSettings(
                max_queue_depth=1, depth="in_flight", queue_size=3, queue_timeout_s=30.0
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

            def send(prompt: str, key: str) -> asyncio.Future[httpx.Response]:
                body = {"model": "tiny-model", "prompt": prompt, "stream": True}
                return asyncio.ensure_future(
                    http.post("/v1/completions", json=body, headers=bearer(key))
                )

            first = send("flood-0", "sk-flood")
            await wait_until(lambda: backend.in_flight == 1)
            flood = []
            for i in range(1, 4):  # the queue's three places, all the flooder's
                flood.append(send(f"flood-{i}", "sk-flood"))
                await wait_until(lambda n=i: queue.waiting == n)  # type: ignore[misc]
            calm = send("calm", "sk-calm")
            await wait_until(lambda: calm.done() or flood[2].done())
            assert not calm.done()  # it waits: flood-3 gave its place to it
            last = flood[2].result()
            assert last.status_code == 503 and last.json()["error"]["code"] == "overloaded"
            assert queue.waiting == 3
            release.set()
            answers = await asyncio.gather(first, flood[0], flood[1], calm)
            assert [a.status_code for a in answers] == [200] * 4
            sent = [
                json.loads(r.body)["prompt"] for r in up.requests if r.path == "/v1/completions"
            ]
            assert sent == ["flood-0", "flood-1", "calm", "flood-2"]


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
