"""The backends' KV-cache events at the edge: real stand-ins publishing on ZMQ sockets, an edge
subscribed to them; a cache the engine says is empty is forgotten (and warmed again)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import httpx
import zmq
import zmq.asyncio

from backends.kv_events import encode_batch
from backends.sim import SimConfig, SimServer
from edge.routing.kv_events import KvEventsConfig
from edge.routing.prewarm import PrewarmConfig
from tests.edge.conftest import Edge, client, fast_config, run_edge
from tests.edge.routing.test_prewarm import (
    direct_cached,
    generate,
    name,
    prewarm_state,
    sim_config,
    sims,
    words,
)
from tests.helpers import free_port, wait_until


def publishing(backend: str) -> tuple[SimConfig, str]:
    """A stand-in config that publishes its cache's changes, and where the edge finds them."""
    port = free_port()
    events = f'{{"publisher": "zmq", "endpoint": "tcp://*:{port}"}}'
    return sim_config(backend, kv_events_config=events), f"tcp://127.0.0.1:{port}"


def events_config(servers: list[SimServer], endpoints: list[str]) -> KvEventsConfig:
    return KvEventsConfig(
        enabled=True,
        endpoints={s.url: e for s, e in zip(servers, endpoints, strict=True)},
        rescan_interval=0.1,
    )


def seen(edge: Edge) -> dict[str, dict[str, Any]]:
    assert edge.wiring.fleet is not None and edge.wiring.fleet.kv_events is not None
    return edge.wiring.fleet.kv_events.snapshot()


async def settle(http: httpx.AsyncClient, edge: Edge, backend: str, rng: random.Random) -> None:
    """Requests until the edge has events from `backend` (ZMQ drops what a publisher sends
    before a new subscription reaches it)."""
    for _ in range(200):
        await generate(http, words(rng, 60))
        if seen(edge).get(backend, {}).get("stored"):
            return
    raise AssertionError(f"no events from {backend}")


async def test_a_cache_the_backend_says_was_cleared_is_forgotten_by_the_routing_tree() -> None:
    rng = random.Random(3)
    system = words(rng, 600)
    config_b0, endpoint_b0 = publishing("b0")
    async with sims(config_b0) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        events = events_config(servers, [endpoint_b0])
        async with run_edge(config, kv_events=events) as edge, client(edge) as http:
            b0 = name(servers[0])
            await settle(http, edge, b0, rng)
            await generate(http, system + words(rng, 20))
            tree = edge.wiring.policy.tree  # type: ignore[attr-defined]
            assert tree.match(system).chars.get(servers[0].url, 0) > 0
            await wait_until(lambda: seen(edge)[b0]["blocks"] > 0)
            before = seen(edge)[b0]["blocks"]
            assert seen(edge)[b0]["tokens"] == seen(edge)[b0]["blocks"]  # block size 1
            async with httpx.AsyncClient() as direct:
                assert (await direct.post(servers[0].url + "/flush_cache")).status_code == 200
            await wait_until(lambda: seen(edge)[b0]["cleared"] == 1)
            assert tree.match(system).chars.get(servers[0].url, 0) == 0
            async with httpx.AsyncClient() as admin:
                body = (await admin.get(edge.admin_url + "/backends")).json()
                assert body["kv_events"][b0]["cleared"] == 1
                metrics = (await admin.get(edge.admin_url + "/metrics")).text
            assert f'quicedge_kv_events_total{{backend="{b0}",event="cleared"}} 1.0' in metrics
            # What the edge's own health checks cached since, no more.
            gauge = f'quicedge_kv_cached_blocks{{backend="{b0}"}} '
            assert float(metrics.split(gauge, 1)[1].split()[0]) < 0.1 * before


async def test_a_backend_whose_events_start_again_is_a_restart_and_is_warmed_again() -> None:
    rng = random.Random(4)
    system = words(rng, 900)
    config_b0, endpoint_b0 = publishing("b0")
    async with sims(config_b0) as servers:
        # Health checks and the request counter too rare to notice: only the events can.
        config = fast_config([servers[0].url], policy="ttft", health_interval=60.0)
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=None)
        events = events_config(servers, [endpoint_b0])
        async with (
            run_edge(config, prewarm=prewarm, kv_events=events) as edge,
            client(edge) as http,
        ):
            b0 = name(servers[0])
            await settle(http, edge, b0, rng)
            for _ in range(4):
                await generate(http, system + words(rng, 30))
            # A long-running server has numbered many messages: more than the fresh one will
            # have sent before the edge's subscription reaches it.
            async with httpx.AsyncClient(base_url=servers[0].url) as direct:
                for i in range(300):
                    body = {
                        "text": f"{i} {words(rng, 5)}",
                        "sampling_params": {"max_new_tokens": 0},
                    }
                    assert (await direct.post("/generate", json=body)).status_code == 200
            await wait_until(lambda: seen(edge)[b0]["stored"] > 300)
            port = servers[0].port
            await servers[0].stop()
            fresh = await start_again(config_b0, port)
            try:
                # The fresh process's first events (its sequence from 0) say it is new.
                for _ in range(200):
                    if seen(edge)[b0]["restarts"]:
                        break
                    await generate(http, words(rng, 60))
                assert seen(edge)[b0]["restarts"] == 1, str(seen(edge)[b0])
                await wait_until(lambda: prewarm_state(edge)[b0]["reason"] == "cache cleared")
                await wait_until(lambda: prewarm_state(edge)[b0]["state"] == "ready")
                assert await direct_cached(fresh.url, system) > 0.6 * len(system.split())
            finally:
                await fresh.stop()


async def start_again(config: SimConfig, port: int) -> SimServer:
    """A fresh stand-in on the old port; its event socket's port frees a moment after the old
    one closed it (ZMQ closes in its own thread)."""
    fresh = SimServer(dataclasses.replace(config, port=port))
    for _ in range(100):
        try:
            await fresh.start()
            return fresh
        except zmq.ZMQError:
            fresh = SimServer(dataclasses.replace(config, port=port))
            await asyncio.sleep(0.05)
    raise AssertionError("the event socket's port stayed in use")


async def test_a_malformed_message_or_a_silent_backend_costs_nothing_but_a_count() -> None:
    port = free_port()
    async with sims(sim_config("b0")) as servers:  # publishes nothing
        config = fast_config([servers[0].url], policy="ttft")
        events = KvEventsConfig(enabled=True, endpoints={servers[0].url: f"tcp://127.0.0.1:{port}"})
        async with run_edge(config, kv_events=events) as edge, client(edge) as http:
            b0 = name(servers[0])
            assert seen(edge)[b0]["last_event_age_s"] is None
            junk = zmq.Context.instance().socket(zmq.PUB)
            junk.bind(f"tcp://127.0.0.1:{port}")
            try:
                rng = random.Random(5)
                for _ in range(200):
                    junk.send_multipart([b"", b"not a sequence", b"\xc1"])
                    await generate(http, words(rng, 20))  # served all along
                    if seen(edge)[b0]["malformed"]:
                        break
                assert seen(edge)[b0]["malformed"] > 0 and seen(edge)[b0]["stored"] == 0
            finally:
                junk.close(linger=0)


async def test_an_address_zmq_refuses_is_reported_and_the_edge_serves_on() -> None:
    async with sims(sim_config("b0")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        events = KvEventsConfig(enabled=True, endpoints={servers[0].url: "tcp://127.0.0.1:nope"})
        async with run_edge(config, kv_events=events) as edge, client(edge) as http:
            b0 = name(servers[0])
            await wait_until(lambda: seen(edge)[b0]["error"] is not None)
            assert "Invalid argument" in seen(edge)[b0]["error"]
            await generate(http, words(random.Random(6), 20))


async def subscribed(xpub: zmq.asyncio.Socket) -> None:
    """Until the edge's subscription has reached this publisher (XPUB hands it over)."""
    async with asyncio.timeout(10):
        assert (await xpub.recv())[:1] == b"\x01"


def stored(seq: int) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), encode_batch([["BlockStored", [seq], None, [1], 1]])]


async def test_a_new_process_that_numbered_past_the_last_message_seen_is_a_restart() -> None:
    """SGLang numbers from 0 per process, so a new server that sent more messages before the
    edge reconnected than its predecessor ever did looks like a gap; the broken connection
    between them says otherwise. A connection that breaks and goes on where it was is not."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    context = zmq.asyncio.Context()
    async with sims(sim_config("b0")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        events = KvEventsConfig(enabled=True, endpoints={servers[0].url: endpoint})
        async with run_edge(config, kv_events=events) as edge:
            b0 = name(servers[0])
            sequences = ((0, 1, 2), (3,), (10,))  # the first process, a blip, a new process
            for run, seqs in enumerate(sequences):
                xpub = context.socket(zmq.XPUB)
                try:
                    xpub.bind(endpoint)
                    await subscribed(xpub)
                    for seq in seqs:
                        await xpub.send_multipart(stored(seq))
                    await wait_until(lambda seqs=seqs: seen(edge)[b0]["last_seq"] == seqs[-1])
                finally:
                    xpub.close(linger=0)
                await wait_until(lambda run=run: seen(edge)[b0]["disconnects"] == run + 1)
                if run == 1:
                    assert seen(edge)[b0]["restarts"] == 0, "went on where it was: no restart"
            state = seen(edge)[b0]
            assert state["restarts"] == 1 and state["gaps"] == 0, str(state)
    context.destroy(linger=0)


async def test_a_message_nested_too_deep_to_decode_is_counted_and_the_reader_goes_on() -> None:
    """A payload the decoder gives up on for its depth (msgpack arrays in arrays) is a
    malformed message like any other: the backend's next messages are still read."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    context = zmq.asyncio.Context()
    async with sims(sim_config("b0")) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        events = KvEventsConfig(enabled=True, endpoints={servers[0].url: endpoint})
        async with run_edge(config, kv_events=events) as edge:
            b0 = name(servers[0])
            xpub = context.socket(zmq.XPUB)
            try:
                xpub.bind(endpoint)
                await subscribed(xpub)
                deep = b"\x92\x00" + b"\x91" * 200_000 + b"\xc0"  # [0, [[[...]]]]
                await xpub.send_multipart([b"", (0).to_bytes(8, "big"), deep])
                await wait_until(lambda: seen(edge)[b0]["malformed"] == 1)
                await xpub.send_multipart(stored(1))
                await wait_until(lambda: seen(edge)[b0]["stored"] == 1)
            finally:
                xpub.close(linger=0)
    context.destroy(linger=0)


async def test_a_backend_at_an_ipv6_address_has_its_events_read() -> None:
    """`{host}` of an IPv6 backend URL is an IPv6 address: the subscription must reach it (ZMQ
    sockets speak IPv4 only unless told otherwise, and say nothing when they cannot)."""
    port = free_port()
    context = zmq.asyncio.Context()
    async with sims(sim_config("b0")) as servers:
        backend = f"http://[::1]:{free_port()}"  # the edge needs only its address here
        config = fast_config([servers[0].url, backend], policy="ttft")
        events = KvEventsConfig(enabled=True, endpoint=f"tcp://{{host}}:{port}")
        xpub = context.socket(zmq.XPUB)
        xpub.setsockopt(zmq.IPV6, 1)
        try:
            xpub.bind(f"tcp://[::1]:{port}")
            async with run_edge(config, kv_events=events) as edge:
                await subscribed(xpub)
                await xpub.send_multipart(stored(0))
                only = backend.removeprefix("http://")  # the edge names it by its host:port
                await wait_until(lambda: seen(edge)[only]["stored"] == 1)
        finally:
            xpub.close(linger=0)
    context.destroy(linger=0)


async def test_a_prefix_already_queued_for_a_warm_up_is_not_queued_again() -> None:
    """One restart is often told several times (its events, its health checks, its request
    counter), and an engine whose cache is flushed often says so each time: each told the
    lane to warm the same hot prefixes again, and the queue grew by `top` per telling."""
    rng = random.Random(11)
    prefixes = [words(rng, 900) for _ in range(3)]
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    context = zmq.asyncio.Context()
    slow = sim_config("b0", profile="h100-llama3-8b", time_scale=4.0)
    async with sims(slow) as servers:
        config = fast_config([servers[0].url], policy="ttft")
        prewarm = PrewarmConfig(enabled=True, restart_check_interval=None)
        events = KvEventsConfig(enabled=True, endpoints={servers[0].url: endpoint})
        xpub = context.socket(zmq.XPUB)
        try:
            xpub.bind(endpoint)
            async with (
                run_edge(config, prewarm=prewarm, kv_events=events) as edge,
                client(edge) as http,
            ):
                for prefix in prefixes:
                    for _ in range(3):
                        await generate(http, prefix + words(rng, 30))
                await subscribed(xpub)
                b0 = name(servers[0])
                cleared = encode_batch([["AllBlocksCleared"]])
                for seq in range(5):
                    await xpub.send_multipart([b"", seq.to_bytes(8, "big"), cleared])
                await wait_until(lambda: seen(edge)[b0]["cleared"] == 5)
                assert prewarm_state(edge)[b0]["queued"] <= len(prefixes), prewarm_state(edge)
                await wait_until(lambda: prewarm_state(edge)[b0]["state"] == "ready", 30)
                requests = prewarm_state(edge)[b0]["requests"]
                assert sum(requests.values()) <= 2 * len(prefixes), requests
        finally:
            xpub.close(linger=0)
    context.destroy(linger=0)
