"""The listeners' own refusals (made before any app sees the request) carry an `x-request-id` to
quote, as the app's answers do: a fresh one in the app's format. Real sockets against the real
listeners: our HTTP/1.1 listener, hypercorn's HTTP/1.1 over TLS, and HTTP/3."""

from __future__ import annotations

import asyncio
import re
import ssl

import h2.config
import h2.connection
import h2.events
import pytest

from certs import DevCertificates
from tests.transport.apps import RecordingApp
from tests.transport.conftest import H3Factory
from tests.transport.h3client import h3_connect
from tests.transport.test_h1_server import at_eof, connect, read_response, serving
from tests.transport.test_h11_guarded import _post, _Served, served
from transport.h3_session import H3Limits
from transport.tcp import TcpListener, TcpOptions
from transport.tls import TlsMaterial

__all__ = ["served"]  # the fixture, imported for the TLS listener's tests

FRESH = re.compile(r"[0-9a-f]{32}")
"""What the app makes (`edge.stages.forward.new_request_id`)."""

H1_REFUSALS = [
    (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"GET / HTTP/2.0\r\nhost: x\r\n\r\n", 505),
    (b"GET / HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"GET / HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", 400),
]


@pytest.mark.parametrize(("request_bytes", "status"), H1_REFUSALS)
async def test_the_plain_listeners_refusals_carry_a_request_id(
    request_bytes: bytes, status: int
) -> None:
    app = RecordingApp()
    async with serving(app) as listener:
        ids = []
        for _ in range(2):
            async with connect(listener) as (reader, writer):
                writer.write(request_bytes)
                got, headers, _ = await read_response(reader)
                assert got == status
                assert FRESH.fullmatch(headers["x-request-id"]), headers
                ids.append(headers["x-request-id"])
                assert await at_eof(reader)
    assert ids[0] != ids[1]  # each answer its own
    assert app.seen == []


async def test_the_tls_listeners_http1_refusals_carry_a_request_id(served: _Served) -> None:
    framing = (b"Content-Length: 2", b"Transfer-Encoding: chunked")
    for request, status in ((_post(*framing, body=b"0\r\n\r\n"), 400),
                            (_post(body=b"", version=b"2.0"), 505)):  # fmt: skip
        answer = await served.refused(request, status)
        assert FRESH.fullmatch(answer.headers[b"x-request-id"].decode()), answer.headers


async def test_http3s_own_refusals_carry_a_request_id(h3_server: H3Factory, dev_certs) -> None:
    limits = H3Limits(max_header_bytes=2048, max_body_bytes=1000)
    app = RecordingApp()
    async with h3_server(app=app, limits=limits) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            big = await c.fetch("GET", "/echo", headers=[(b"x-big", b"a" * 8000)])
            large = await c.fetch(
                "POST", "/echo", body=b"x" * 2000, headers=[(b"content-length", b"2000")]
            )
            target = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"localhost")]
            star = await c.fetch("GET", "", raw_headers=[*target, (b":path", b"*")])
    assert (big.status, large.status, star.status) == (431, 413, 400)
    ids = [r.header(b"x-request-id") for r in (big, large, star)]
    for rid in ids:
        assert rid is not None and FRESH.fullmatch(rid.decode()), ids
    assert len(set(ids)) == 3


async def _h2_answer(port: int, ca: str, headers: list[tuple[str, str]]) -> dict[bytes, bytes]:
    """The head of the answer to one request over HTTP/2 (ALPN `h2`)."""
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["h2"])
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="localhost"
    )
    try:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(1, headers, end_stream=True)
        writer.write(conn.data_to_send())
        while True:
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data, "closed before an answer"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    assert event.headers is not None
                    return {bytes(k): bytes(v) for k, v in event.headers}
            writer.write(conn.data_to_send())
    finally:
        writer.close()


async def test_the_tls_listeners_http2_431_carries_a_request_id(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    app = RecordingApp()
    listener = TcpListener(app, host="127.0.0.1", port=0, tls=tls, options=TcpOptions())
    await listener.start()
    try:
        pseudo = [(":method", "GET"), (":path", "/a"), (":scheme", "https"), (":authority", "x")]
        head = await _h2_answer(listener.port, str(dev_certs.ca_cert),
                                [*pseudo, ("x-big", "a" * 70_000)])  # fmt: skip
    finally:
        await listener.stop()
    assert head[b":status"] == b"431"
    assert FRESH.fullmatch(head[b"x-request-id"].decode()), head
    assert app.seen == []
