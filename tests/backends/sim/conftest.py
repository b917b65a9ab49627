"""Fixtures for the stand-in's tests: start real SimServers on free ports, talk real HTTP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from backends.sim import SimConfig, SimServer

MakeSim = Callable[..., Awaitable[SimServer]]


@pytest.fixture
async def make_sim() -> AsyncIterator[MakeSim]:
    """`await make_sim(profile=..., time_scale=...)` -> a started SimServer, stopped afterwards."""
    servers: list[SimServer] = []

    async def make(**options: Any) -> SimServer:
        config = SimConfig(**{"host": "127.0.0.1", "port": 0, "profile": "instant", **options})
        server = SimServer(config)
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


@pytest.fixture
async def sim(make_sim: MakeSim) -> SimServer:
    return await make_sim(enable_metrics=True, enable_cache_report=True)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0) as c:
        yield c


async def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an event stream, JSON-decoded except the literal [DONE]."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def stream_post(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[httpx.Response, list[Any]]:
    async with client.stream("POST", url, json=body) as response:
        events = await sse_events(response)
    return response, events
