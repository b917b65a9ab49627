"""Closing the pool while a request waits for its head: the request fails, it is not sent
again on a connection the closed pool opens."""

from __future__ import annotations

import asyncio

import pytest

from backends.errors import UpstreamError
from backends.pool import UpstreamPool
from tests.helpers import wait_until


async def test_closing_the_pool_fails_a_waiting_request_without_resending_it() -> None:
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen.append(head.split(b" ", 2)[1].decode())
                if seen[-1] == "/ok":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = UpstreamPool()
    try:
        response = await pool.request(url, "GET", "/ok", headers=[], body=b"")
        assert await response.read() == b"ok"
        waiting = asyncio.ensure_future(
            pool.request(url, "POST", "/hang", headers=[], body=b"{}")  # on the kept connection
        )
        await wait_until(lambda: seen[-1] == "/hang")
        await pool.aclose()
        with pytest.raises(UpstreamError):
            await asyncio.wait_for(waiting, 5)
        assert seen == ["/ok", "/hang"]
        assert pool.stats().stale_resends == 0
    finally:
        await pool.aclose()
        server.close()
