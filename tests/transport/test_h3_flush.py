"""When the HTTP/3 listener sends: a lone response at once, responses sharing a connection once
per loop turn, and what was written before a stream reset still goes out first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aioquic.h3.connection import ErrorCode
from prometheus_client import CollectorRegistry

from tests.transport.conftest import H3Factory
from tests.transport.h3client import H3Client, h3_connect
from transport.asgi import Receive, Scope, Send
from transport.metrics import TransportMetrics

CHUNKS = 40


class Ticker:
    """Wakes every waiting app in the same loop turn, so that their writes share it."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def tick(self) -> None:
        await self.event.wait()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0.005)
            event, self.event = self.event, asyncio.Event()
            event.set()


def ticking_app(ticker: Ticker) -> object:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(CHUNKS):
            await ticker.tick()
            await send({"type": "http.response.body", "body": b"%d;" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def count_datagrams(client: H3Client) -> list[int]:
    """Datagrams the client receives from now on (one counter, in a list)."""
    seen = [0]
    receive = client.datagram_received

    def counted(data: bytes | str, addr: object) -> None:
        seen[0] += 1
        receive(data, addr)  # type: ignore[arg-type]

    client.datagram_received = counted  # type: ignore[method-assign]
    return seen


def flushes(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("quicedge_h3_flush_delay_seconds_count") or 0.0


def expected_body() -> bytes:
    return b"".join(b"%d;" % i for i in range(CHUNKS))


@dataclass
class Ticking:
    client: H3Client
    registry: CollectorRegistry
    datagrams: list[int]  # what the client has received since it connected


@asynccontextmanager
async def ticking_server(h3_server: H3Factory, dev_certs: Any) -> AsyncIterator[Ticking]:
    """A listener serving `ticking_app`, a connected client, and the listener's metrics."""
    ticker = Ticker()
    registry = CollectorRegistry()
    ticker.task = asyncio.create_task(ticker.run())
    try:
        async with (
            h3_server(app=ticking_app(ticker), metrics=TransportMetrics(registry)) as server,
            h3_connect(server.port, dev_certs.ca_cert) as client,
        ):
            yield Ticking(client, registry, count_datagrams(client))
    finally:
        ticker.task.cancel()


async def test_a_lone_response_leaves_chunk_by_chunk(h3_server: H3Factory, dev_certs) -> None:
    async with ticking_server(h3_server, dev_certs) as t:
        r = await t.client.fetch("GET", "/one")
    assert r.status == 200 and r.body == expected_body()
    assert t.datagrams[0] >= CHUNKS  # a datagram per chunk: nothing waits for a turn's end
    assert flushes(t.registry) == 0


async def test_responses_on_one_connection_share_datagrams(h3_server: H3Factory, dev_certs) -> None:
    """Two streams write a chunk each in every tick: one transmit a turn sends both."""
    async with ticking_server(h3_server, dev_certs) as t:
        first, second = t.client.request("GET", "/a"), t.client.request("GET", "/b")
        t.client.send_now()
        a, b = await t.client.wait(first), await t.client.wait(second)
    assert (a.status, b.status) == (200, 200)
    assert a.body == expected_body() and b.body == expected_body()
    # a datagram per chunk would be 2 * CHUNKS; shared, about one per tick
    assert t.datagrams[0] < 1.5 * CHUNKS
    assert flushes(t.registry) > 0


async def test_a_reset_does_not_drop_what_was_written_before_it(
    h3_server: H3Factory, dev_certs
) -> None:
    """With another response in flight, writes wait for the turn's transmit; an app that fails
    right after writing gets its stream reset, and the reset would take the place of the
    unsent head and chunk."""
    release, slow_started = asyncio.Event(), asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/slow":
            slow_started.set()
            await release.wait()
            await send({"type": "http.response.body", "body": b"done", "more_body": False})
            return
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        raise RuntimeError("boom")

    async with (
        h3_server(app=app) as server,
        h3_connect(server.port, dev_certs.ca_cert) as client,
    ):
        slow = client.request("GET", "/slow")
        client.send_now()
        await asyncio.wait_for(slow_started.wait(), 10)  # the connection has two responses
        failed = await client.fetch("GET", "/fails")
        release.set()
        done = await client.wait(slow)
    assert failed.status == 200 and failed.body == b"x"
    assert failed.reset_code == ErrorCode.H3_INTERNAL_ERROR
    assert done.status == 200 and done.body == b"done"
