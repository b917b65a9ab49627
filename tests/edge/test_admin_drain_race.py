"""A backend that leaves the fleet (a reload, discovery) while its shared drain waits for Redis:
the drain's answer says so, rather than a 500 (`next()` of an empty snapshot raised
StopIteration inside the action's coroutine). Real Redis behind a relay that makes its answers
late, the edge in-process."""

from __future__ import annotations

import asyncio

import httpx

from backends.sim import SimServer
from tests.edge.conftest import fast_config, run_edge
from tests.edge.silent_relay import SilentRelay
from tests.edge.test_app_sim import sim_config
from tests.helpers import wait_until


async def test_a_backend_removed_while_its_drain_waits_is_a_404_not_a_500(
    redis_url: str, redis_prefix: str
) -> None:
    async with (
        SimServer(sim_config("s1")) as s1,
        SimServer(sim_config("s2")) as s2,
        SilentRelay(redis_url) as relay,
    ):
        config = fast_config([s1.url, s2.url], share_drains=True, drains_interval=3600.0,
                             drains_key=redis_prefix + "drains")  # fmt: skip
        name = s1.url.partition("//")[2]
        async with run_edge(config, redis_url=relay.url) as edge, httpx.AsyncClient() as http:
            relay.slow_after, relay.reply_delay = (b"MULTI",), 0.8  # the write's answer is late
            drain = asyncio.ensure_future(
                http.post(f"{edge.admin_url}/backends/{name}/drain", timeout=10)
            )
            await wait_until(lambda: bool(relay._slow))  # the write is out, its answer late
            await edge.wiring.registry.remove(name, drain_timeout=0.0)  # a reload took it out
            answer = await drain
            assert answer.status_code == 404, answer.text
            assert "left the fleet" in answer.json()["error"]["message"]
            # The admin port still answers, and the other backend is there.
            listed = (await http.get(f"{edge.admin_url}/backends")).json()["backends"]
            assert [b["name"] for b in listed] == [s2.url.partition("//")[2]]
