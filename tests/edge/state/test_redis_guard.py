"""The state store behind admission's Redis guard: a Redis that hangs costs `redis_timeout` for
the first few stored requests only; then they are refused at once (503 `state_unavailable`,
the breaker named) until a probe finds Redis answering again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from edge.state.redis_store import FAILURES_TO_OPEN
from tests.edge.conftest import Edge, TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import CHAT, ChatUpstream, state
from tests.helpers import RedisServer

USER = {"role": "user", "content": "Remember this, please."}


@contextlib.asynccontextmanager
async def hung_redis() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A TCP server that takes every connection and reads every command, and never answers."""
    received: list[bytes] = []
    writers: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while chunk := await reader.read(65536):
            received.append(chunk)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0", received
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


async def stored(http: httpx.AsyncClient) -> httpx.Response:
    return await http.post(
        CHAT, headers={"x-quicedge-conversation": "new"}, json={"messages": [USER]}
    )


async def gauge(edge: Edge, name: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
        text = (await admin.get("/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            out[labels[len(name) :]] = float(value)
    return out


async def test_a_hung_redis_opens_the_state_breaker_and_stored_requests_fail_fast() -> None:
    async with hung_redis() as (url, received), TinyUpstream(ChatUpstream()) as up:
        settings = state(url, "t:", timeout=0.3)
        async with run_edge(fast_config([up.url], state=settings)) as edge, client(edge) as http:
            assert (await gauge(edge, "quicedge_redis_breaker_state")) == {'{store="state"}': 0.0}
            for _ in range(FAILURES_TO_OPEN):
                slow = await stored(http)
                assert slow.status_code == 503
                assert slow.json()["error"]["code"] == "state_unavailable"
                assert "TimeoutError" in slow.json()["error"]["message"]
            asked = len(received)
            assert asked > 0  # the first calls did reach the hung server
            fast = await stored(http)
            assert fast.status_code == 503
            assert "breaker open" in fast.json()["error"]["message"], fast.text
            states = await gauge(edge, "quicedge_redis_breaker_state")
            assert states['{store="state"}'] in (1.0, 2.0)  # open, or a probe in flight
            trips = await gauge(edge, "quicedge_redis_breaker_trips_total")
            assert trips == {'{store="state"}': 1.0}
            # requests that need no state go on meanwhile
            plain = await http.post(CHAT, json={"messages": [USER]})
            assert plain.status_code == 200


async def test_the_state_breaker_closes_when_redis_is_back() -> None:
    server = RedisServer()
    try:
        settings = state(server.url, "t:", timeout=0.3)
        async with TinyUpstream(ChatUpstream()) as up:
            async with run_edge(fast_config([up.url], state=settings)) as edge, \
                    client(edge) as http:  # fmt: skip
                assert (await stored(http)).status_code == 200
                server.stop()
                answers: list[dict[str, Any]] = []
                for _ in range(FAILURES_TO_OPEN + 1):
                    down = await stored(http)
                    assert down.status_code == 503
                    answers.append(down.json()["error"])
                assert "breaker open" in answers[-1]["message"]
                server = RedisServer(server.port)

                async def back() -> bool:
                    return (await stored(http)).status_code == 200

                async with asyncio.timeout(30):  # the probe backs off up to 5 s between PINGs
                    while not await back():  # noqa: ASYNC110  (polled as a client would)
                        await asyncio.sleep(0.2)
                states = await gauge(edge, "quicedge_redis_breaker_state")
                assert states['{store="state"}'] == 0.0
    finally:
        with contextlib.suppress(Exception):
            server.stop()


async def test_with_redis_hung_a_stored_completion_is_answered_and_a_background_one_refused() -> (
    None
):
    """`store: true` on chat is answered all the same (only its keeping fails, counted);
    `background: true` needs its record, so it is a clear 503 that leaves nothing behind."""
    async with hung_redis() as (url, _), TinyUpstream(ChatUpstream()) as up:
        config = fast_config([up.url], state=state(url, timeout=0.1))
        async with run_edge(config) as edge, client(edge) as http:
            kept = await http.post(CHAT, json={"messages": [USER], "store": True})
            assert kept.status_code == 200 and kept.json()["choices"]
            async with asyncio.timeout(5):  # kept (or not) after the answer went out
                while not await gauge(edge, "quicedge_stored_completions_total"):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            outcomes = await gauge(edge, "quicedge_stored_completions_total")
            assert outcomes == {'{outcome="unavailable"}': 1.0}
            queued = await http.post("/v1/responses", json={"input": "Hi", "background": True})
            assert queued.status_code == 503
            assert queued.json()["error"]["code"] == "state_unavailable"
            running = await gauge(edge, "quicedge_background_responses_running")
            assert running in ({}, {"": 0.0})
