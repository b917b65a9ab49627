"""Pre-warming end to end: the edge (hypercorn) in front of real stand-ins, warm-up requests over
the real pool, restarts of real stand-in processes' servers, and the admin `/prewarm` route."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from backends.sim import SimConfig, SimServer
from backends.sim.textgen import WORDS
from edge.routing.prewarm import PrewarmConfig
from tests.edge.conftest import Edge, client, fast_config, run_edge
from tests.helpers import wait_until


def sim_config(name: str, **overrides: Any) -> SimConfig:
    values: dict[str, Any] = {
        "name": name,
        "host": "127.0.0.1",
        "port": 0,
        "profile": "instant",
        "enable_metrics": True,
        "enable_cache_report": True,
        "seed": 0,
    }
    values.update(overrides)
    return SimConfig(**values)


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(WORDS, k=n))


@contextlib.asynccontextmanager
async def sims(*configs: SimConfig) -> AsyncIterator[list[SimServer]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(SimServer(c)) for c in configs]


async def generate(http: httpx.AsyncClient, text: str) -> tuple[str, dict[str, Any]]:
    response = await http.post(
        "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2}}
    )
    assert response.status_code == 200, response.text
    return response.headers["x-quicedge-backend"], response.json()["meta_info"]


async def direct_cached(url: str, text: str) -> int:
    """The stand-in's own answer: how many tokens of `text` it has cached."""
    async with httpx.AsyncClient(base_url=url) as http:
        body = {"text": text, "sampling_params": {"max_new_tokens": 0}}
        response = await http.post("/generate", json=body)
        assert response.status_code == 200
        return int(response.json()["meta_info"]["cached_tokens"])


def name(server: SimServer) -> str:
    """The edge names a backend by its host:port."""
    return f"127.0.0.1:{server.port}"


def prewarm_state(edge: Edge) -> dict[str, Any]:
    assert edge.wiring.fleet is not None and edge.wiring.fleet.prewarm is not None
    return edge.wiring.fleet.prewarm.snapshot()["backends"]


async def restart(server: SimServer) -> SimServer:
    """Stop a stand-in and start a fresh one (empty cache) on the same port."""
    port = server.port
    await server.stop()
    fresh = SimServer(sim_config(server.config.name, port=port))
    await fresh.start()
    return fresh


async def test_a_restarted_backend_is_warmed_before_it_takes_hot_traffic() -> None:
    rng = random.Random(1)
    system = words(rng, 900)  # a few thousand characters: several blocks and shards
    async with sims(sim_config("b0"), sim_config("b1")) as servers:
        config = fast_config([s.url for s in servers], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, deadline=60.0, restart_check_interval=None,
                                half_life=3600.0)  # fmt: skip
        async with run_edge(config, prewarm=prewarm) as edge, client(edge) as http:
            for _ in range(6):
                await generate(http, system + words(rng, 40))
            registry = edge.wiring.registry
            b0, b1 = registry.get(name(servers[0])), registry.get(name(servers[1]))
            assert b0 is not None and b1 is not None
            warm = name(servers[1])
            await servers[1].stop()
            await wait_until(lambda: not b1.healthy)
            fresh = SimServer(sim_config("b1", port=servers[1].port))
            await fresh.start()
            try:
                await wait_until(lambda: prewarm_state(edge)[warm]["warmups"] >= 1)
                await wait_until(lambda: prewarm_state(edge)[warm]["state"] == "ready")
                state = prewarm_state(edge)[warm]
                assert state["reason"] == "recovered" and state["ready"]
                assert state["requests"].get("ok", 0) >= 1
                assert state["tokens"] > 500
                # Hot traffic now lands on a warm cache: with b0 out, a hot request on b1 is a hit.
                b0.ejected_until = time.monotonic() + 60
                chosen, meta = await generate(http, system + words(rng, 40))
                assert chosen == warm
                assert meta["cached_tokens"] > 0.6 * meta["prompt_tokens"]
                backends = (await httpx.AsyncClient().get(edge.admin_url + "/backends")).json()
                assert backends["prewarm"]["backends"][warm]["state"] == "ready"
                assert backends["prewarm"]["hot_prefixes"][0]["count"] >= 6
                metrics = (await httpx.AsyncClient().get(edge.admin_url + "/metrics")).text
                assert f'quicedge_prewarm_requests_total{{backend="{warm}",result="ok"}}' in metrics
                assert f'quicedge_prewarm_state{{backend="{warm}",state="ready"}} 1.0' in metrics
            finally:
                await fresh.stop()


async def test_a_restart_the_health_checks_missed_is_found_by_the_request_counter() -> None:
    rng = random.Random(2)
    system = words(rng, 600)
    async with sims(sim_config("b0")) as servers:
        # Checks too rare to notice a quick restart: only the `/metrics` counter can.
        config = fast_config([servers[0].url], policy="ttft", health_interval=60.0)
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=0.1)
        async with run_edge(config, prewarm=prewarm) as edge, client(edge) as http:
            for _ in range(4):
                await generate(http, system + words(rng, 30))
            service = edge.wiring.fleet.prewarm  # type: ignore[union-attr]
            assert service is not None
            await wait_until(lambda: (service._lanes[servers[0].url].last_counter or 0) >= 4)
            fresh = await restart(servers[0])
            try:
                only = name(fresh)
                await wait_until(lambda: prewarm_state(edge)[only]["reason"] == "restart")
                await wait_until(lambda: prewarm_state(edge)[only]["state"] == "ready")
                assert await direct_cached(fresh.url, system) > 0.6 * len(system.split())
            finally:
                await fresh.stop()


async def test_pacing_keeps_one_warm_up_in_flight_within_its_share_of_time() -> None:
    rng = random.Random(3)
    text = words(rng, 3000)  # about a dozen shards of 256 tokens
    share = 0.25
    # A real-speed GPU profile slowed 4x, so each shard takes measurable time.
    async with sims(sim_config("b0", profile="h100-llama3-8b", time_scale=4.0)) as servers:
        sim = servers[0]
        config = fast_config([sim.url], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, share=share, restart_check_interval=None)
        async with run_edge(config, prewarm=prewarm) as edge:
            peak = seen = 0
            stop = asyncio.Event()

            async def sample() -> None:  # counted at the stand-in itself
                nonlocal peak, seen
                while not stop.is_set():
                    s = sim.scheduler
                    assert s is not None
                    queued = [*s.waiting, *s.holding]  # waiting, prefilling or decoding
                    warm = sum(1 for r in queued if r.max_new_tokens == 0)
                    peak, seen = max(peak, warm), seen + (warm > 0)
                    await asyncio.sleep(0.0005)

            sampler = asyncio.create_task(sample())
            t0 = time.monotonic()
            async with httpx.AsyncClient(timeout=60) as http:
                response = await http.post(edge.admin_url + "/prewarm", json={"text": text})
            span = time.monotonic() - t0
            stop.set()
            await sampler
            assert response.status_code == 200, response.text
            result = response.json()["backends"][name(sim)]
            assert result["error"] is None and result["requests"] >= 8
            assert result["chars"] == len(text)
            assert seen > 0 and peak == 1
            busy = prewarm_state(edge)[name(sim)]["busy_s"]
            assert busy / span <= share * 1.2
            assert await direct_cached(sim.url, text) > 0.9 * len(text.split())


async def test_prewarm_route_errors_are_openai_shaped() -> None:
    async with sims(sim_config("b0")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=None)
        async with run_edge(config, prewarm=prewarm) as edge, httpx.AsyncClient() as http:
            url = edge.admin_url + "/prewarm"
            cases = [
                (await http.post(url, content=b"{nope"), 400, "invalid_json"),
                (await http.post(url, json=["text"]), 400, "invalid_json"),
                (await http.post(url, json={"text": ""}), 400, "invalid_request"),
                (await http.post(url, json={"text": "x", "backends": ["b9"]}), 400, None),
                (await http.get(url), 405, None),
            ]
            for response, status, code in cases:
                assert response.status_code == status, response.text
                error = response.json()["error"]
                assert error["message"]
                if code is not None:
                    assert error["code"] == code
        async with run_edge(config) as edge, httpx.AsyncClient() as http:
            response = await http.post(edge.admin_url + "/prewarm", json={"text": "x"})
            assert response.status_code == 404
            assert "prewarm" in response.json()["error"]["message"]


async def test_warm_up_waits_for_the_edges_requests_in_prefill_there() -> None:
    rng = random.Random(4)
    long_prompt = words(rng, 6000)  # a prefill of measurable length on a slowed GPU profile
    async with sims(sim_config("b0", profile="h100-llama3-8b", time_scale=4.0)) as servers:
        sim = servers[0]
        config = fast_config([sim.url], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, yield_s=60.0, restart_check_interval=None)
        async with run_edge(config, prewarm=prewarm) as edge, client(edge) as http:
            backend = edge.wiring.registry.backends[0]
            overlaps = samples = 0
            stop = asyncio.Event()

            async def sample() -> None:  # at the stand-in: a warm-up beside a real prefill?
                nonlocal overlaps, samples
                while not stop.is_set():
                    s = sim.scheduler
                    assert s is not None
                    queued = [*s.waiting, *s.holding]  # waiting, prefilling or decoding
                    warm = any(r.max_new_tokens == 0 for r in queued)
                    real_in_prefill = any(  # the stand-in's own health probes aside
                        r.max_new_tokens > 0 and r.first_token_at is None
                        and not r.rid.startswith("HEALTH_CHECK")
                        for r in queued
                    )  # fmt: skip
                    samples += 1
                    overlaps += warm and real_in_prefill
                    await asyncio.sleep(0.0005)

            sampler = asyncio.create_task(sample())
            real = asyncio.create_task(generate(http, long_prompt))
            await wait_until(lambda: backend.in_prefill > 0)
            async with httpx.AsyncClient(timeout=60) as admin:
                warmed = await admin.post(
                    edge.admin_url + "/prewarm", json={"text": words(rng, 400)}
                )
            await real
            stop.set()
            await sampler
            assert warmed.status_code == 200 and samples > 0
            assert overlaps == 0


async def test_other_policies_count_hot_prefixes_too() -> None:
    rng = random.Random(5)
    system = words(rng, 600)
    async with sims(sim_config("b0"), sim_config("b1")) as servers:
        config = fast_config([s.url for s in servers], policy="cache_aware")
        # counts decay as they age: an hour's half-life keeps three above 2.9 for minutes
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=None, half_life=3600.0)
        async with run_edge(config, prewarm=prewarm) as edge, client(edge) as http:
            for _ in range(3):
                await generate(http, system + words(rng, 40))
            async with httpx.AsyncClient() as admin:
                backends = (await admin.get(edge.admin_url + "/backends")).json()
            assert backends["policy"] == "cache_aware"
            hot = backends["prewarm"]["hot_prefixes"]
            assert hot and 2.9 < hot[0]["count"] <= 3 and system.startswith(hot[0]["head"])


async def chat(http: httpx.AsyncClient, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": "quicedge/sim-instant", "messages": messages, "max_tokens": 2}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()["usage"]
    return usage


@pytest.mark.parametrize("held", [True, False], ids=["whole", "in-shards"])
async def test_a_chat_warm_up_is_a_cache_hit_for_the_chat_requests_it_warms_for(
    held: bool,
) -> None:
    rng = random.Random(6)
    # A conversation several blocks long that every request continues with its own question;
    # the hot prefix ends inside the assistant's answer, so the warm-up sends whole messages
    # and one cut short.
    shared = [
        {"role": "system", "content": words(rng, 500)},
        {"role": "user", "content": words(rng, 300)},
        {"role": "assistant", "content": words(rng, 300)},
    ]
    async with sims(sim_config("b0")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, deadline=60.0, restart_check_interval=None)
        async with (
            run_edge(config, prewarm=prewarm) as edge,
            client(edge) as http,
            contextlib.AsyncExitStack() as busy,
        ):
            for _ in range(4):
                await chat(http, [*shared, {"role": "user", "content": words(rng, 30)}])
            backend = edge.wiring.registry.backends[0]
            if not held:
                # With a request of the edge's in flight there (decoding: past its first
                # token), each prefix goes in shards of 256 tokens, each a conversation cut a
                # shard further, instead of whole.
                busy.enter_context(
                    edge.wiring.registry.track(backend, prefill_tokens=0)
                ).first_token()
            only = name(servers[0])
            await servers[0].stop()
            await wait_until(lambda: not backend.healthy)
            fresh = SimServer(sim_config("b0", port=servers[0].port))
            await fresh.start()
            try:
                await wait_until(lambda: prewarm_state(edge)[only]["warmups"] >= 1)
                await wait_until(lambda: prewarm_state(edge)[only]["state"] == "ready")
                state = prewarm_state(edge)[only]
                assert state["requests"].get("ok", 0) >= (1 if held else 4), state
                assert state["tokens"] > 500
                # The first real request after the restart finds the conversation cached: the
                # backend rendered the warm-up with its own chat template.
                usage = await chat(http, [*shared, {"role": "user", "content": words(rng, 30)}])
                cached = (usage["prompt_tokens_details"] or {}).get("cached_tokens", 0)
                assert cached > 0.6 * usage["prompt_tokens"], usage
            finally:
                await fresh.stop()


async def test_a_backend_discovery_adds_is_warmed_and_one_it_removes_is_let_go() -> None:
    rng = random.Random(7)
    system = words(rng, 600)
    async with sims(sim_config("b0"), sim_config("b1")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, deadline=60.0, restart_check_interval=0.1)
        async with run_edge(config, prewarm=prewarm) as edge, client(edge) as http:
            for _ in range(4):
                await generate(http, system + words(rng, 30))
            registry = edge.wiring.registry
            joined = name(servers[1])
            registry.add(servers[1].url)  # what discovery does when a backend appears
            await wait_until(lambda: prewarm_state(edge).get(joined, {}).get("state") == "ready")
            state = prewarm_state(edge)[joined]
            assert state["reason"] == "join" and state["requests"].get("ok", 0) >= 1, state
            assert await direct_cached(servers[1].url, system) > 0.6 * len(system.split())
            # Gone from discovery: no lane, no series, no `/metrics` polls of it any more.
            await registry.remove(joined, drain_timeout=1.0)
            await wait_until(lambda: joined not in prewarm_state(edge))
            async with httpx.AsyncClient() as admin:
                metrics = (await admin.get(edge.admin_url + "/metrics")).text
            assert f'quicedge_prewarm_state{{backend="{joined}"' not in metrics


async def test_a_backend_is_warmed_with_its_own_models_hot_prefixes_only() -> None:
    """Two model pools: the hot prefixes of one are not prefilled on the other's backends (a
    different model: the work is wasted, and it crowds out that pool's own cache)."""
    rng = random.Random(8)
    system = words(rng, 600)
    configs = (
        sim_config("a0", served_model_name="alpha"),
        sim_config("b0", served_model_name="beta"),
    )
    async with sims(*configs) as servers:
        labelled = [servers[0].url + "#model=alpha", servers[1].url + "#model=beta"]
        config = fast_config(labelled, policy="ttft")
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=None)
        async with run_edge(config, prewarm=prewarm) as edge, client(edge) as http:
            for _ in range(4):
                body = {"model": "alpha", "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": words(rng, 20)},
                ], "max_tokens": 2}  # fmt: skip
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                assert response.headers["x-quicedge-backend"] == name(servers[0])
            beta = edge.wiring.registry.get(name(servers[1]))
            assert beta is not None
            await servers[1].stop()
            await wait_until(lambda: not beta.healthy)
            fresh = SimServer(sim_config("b0", served_model_name="beta", port=servers[1].port))
            await fresh.start()
            try:
                await wait_until(lambda: beta.healthy)
                state = prewarm_state(edge)[name(servers[1])]
                assert state["warmups"] == 0 and state["requests"] == {}, state
                # alpha's own backend, restarted the same way, is warmed with them
                assert edge.wiring.fleet is not None and edge.wiring.fleet.prewarm is not None
                alpha = edge.wiring.registry.get(name(servers[0]))
                assert alpha is not None
                assert edge.wiring.fleet.prewarm.warm_hot(alpha, reason="test") == 1
            finally:
                await fresh.stop()


async def test_edge_processes_sharing_a_fleet_view_warm_a_restarted_backend_once(
    redis_url: str, redis_prefix: str
) -> None:
    """Every edge process (worker or machine) notices a restart; with the shared view, one of
    them warms the backend, so its warm-up load is one process's, not one per process."""
    from edge.routing.fleet_view import FleetViewConfig

    rng = random.Random(9)
    system = words(rng, 600)
    shared = FleetViewConfig(enabled=True, redis=redis_url, key=redis_prefix + "fv", interval=0.05)
    async with sims(sim_config("b0")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=None)
        async with (
            run_edge(config, prewarm=prewarm, fleet_view=shared) as a,
            run_edge(config, prewarm=prewarm, fleet_view=shared) as b,
            client(a) as http_a,
            client(b) as http_b,
        ):
            for _ in range(3):
                await generate(http_a, system + words(rng, 30))
                await generate(http_b, system + words(rng, 30))
            only = name(servers[0])
            backends = [e.wiring.registry.get(only) for e in (a, b)]
            await servers[0].stop()
            await wait_until(lambda: not any(x is not None and x.healthy for x in backends))
            fresh = SimServer(sim_config("b0", port=servers[0].port))
            await fresh.start()
            try:
                # each has either warmed it or left it to the other
                await wait_until(lambda: all(
                    prewarm_state(e)[only]["state"] != "warming"
                    and (prewarm_state(e)[only]["requests"].get("ok", 0)
                         or prewarm_state(e)[only].get("elsewhere", 0))
                    for e in (a, b)
                ))  # fmt: skip
                states = [prewarm_state(e)[only] for e in (a, b)]
                sent = [s["requests"].get("ok", 0) for s in states]
                assert sorted(sent)[0] == 0 and sorted(sent)[1] >= 1, states
                assert await direct_cached(fresh.url, system) > 0.6 * len(system.split())
            finally:
                await fresh.stop()


async def test_a_backend_whose_metrics_stall_does_not_stop_restart_checks_of_the_others() -> None:
    """The `/metrics` poll of each backend is bounded as a whole: one that sends its head and
    then nothing must not hold the poll loop (and every other backend's restart check)."""
    stalled: list[asyncio.StreamWriter] = []

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\nsglang:num_req")
        stalled.append(writer)  # and nothing more, connection held open

    server = await asyncio.start_server(stall, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    rng = random.Random(10)
    system = words(rng, 600)
    try:
        async with sims(sim_config("b0")) as servers:
            urls = [f"http://127.0.0.1:{port}", servers[0].url]
            # Checks too rare to notice a restart: only the `/metrics` counter can.
            config = fast_config(urls, policy="ttft", health_interval=60.0, health_timeout=0.5)
            prewarm = PrewarmConfig(enabled=True, restart_check_interval=0.1)
            async with run_edge(config, prewarm=prewarm) as edge, client(edge) as http:
                only = name(servers[0])
                backend = edge.wiring.registry.get(only)
                assert backend is not None
                edge.wiring.registry.get(f"127.0.0.1:{port}").healthy = False  # type: ignore[union-attr]
                for _ in range(4):
                    await generate(http, system + words(rng, 30))
                service = edge.wiring.fleet.prewarm  # type: ignore[union-attr]
                assert service is not None
                await wait_until(lambda: (service._lanes[servers[0].url].last_counter or 0) >= 4)
                fresh = await restart(servers[0])
                try:
                    await wait_until(lambda: prewarm_state(edge)[only]["reason"] == "restart")
                finally:
                    await fresh.stop()
    finally:
        for writer in stalled:
            writer.close()
        server.close()
