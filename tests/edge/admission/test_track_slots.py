"""A tenant's `max_concurrent` slots come back on every way a request ends: an upstream error,
an answer cut mid-stream, a client gone mid-stream or while queued, the queue's deadline."""

from __future__ import annotations

import asyncio
import json

from edge.admission.settings import AdmissionSettings, ThrottleSettings
from tests.edge.admission.test_app_admission import bearer, tenant
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
    sse_reply,
)
from tests.helpers import wait_until


async def test_slots_come_back_on_every_way_a_request_ends() -> None:
    release = asyncio.Event()

    async def answer(recorded: Recorded) -> Reply:
        reply = health_ok(recorded)
        if reply is not None:
            return reply
        prompt = json.loads(recorded.body)["prompt"]
        if prompt == "fail":
            return Reply(status=500, chunked=False)
        if prompt == "die":
            return Reply(
                headers=[("content-type", "text/event-stream")],
                chunks=[b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'] * 3,
                die_after=1,
            )
        await release.wait()
        return sse_reply(("ok",))

    async with TinyUpstream(answer) as up:
        config = fast_config([up.url], loads_interval=60.0, max_retries=0)
        config.admission = AdmissionSettings(
            throttle=ThrottleSettings(
                max_queue_depth=1, depth="in_flight", queue_timeout_s=0.3, recheck_s=0.02
            ),
            tenants=[tenant("t", "silver", "sk-t", max_concurrent=1)],
        )
        async with run_edge(config) as edge, client(edge) as http:
            admission = edge.wiring.admission
            queue = admission.queue
            backend = edge.wiring.registry.backends[0]
            assert queue is not None
            key = bearer("sk-t")

            def body(prompt: str) -> dict[str, object]:
                return {"model": "tiny-model", "prompt": prompt, "stream": True}

            async def free() -> None:
                await wait_until(lambda: admission.tenants()["tenants"][0]["in_flight"] == 0)

            r = await http.post("/v1/completions", json=body("fail"), headers=key)
            assert r.status_code >= 500
            await free()
            r = await http.post("/v1/completions", json=body("die"), headers=key)
            await free()
            # the client goes away mid-stream
            async with client(edge) as other:
                gone = asyncio.ensure_future(
                    other.post("/v1/completions", json=body("hold"), headers=key)
                )
                await wait_until(lambda: backend.in_flight == 1)
                gone.cancel()
            await free()
            await wait_until(lambda: backend.in_flight == 0)
            # the backend full (the anonymous tenant's request), the tenant's waits: deadline
            running = asyncio.ensure_future(http.post("/v1/completions", json=body("hold")))
            await wait_until(lambda: backend.in_flight == 1)
            r = await http.post("/v1/completions", json=body("hold"), headers=key)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
            await free()
            # and its client gone while it waits
            async with client(edge) as other:
                gone = asyncio.ensure_future(
                    other.post("/v1/completions", json=body("hold"), headers=key)
                )
                await wait_until(lambda: queue.waiting == 1)
                gone.cancel()
            await wait_until(lambda: queue.waiting == 0)
            await free()
            release.set()
            assert (await running).status_code == 200
            r = await http.post("/v1/completions", json=body("hold"), headers=key)
            assert r.status_code == 200
