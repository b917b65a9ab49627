"""A domain's KV usage is that of its own backends: those of its model and hardware group that
serve its tier. Backends kept for another tier (`#tiers=`) in the same hardware group neither
hide a full domain nor make a free one look full. The real edge, scripted upstreams answering
`/v1/loads` over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import httpx

from edge.models.config import ModelsConfig
from edge.routing.breakers import BreakerConfig
from tests.edge.conftest import (
    Edge,
    Recorded,
    Reply,
    TinyUpstream,
    fast_config,
    health_ok,
    run_edge,
)
from tests.helpers import wait_until


def loaded(used: int) -> Callable[[Recorded], Reply]:
    """A healthy upstream whose `/v1/loads` says `used` of its 100,000 KV tokens are taken."""

    def answer(recorded: Recorded) -> Reply:
        if recorded.path == "/v1/loads":
            rank = {"num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": used,
                    "max_total_num_tokens": 100_000}  # fmt: skip
            return Reply(chunks=[json.dumps({"loads": [rank]}).encode()], chunked=False,
                         headers=[("content-type", "application/json")])  # fmt: skip
        return health_ok(recorded) or Reply(status=404, chunked=False)

    return answer


async def domains(edge: Edge) -> dict[str, dict[str, Any]]:
    async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
        body = (await admin.get("/backends")).json()
    return {d["tier"]: d for d in body["breakers"]}


async def test_a_tiers_kv_usage_is_its_own_backends_not_the_hardware_groups() -> None:
    breakers = BreakerConfig(kv_warn=0.6, kv_open=0.85, kv_interval=0.05, open_for=60.0)
    async with TinyUpstream(loaded(95_000)) as gold, TinyUpstream(loaded(10_000)) as bronze:
        config = fast_config([f"{gold.url}#hardware=h&tiers=gold",
                              f"{bronze.url}#hardware=h&tiers=bronze"])  # fmt: skip
        async with run_edge(config, breakers=breakers) as edge:
            await wait_until(lambda: all(b.load is not None for b in edge.wiring.registry.backends))
            assert edge.wiring.breakers is not None
            edge.wiring.breakers.update_kv()  # what the KV poll does, once more on these loads
            by_tier = await domains(edge)
            assert sorted(by_tier) == ["bronze", "gold"]
            assert by_tier["gold"]["kv_usage"] == 0.95
            assert by_tier["gold"]["state"] == "open"  # gold's only backend is full: shed
            assert by_tier["bronze"]["kv_usage"] == 0.1
            assert by_tier["bronze"]["state"] == "closed"
            assert by_tier["bronze"]["health"] == "healthy"


async def test_backends_slow_to_tell_their_model_do_not_hold_up_the_kv_signal() -> None:
    """`learn_model`: four backends take their time over `/get_model_info` (up to the ask's
    4 s each). The KV poll goes on meanwhile: the full domain beside them is shed at once, not
    after the sixteen seconds of asking them one by one."""
    held = asyncio.Event()

    async def slow(recorded: Recorded) -> Reply:
        if recorded.path == "/get_model_info":
            await held.wait()
        return health_ok(recorded) or Reply(status=404, chunked=False)

    breakers = BreakerConfig(kv_open=0.85, kv_interval=1.0, open_for=60.0, learn_model=True)
    async with contextlib.AsyncExitStack() as stack:
        slow_ones = [await stack.enter_async_context(TinyUpstream(slow)) for _ in range(4)]
        full = await stack.enter_async_context(TinyUpstream(loaded(95_000)))
        urls = [f"{up.url}#hardware=slow" for up in slow_ones]
        config = fast_config([*urls, f"{full.url}#model=m&hardware=full"], health_timeout=10.0)
        edge = await stack.enter_async_context(
            run_edge(config, breakers=breakers, models=ModelsConfig(discover=False))
        )
        stack.callback(held.set)  # the asks end before the upstreams close

        def shed() -> bool:
            labels = {"model": "m", "tier": "bronze", "hardware": "full"}
            return edge.registry.get_sample_value("quicedge_breaker_state", labels) == 2

        await wait_until(shed, timeout=8.0)
