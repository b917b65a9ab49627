"""The client's HTTP/2 stream priorities are ignored (RFC 9113 §5.3.2): hypercorn kept every
PRIORITY in a tree it never pruned, and a connection whose tree filled, looped or grew deep
ended, or hung with its requests in flight. A raw h2 client over TLS to the real listener."""

from __future__ import annotations

import asyncio

import pytest

from certs import DevCertificates
from tests.transport.test_request_cap import _Answers, _Client, _serving
from transport.tls import TlsMaterial


@pytest.mark.parametrize("shape", ["idle-streams", "loop", "finished-parents"])
async def test_priorities_neither_end_nor_hang_the_connection(
    tls: TlsMaterial, dev_certs: DevCertificates, shape: str
) -> None:
    app = _Answers()
    listener = await _serving(tls, app, max_requests=0)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        held = client.get("/hold")
        await asyncio.wait_for(app.holding.wait(), 5)
        if shape == "idle-streams":  # 1,001 entries: past the tree's 1,000
            # after 200 requests, so that so many PRIORITY frames are not a flood of them
            for _ in range(4):  # 50 at a time: the connection takes 100 at once
                done = [client.get("/one") for _ in range(50)]
                await client.until_done(*done)
            for i in range(1001):
                client.conn.prioritize(1001 + 2 * i)
        elif shape == "loop":  # a chain of 111, then its head made a child of its tail
            for i in range(111):
                client.conn.prioritize(1001 + 2 * i, depends_on=999 + 2 * i if i else 0)
            client.conn.prioritize(1001, depends_on=1001 + 2 * 110)
        client.writer.write(client.conn.data_to_send())
        if shape == "finished-parents":  # each request depends on the one before, finished
            parent = held
            for _ in range(1001):
                stream = client.get("/one")
                client.conn.prioritize(stream, depends_on=parent, exclusive=True)
                client.writer.write(client.conn.data_to_send())
                await client.until_done(stream)
                assert client.whole(stream)
                parent = stream
        app.release.set()
        after = client.get("/after")
        await client.until_done(held, after)
        assert client.whole(held) and client.whole(after)
        assert client.goaways == [] and client.refused == {}
    finally:
        app.release.set()
        await listener.stop()
