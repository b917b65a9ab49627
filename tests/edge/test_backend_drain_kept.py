"""An operator's drain outlives its backend's absence: discovery (or a reload) that takes a
drained backend out and brings it back, as a pod restarted during its upgrade is, brings it
back drained, with or without `share_drains`, until `/undrain`. The edge in-process in front
of two stand-ins; the membership changes are the registry calls discovery makes."""

from __future__ import annotations

import httpx
import pytest

from backends.sim import SimServer
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.test_app_sim import sim_config

CHAT = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("shared", [False, True], ids=["local", "share_drains"])
async def test_a_drained_backend_that_leaves_and_returns_is_still_drained(
    shared: bool, redis_url: str, redis_prefix: str
) -> None:
    async with SimServer(sim_config("s1")) as s1, SimServer(sim_config("s2")) as s2:
        extra = {}
        if shared:  # a poll far away: what the edge holds at once must already be right
            extra = {"share_drains": True, "drains_interval": 3600.0,
                     "drains_key": redis_prefix + "drains"}  # fmt: skip
        config = fast_config([s1.url, s2.url], expose_backend_names=True,
                             policy="round_robin", **extra)  # fmt: skip
        name = s1.url.partition("//")[2]
        async with (
            run_edge(config, redis_url=redis_url if shared else None) as edge,
            client(edge) as proxy,
            httpx.AsyncClient() as admin,
        ):
            drained = await admin.post(f"{edge.admin_url}/backends/{name}/drain")
            assert drained.status_code == 200, drained.text
            registry = edge.wiring.registry
            await registry.remove(name, drain_timeout=0.0)  # its pod went away...
            registry.add(s1.url)  # ... and came back
            listed = (await admin.get(f"{edge.admin_url}/backends")).json()["backends"]
            assert {b["name"]: b["held"] for b in listed}[name] is True
            for _ in range(6):
                r = await proxy.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200 and r.headers["x-quicedge-backend"] != name
            undrained = await admin.post(f"{edge.admin_url}/backends/{name}/undrain")
            assert undrained.status_code == 200 and undrained.json()["held"] is False
