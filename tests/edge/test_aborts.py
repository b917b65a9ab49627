"""The abort queue is bounded: `/abort_request` calls past `max_pending_aborts` are dropped and
counted, against a real (scripted) upstream that holds the aborts it receives."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from edge.wiring import build
from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, health_ok
from tests.helpers import wait_until


async def test_aborts_past_the_cap_are_dropped_and_counted() -> None:
    release = asyncio.Event()

    async def answer(recorded: Recorded) -> Reply:
        if recorded.path == "/abort_request":
            await release.wait()
            return Reply(status=200, chunked=False)
        return health_ok(recorded) or Reply(status=404, chunked=False)

    async with TinyUpstream(answer) as up:
        registry = CollectorRegistry()
        wiring = await build(fast_config([up.url], max_pending_aborts=2), registry=registry)
        try:
            backend = wiring.registry.backends[0]
            for i in range(5):
                wiring.abort(backend, f"rid-{i}")

            def count(outcome: str) -> float:
                value = registry.get_sample_value(
                    "quicedge_abort_requests_total", {"outcome": outcome}
                )
                return value or 0.0

            assert count("dropped") == 3
            # the two admitted reach the backend (its one client sends them in turn)
            await wait_until(lambda: any(r.path == "/abort_request" for r in up.requests))
            release.set()
            await wait_until(lambda: count("sent") == 2)
            assert (
                sorted(r.path for r in up.requests if r.path == "/abort_request")
                == ["/abort_request"] * 2
            )
            wiring.abort(backend, "rid-after")  # room again
            await wait_until(lambda: count("sent") == 3)
        finally:
            await wiring.aclose()
