"""A backend that restarts (and so lost its prefix cache) while its health checks mark it down,
with pre-warming and KV events off: the `ttft` tree must not go on believing it holds what it
held before. The edge in front of real stand-ins; the restart is a real one."""

from __future__ import annotations

import random
from typing import Any

import httpx

from backends.sim import SimServer
from edge.routing.ttft import TTFTPolicy
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.routing.test_prewarm import sim_config, sims, words
from tests.helpers import wait_until


async def generate(http: httpx.AsyncClient, text: str) -> tuple[str, dict[str, Any]]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.headers["x-quicedge-backend"], response.json()["meta_info"]


async def test_a_backend_back_from_failed_checks_is_believed_to_hold_nothing() -> None:
    rng = random.Random(21)
    system = words(rng, 600)
    async with sims(sim_config("b0"), sim_config("b1")) as servers:
        config = fast_config([s.url for s in servers], policy="ttft")
        async with run_edge(config) as edge, client(edge) as http:
            chosen, _ = await generate(http, system + words(rng, 20))
            _, meta = await generate(http, system + words(rng, 20))
            assert meta["cached_tokens"] > 0  # the prefix lives where the first one went
            policy = edge.wiring.policy
            assert isinstance(policy, TTFTPolicy)
            index = 0 if chosen.endswith(f":{servers[0].port}") else 1
            home = servers[index]
            backend = edge.wiring.registry.get(chosen)
            assert backend is not None
            assert policy.tree.match(system).chars.get(backend.url, 0) > 0
            await home.stop()
            await wait_until(lambda: not backend.healthy)
            restarted = SimServer(sim_config(home.config.name, port=home.port))
            await restarted.start()
            try:
                await wait_until(lambda: backend.healthy)
                # a new process, an empty cache: the tree must say so, not route the prefix
                # there as cached (then trim it, and shrink that backend's estimated cache)
                assert policy.tree.match(system).chars.get(backend.url, 0) == 0
                assert policy.tree.tenant_chars(backend.url) == 0
            finally:
                await restarted.stop()
