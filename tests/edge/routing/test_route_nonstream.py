"""A non-streamed request shows no first token, so its prefill must not stay charged to its
backend's queue until its whole answer: from the time the `ttft` policy predicted for its first
token it is decoding, and the next requests for the prefix that backend holds go there, where
the cache is, rather than away from a queue that is not there. Stand-ins paced as an H100."""

from __future__ import annotations

import asyncio
import random

from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.routing.test_prewarm import sim_config, sims, words
from tests.helpers import wait_until


async def test_a_non_streamed_request_that_is_decoding_is_no_queued_prefill() -> None:
    rng = random.Random(31)
    hot = words(rng, 1500)
    profile = "h100-llama3-8b"
    async with sims(sim_config("b0", profile=profile), sim_config("b1", profile=profile)) as sims_:
        config = fast_config([s.url for s in sims_], policy="ttft")
        async with run_edge(config) as edge, client(edge) as http:
            first = await http.post("/generate", json={"text": hot + words(rng, 20),
                                    "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
            home = first.headers["x-quicedge-backend"]
            backend = edge.wiring.registry.get(home)
            assert backend is not None
            long = asyncio.create_task(http.post("/generate", json={
                "text": hot + words(rng, 6000),
                "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}))  # fmt: skip
            await wait_until(lambda: backend.in_flight == 1)
            # decoding by its predicted first token: its prefill leaves the queue then
            await wait_until(lambda: backend.in_flight_prefill_tokens == 0, timeout=5)
            assert not long.done() and backend.in_flight == 1
            again = await http.post("/generate", json={"text": hot + words(rng, 20),
                                    "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
            assert again.headers["x-quicedge-backend"] == home  # where the prefix is cached
            assert (await long).status_code == 200
