"""Refusals remembered for a tenant's requests bucket, and what the edge gives back."""

from __future__ import annotations

import asyncio

from edge.admission.settings import AdmissionSettings, ThrottleSettings
from tests.edge.admission.test_app_admission import bearer, tenant
from tests.edge.conftest import TinyUpstream, client, fast_config, held_sse, run_edge
from tests.helpers import wait_until


async def test_a_request_given_back_ends_the_refusal_remembered_for_its_tenant() -> None:
    """A tenant's request waits in the queue holding the last request of its bucket; another
    of its requests is refused (and the refusal remembered); the waiting one gets the queue's
    503 and gives its request back. The client retrying that 503 is served: the bucket holds a
    request again, and the edge does not refuse it from memory as over its rate limit."""
    release = asyncio.Event()
    async with TinyUpstream(held_sse(release)) as up:
        config = fast_config([up.url], loads_interval=60.0)
        config.admission = AdmissionSettings(
            throttle=ThrottleSettings(
                max_queue_depth=1, depth="in_flight", queue_timeout_s=0.3, recheck_s=0.02
            ),
            # one request per 100 s: no refill to speak of during the test
            tenants=[tenant("t", "silver", "sk-t", requests_per_second=0.01, burst=1)],
        )
        body = {"model": "tiny-model", "prompt": "Hello", "stream": True}
        key = bearer("sk-t")
        async with run_edge(config) as edge, client(edge) as http:
            queue = edge.wiring.admission.queue
            backend = edge.wiring.registry.backends[0]
            assert queue is not None
            running = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await wait_until(lambda: backend.in_flight == 1)
            waiting = asyncio.ensure_future(http.post("/v1/completions", json=body, headers=key))
            await wait_until(lambda: queue.waiting == 1)
            refused = await http.post("/v1/completions", json=body, headers=key)
            assert refused.status_code == 429  # the bucket's one request is the waiting one's
            overloaded = await waiting
            assert overloaded.status_code == 503
            assert overloaded.json()["error"]["code"] == "overloaded"
            release.set()
            assert (await running).status_code == 200
            await wait_until(lambda: backend.in_flight == 0)
            retried = await http.post("/v1/completions", json=body, headers=key)
            assert retried.status_code == 200, retried.text
