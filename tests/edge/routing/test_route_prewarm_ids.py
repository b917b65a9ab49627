"""Pre-warming a prefix that clients send as token ids (`/generate`'s `input_ids`, a completions
prompt of ids): the edge in front of real stand-ins, a real restart."""

from __future__ import annotations

import random
import time
from typing import Any

import httpx

from backends.sim import SimServer
from edge.routing.prewarm import PrewarmConfig
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.routing.test_prewarm import name, prewarm_state, sim_config, sims
from tests.helpers import wait_until


async def generate_ids(http: httpx.AsyncClient, ids: list[int]) -> tuple[str, dict[str, Any]]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.headers["x-quicedge-backend"], response.json()["meta_info"]


async def test_a_token_id_prefix_is_warmed_as_token_ids() -> None:
    rng = random.Random(11)
    system = [rng.randrange(1000, 30000) for _ in range(700)]  # several 1 KiB blocks as text

    def fresh() -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(20)]

    async with sims(sim_config("b0"), sim_config("b1")) as servers:
        config = fast_config([s.url for s in servers], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, deadline=60.0, restart_check_interval=None,
                                half_life=3600.0)  # fmt: skip
        async with run_edge(config, prewarm=prewarm) as edge, client(edge) as http:
            for _ in range(4):
                await generate_ids(http, system + fresh())
            registry = edge.wiring.registry
            b0, b1 = registry.get(name(servers[0])), registry.get(name(servers[1]))
            assert b0 is not None and b1 is not None
            warm = name(servers[1])
            await servers[1].stop()
            await wait_until(lambda: not b1.healthy)
            restarted = SimServer(sim_config("b1", port=servers[1].port))
            await restarted.start()
            try:
                await wait_until(lambda: prewarm_state(edge)[warm]["warmups"] >= 1)
                await wait_until(lambda: prewarm_state(edge)[warm]["state"] == "ready")
                assert prewarm_state(edge)[warm]["requests"].get("ok", 0) >= 1
                # With b0 out, the hot prefix's next request goes to b1: the warm-up must have
                # cached those token ids there, not the digits of their routing text.
                b0.ejected_until = time.monotonic() + 60
                chosen, meta = await generate_ids(http, system + fresh())
                assert chosen == warm
                assert meta["cached_tokens"] > 0.6 * meta["prompt_tokens"], meta
            finally:
                await restarted.stop()
