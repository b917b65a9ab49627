"""An edge whose backend is itself (discovery that finds the edge's own address, a `--backend`
typo), or edges whose backends lead around in a loop: the request comes back once, is refused
with 508 `loop_detected`, and the loop costs one extra request, not the upstream pool."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import httpx
from prometheus_client import CollectorRegistry

from edge.app import MAX_EDGE_HOPS
from edge.wiring import Wiring, build
from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, health_ok, run_edge
from tests.helpers import free_port
from transport.h1_server import H1Listener

CHAT = {"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


@contextlib.asynccontextmanager
async def edge_on_itself() -> AsyncIterator[tuple[str, Wiring, CollectorRegistry]]:
    """An edge on the listener `quicedge serve --http` runs, whose one backend is that
    listener. Its health checks run rarely: a failed `/health` would take it out of the fleet
    before the request, and the loop must be cut by the request itself."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    registry = CollectorRegistry()
    config = fast_config([url], health_interval=60.0, pool_warm_connections=0)
    wiring = await build(config, registry=registry)
    await wiring.start()
    listener = H1Listener(wiring.app, host="127.0.0.1", port=port)
    await listener.start()
    try:
        yield url, wiring, registry
    finally:
        await listener.stop()
        await wiring.aclose()


async def test_an_edge_that_is_its_own_backend_refuses_the_request_when_it_comes_back() -> None:
    async with edge_on_itself() as (url, wiring, registry):
        async with httpx.AsyncClient(timeout=20) as client:
            r = await client.post(f"{url}/v1/chat/completions", json=CHAT)
        assert r.status_code == 508, r.text
        error = r.json()["error"]
        assert error["code"] == "loop_detected"
        assert "came back to the edge that forwarded it" in error["message"]
        counted: dict[str, float] = {}
        for metric in registry.collect():
            for sample in metric.samples if metric.name == "quicedge_requests" else []:
                if sample.name.endswith("_total") and sample.labels["route"] != "other":
                    status = sample.labels["status"]
                    counted[status] = counted.get(status, 0.0) + sample.value
        # The client's request, and its one trip back: refused there, relayed here.
        assert counted == {"508": 2.0}
        assert wiring.registry.backends[0].in_flight == 0


async def test_each_edge_adds_itself_to_via_after_the_hops_before_it() -> None:
    """RFC 9110 §7.6.3: a proxy adds its entry to `Via`; the backend sees the proxies the
    request passed, the client's first. A chain of edges that is not a loop is served, up to
    `MAX_EDGE_HOPS` of them."""

    def backend(recorded: Recorded) -> Reply:
        found = health_ok(recorded)
        if found is not None:
            return found
        answer = {"id": "x", "object": "chat.completion", "choices": []}
        return Reply(chunks=[json.dumps(answer).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    async with TinyUpstream(backend) as upstream, run_edge(fast_config([upstream.url])) as edge:
        assert edge.wiring.proxy is not None
        name = edge.wiring.proxy.via.name.decode()
        async with httpx.AsyncClient(base_url=edge.url, timeout=20) as client:
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            earlier = ", ".join(f"1.1 quicedge-{i:012x}" for i in range(MAX_EDGE_HOPS - 1))
            passed = {"via": f"1.0 corp-proxy, {earlier}"}
            r = await client.post("/v1/chat/completions", json=CHAT, headers=passed)
            assert r.status_code == 200, r.text
            too_many = {"via": f"{earlier}, 2 quicedge-{MAX_EDGE_HOPS:012x}"}
            r = await client.post("/v1/chat/completions", json=CHAT, headers=too_many)
            assert r.status_code == 508 and r.json()["error"]["code"] == "loop_detected"
            assert f"passed {MAX_EDGE_HOPS} edges" in r.json()["error"]["message"]
            back = {"via": f"3 quicedge-{1:012x}, 1.1 {name}"}
            r = await client.post("/v1/chat/completions", json=CHAT, headers=back)
            assert r.status_code == 508 and r.json()["error"]["code"] == "loop_detected"
    chats = [q for q in upstream.requests if q.path == "/v1/chat/completions"]
    assert [q.headers["via"] for q in chats] == [
        f"1.1 {name}",
        f"1.0 corp-proxy, {earlier}, 1.1 {name}",
    ]
