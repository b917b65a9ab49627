"""Mirrors in flight give way when the canary becomes overloaded: a rollout that pauses, a
canary that starts queueing, a breaker of its domain that opens. Each mirror is cancelled, its
upstream request closed and aborted by rid, and counted in `quicedge_shadow_cancelled_total`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from backends.sim import SimConfig, SimServer
from edge.models import ModelsConfig
from edge.models.config import BackendModel
from edge.routing.breakers import BreakerConfig
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.edge.models.test_pools_e2e import chat, sim, sims
from tests.edge.models.test_rollout_e2e import rollout
from tests.helpers import wait_until

LONG = {"natural_output_len": (400, 500)}
"""Answers of 400+ tokens: at the h100 profile slowed five times a mirror takes seconds."""


def slow_canary(**overrides: Any) -> SimConfig:
    return sim("m", model_version="v2", profile="h100-llama3-8b", time_scale=5.0, **LONG,
               **overrides)  # fmt: skip


def shadowed(**overrides: Any) -> ModelsConfig:
    values = {"steps": [1e-6], "shadow_fraction": 1.0, "shadow_rate": 1000,
              "shadow_timeout": 120, **overrides}  # fmt: skip
    return ModelsConfig(rollouts=[rollout(**values)])


def running(server: SimServer) -> int:
    assert server.scheduler is not None
    return len(server.scheduler.running)


def aborted(server: SimServer) -> int:
    assert server.scheduler is not None
    return server.scheduler.stats.num_aborted_requests_total


async def cancelled(admin_url: str, reason: str) -> float:
    async with httpx.AsyncClient() as admin:
        text = (await admin.get(admin_url + "/metrics")).text
    line = f'quicedge_shadow_cancelled_total{{model="m",reason="{reason}"}} '
    for row in text.splitlines():
        if row.startswith(line):
            return float(row[len(line) :])
    return 0.0


async def test_pausing_the_rollout_cancels_the_mirror_on_the_canary() -> None:
    async with sims(sim("m", model_version="v1", **LONG), slow_canary()) as (s1, s2):
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=shadowed()) as edge,
            client(edge) as http,
        ):
            shadow = edge.wiring.models.shadows["m"]
            r = await http.post("/v1/chat/completions", json={**chat("m"), "max_tokens": 450},
                                headers={"x-canary": "0"})  # fmt: skip
            assert r.status_code == 200
            await wait_until(lambda: running(s2) == 1, timeout=20)  # the mirror is generating
            async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
                assert (await admin.post("/rollouts/m/pause")).json()["state"] == "paused"
            await wait_until(lambda: not shadow._tasks, timeout=20)
            await wait_until(lambda: running(s2) == 0 and aborted(s2) == 1, timeout=20)
            assert await cancelled(edge.admin_url, "rollout") == 1.0
            assert shadow.compared == 0


async def test_restarting_the_rollout_cancels_the_old_mirror_and_a_new_one_is_taken() -> None:
    async with sims(sim("m", model_version="v1", **LONG), slow_canary()) as (s1, s2):
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=shadowed()) as edge,
            client(edge) as http,
        ):
            old = edge.wiring.models.shadows["m"]
            request = {**chat("m"), "max_tokens": 450}
            r = await http.post("/v1/chat/completions", json=request, headers={"x-canary": "0"})
            assert r.status_code == 200
            await wait_until(lambda: running(s2) == 1, timeout=20)
            async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
                assert (await admin.post("/rollouts/m/restart")).json()["state"] == "ramping"
            assert not old._tasks  # cancelled, and closed before the answer
            assert old._watcher is None or old._watcher.done()
            await wait_until(lambda: running(s2) == 0 and aborted(s2) == 1, timeout=20)
            assert await cancelled(edge.admin_url, "restart") == 1.0
            new = edge.wiring.models.shadows["m"]
            assert new is not old
            r = await http.post("/v1/chat/completions", json=request, headers={"x-canary": "0"})
            assert r.status_code == 200
            await wait_until(lambda: running(s2) == 1, timeout=20)  # the new shadow mirrors
            assert len(new._tasks) == 1


async def test_a_canary_that_starts_queueing_gets_its_mirror_back() -> None:
    """The canary runs one request at a time; a client of its own arrives while a mirror runs
    there, queues, and the mirror gives way to it."""
    async with sims(sim("m", model_version="v1", **LONG), slow_canary(max_running_requests=1)) as (
        s1,
        s2,
    ):
        async with (
            run_edge(fast_config([s1.url, s2.url]), models=shadowed()) as edge,
            client(edge) as http,
            httpx.AsyncClient(base_url=s2.url, timeout=60) as direct,
        ):
            shadow = edge.wiring.models.shadows["m"]
            r = await http.post("/v1/chat/completions", json={**chat("m"), "max_tokens": 450},
                                headers={"x-canary": "0"})  # fmt: skip
            assert r.status_code == 200
            await wait_until(lambda: running(s2) == 1, timeout=20)
            body = {"text": "a client of its own", "sampling_params": {"max_new_tokens": 2}}
            queued = asyncio.ensure_future(direct.post("/generate", json=body))
            try:
                await wait_until(lambda: not shadow._tasks, timeout=20)
                assert await cancelled(edge.admin_url, "queue") == 1.0
                answered = await asyncio.wait_for(queued, 60)  # served once the mirror left
                assert answered.status_code == 200
                assert aborted(s2) == 1 and shadow.compared == 0
            finally:
                queued.cancel()


async def test_an_open_breaker_on_the_canary_cancels_its_mirror_and_aborts_it() -> None:
    """The canary fails its clients (500) and holds the mirror; its breaker (domain m@v2) opens
    after five errors, and the mirror is cancelled and aborted by its rid."""
    hold = asyncio.Event()

    async def canary(recorded: Recorded) -> Reply:
        known = health_ok(recorded)
        if known is not None:
            return known
        if b"-shadow-c" in recorded.body:
            await hold.wait()  # the mirror: never answered while the test runs
        error = {"error": {"message": "boom", "type": "server_error", "code": 500}}
        return Reply(status=500, chunks=[json.dumps(error).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    async with sims(sim("m", model_version="v1")) as (s1,), TinyUpstream(canary) as bad:
        models = shadowed(steps=[50.0])
        models.backends = [BackendModel(bad.url, model="m", version="v2")]
        breakers = BreakerConfig(window=10, min_requests=5, open_for=60.0)
        config = fast_config([s1.url, bad.url], eject_after_failures=1000)
        try:
            async with run_edge(config, models=models, breakers=breakers) as edge, \
                    client(edge) as http:  # fmt: skip
                shadow = edge.wiring.models.shadows["m"]
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "0"})  # fmt: skip
                assert r.status_code == 200
                await wait_until(lambda: len(shadow._tasks) == 1, timeout=20)
                (mirror,) = shadow._tasks.values()
                await wait_until(
                    lambda: any(mirror.rid.encode() in q.body for q in bad.requests), timeout=20
                )
                assert edge.wiring.breakers is not None
                for _ in range(8):  # its clients' errors open the canary's breaker
                    if edge.wiring.breakers.state_of("m@v2", "bronze", "default") == "open":
                        break
                    await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "1"})  # fmt: skip
                assert edge.wiring.breakers.state_of("m@v2", "bronze", "default") == "open"
                await wait_until(lambda: not shadow._tasks, timeout=20)
                assert await cancelled(edge.admin_url, "breaker") == 1.0
                await wait_until(lambda: any(
                    q.path == "/abort_request" and json.loads(q.body).get("rid") == mirror.rid
                    for q in bad.requests
                ), timeout=20)  # fmt: skip
        finally:
            hold.set()


async def test_a_mirror_past_its_timeout_is_aborted_on_the_canary() -> None:
    """The canary never answers the mirror: at `shadow_timeout` the mirror gives up, is counted
    as an error, and its generation is aborted by rid (the canary may not notice the closed
    connection for seconds, and would generate for nobody meanwhile)."""
    hold = asyncio.Event()

    async def canary(recorded: Recorded) -> Reply:
        known = health_ok(recorded)
        if known is not None:
            return known
        await hold.wait()  # the mirror: never answered while the test runs
        return Reply(status=500, chunked=False)

    async with sims(sim("m", model_version="v1")) as (s1,), TinyUpstream(canary) as slow:
        models = shadowed(shadow_timeout=0.3)
        models.backends = [BackendModel(slow.url, model="m", version="v2")]
        try:
            async with (
                run_edge(fast_config([s1.url, slow.url]), models=models) as edge,
                client(edge) as http,
            ):
                shadow = edge.wiring.models.shadows["m"]
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "0"})  # fmt: skip
                assert r.status_code == 200
                await wait_until(lambda: len(shadow._tasks) == 1, timeout=20)
                (mirror,) = shadow._tasks.values()
                await wait_until(lambda: not shadow._tasks, timeout=20)
                await wait_until(lambda: any(
                    q.path == "/abort_request" and json.loads(q.body).get("rid") == mirror.rid
                    for q in slow.requests
                ), timeout=20)  # fmt: skip
                assert shadow.compared == 0
        finally:
            hold.set()
