"""A client that goes away while its request waits in the admission queue frees its place at
once, and that request is not sent to a backend afterwards."""

from __future__ import annotations

import asyncio

from edge.admission.settings import AdmissionSettings, ThrottleSettings
from tests.edge.conftest import LISTENERS, TinyUpstream, client, fast_config, held_sse, run_edge
from tests.helpers import wait_until


@LISTENERS
async def test_a_client_gone_while_queued_frees_its_place(listener: str) -> None:
    release = asyncio.Event()
    async with TinyUpstream(held_sse(release)) as up:
        config = fast_config([up.url], loads_interval=60.0)
        config.admission = AdmissionSettings(
            throttle=ThrottleSettings(
                max_queue_depth=1, depth="in_flight", queue_timeout_s=30.0, recheck_s=0.02
            )
        )
        body = {"model": "tiny-model", "prompt": "Hello", "stream": True}
        async with run_edge(config, listener=listener) as edge, client(edge) as http:
            queue = edge.wiring.admission.queue
            backend = edge.wiring.registry.backends[0]
            assert queue is not None
            running = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await wait_until(lambda: backend.in_flight == 1)
            async with client(edge) as other:
                gone = asyncio.ensure_future(other.post("/v1/completions", json=body))
                await wait_until(lambda: queue.waiting == 1)
                gone.cancel()
            await wait_until(lambda: queue.waiting == 0, timeout=5)
            sent = len([r for r in up.requests if r.path == "/v1/completions"])
            release.set()
            assert (await running).status_code == 200
            assert sent == 1
