"""`UpstreamResponse.read()` holds a whole body in memory: it stops at a bound, whatever the
backend sends (a `/v1/models` or a pre-warm answer that never ends)."""

from __future__ import annotations

import pytest

from backends.errors import UpstreamProtocolError
from backends.pool import UpstreamPool
from backends.response import MAX_READ_BYTES
from tests.edge.conftest import Recorded, Reply, TinyUpstream

MIB = 1024 * 1024


def endless(recorded: Recorded) -> Reply:
    if recorded.path == "/small":
        return Reply(chunks=[b"ok"], chunked=False)
    return Reply(chunks=[b"x" * MIB] * (MAX_READ_BYTES // MIB + 4))


async def test_read_stops_at_its_bound_and_drops_the_connection() -> None:
    pool = UpstreamPool()
    try:
        async with TinyUpstream(endless) as server:
            response = await pool.request(server.url, "GET", "/v1/models", headers=[], body=b"")
            with pytest.raises(UpstreamProtocolError, match="over"):
                await response.read()
            assert pool.stats().backends[server.url].active == 0
            small = await pool.request(server.url, "GET", "/small", headers=[], body=b"")
            assert await small.read(limit=2) == b"ok"
            big = await pool.request(server.url, "GET", "/big", headers=[], body=b"")
            with pytest.raises(UpstreamProtocolError, match="over 1048576 bytes"):
                await big.read(limit=MIB)
    finally:
        await pool.aclose()
