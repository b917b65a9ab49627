"""HTTP/3 listener basics over real sockets: scope, body, streaming, limits, malformed requests."""

from __future__ import annotations

import asyncio
import json

from tests.transport.apps import RecordingApp, collector_finds, ok_app
from tests.transport.conftest import H3Factory
from tests.transport.h3client import h3_connect
from transport.asgi import Receive, Scope, Send
from transport.h3_protocol import _StreamChannel


async def test_request_scope_and_body(h3_server: H3Factory, dev_certs) -> None:
    app = RecordingApp()
    async with h3_server(app=app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        r = await c.fetch("POST", "/echo?x=1", body=b"hello" * 1000)
    assert r.status == 200
    data = json.loads(r.body)
    assert data == {
        "path": "/echo",
        "early_data": False,
        "transport": "h3",
        "handshake_wait_s": 0.0,
        "body_bytes": 5000,
        "http_version": "3",
    }
    assert (b"host", b"localhost") in app.seen[0].headers


async def test_the_body_writer_sends_a_whole_response_with_its_head(
    h3_server: H3Factory, dev_certs
) -> None:
    """`quicedge.body_writer` over HTTP/3: HEADERS, DATA and FIN from one `write_head`."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        writer = scope["extensions"]["quicedge.body_writer"]
        await receive()
        start = {"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]}
        assert writer.write_head(start, b"data: 1\n\n", more=False)

    async with h3_server(app=app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        for _ in range(2):  # the connection serves the next request
            r = await c.fetch("GET", "/")
            assert r.status == 200 and r.header(b"x-a") == b"1" and r.body == b"data: 1\n\n"


async def test_the_disconnect_callback_runs_when_the_client_resets_the_stream(
    h3_server: H3Factory, dev_certs
) -> None:
    calls: list[str] = []
    started = asyncio.Event()
    done = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["extensions"]["quicedge.on_disconnect"](lambda: calls.append(scope["path"]))
        writer = scope["extensions"]["quicedge.body_writer"]
        writer.write_head({"type": "http.response.start", "status": 200, "headers": []}, b"a")
        started.set()
        while (await receive())["type"] != "http.disconnect":
            pass
        done.set()

    async with h3_server(app=app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        stream_id = c.request("GET", "/leave")
        c.send_now()
        await asyncio.wait_for(started.wait(), 5)
        c.reset(stream_id)
        await asyncio.wait_for(done.wait(), 5)
    assert calls == ["/leave"]


async def test_a_served_request_leaves_no_reference_cycle(h3_server: H3Factory, dev_certs) -> None:
    """What a request's stream channel holds is freed by reference counting when it is done, not
    left for the garbage collector, whose every collection stalls every request in flight."""
    with collector_finds() as found:
        async with h3_server(app=ok_app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
            for _ in range(3):
                assert (await c.fetch("POST", "/echo", body=b"ab")).status == 200
    assert [o for o in found if isinstance(o, _StreamChannel)] == []
