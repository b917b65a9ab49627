"""TCP listeners over real sockets: HTTP/2 and HTTP/1.1 over TLS with Alt-Svc, plain HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl

import httpx
import pytest

from certs import DevCertificates
from tests.transport.apps import RecordingApp
from transport.asgi import Receive, Scope, Send
from transport.tcp import TcpListener, alt_svc_value
from transport.tls import TlsMaterial


@pytest.mark.parametrize(("http2", "name"), [(True, "h2"), (False, "h1")])
async def test_tls_listener_serves_h2_and_h1_with_alt_svc(
    tls: TlsMaterial, dev_certs, http2: bool, name: str
) -> None:
    app = RecordingApp()
    listener = TcpListener(app, host="127.0.0.1", port=0, tls=tls, alt_svc_port=4433)
    await listener.start()
    try:
        ctx = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
        async with httpx.AsyncClient(http2=http2, http1=not http2, verify=ctx) as client:
            r = await client.post(f"https://localhost:{listener.port}/echo", content=b"abc")
            r2 = await client.get(f"https://localhost:{listener.port}/missing-is-fine")
    finally:
        await listener.stop()
    assert r.status_code == 200
    assert r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    assert r.headers["alt-svc"] == 'h3=":4433"; ma=86400'
    assert r2.headers["alt-svc"] == alt_svc_value(4433)
    view = json.loads(r.content)
    assert view["transport"] == name
    assert view["early_data"] is False
    assert view["body_bytes"] == 3


async def test_plain_http_listener(tls: TlsMaterial) -> None:
    app = RecordingApp()
    listener = TcpListener(app, host="127.0.0.1", port=0, alt_svc_port=None)
    await listener.start()
    try:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{listener.port}/echo")
    finally:
        await listener.stop()
    assert r.status_code == 200
    assert "alt-svc" not in r.headers
    assert json.loads(r.content)["transport"] == "h1"


async def test_listener_never_started_releases_its_port() -> None:
    listener = TcpListener(RecordingApp(), host="127.0.0.1", port=0)
    port = listener.port
    await listener.stop()
    again = TcpListener(RecordingApp(), host="127.0.0.1", port=port)
    await again.stop()


def _get(port: int, ctx: ssl.SSLContext, session: ssl.SSLSession | None) -> ssl.SSLSocket:
    """One HTTP/1.1 request over a new TLS connection, its response read to the end (the
    session tickets come after the handshake)."""
    sock = ctx.wrap_socket(
        socket.create_connection(("127.0.0.1", port), timeout=10),
        server_hostname="localhost",
        session=session,
    )
    sock.sendall(b"GET /echo HTTP/1.1\r\nhost: localhost\r\n\r\n")
    response = http.client.HTTPResponse(sock)
    response.begin()
    assert response.status == 200 and response.read()
    return sock


async def test_tls_listener_issues_one_ticket_and_resumes_with_it(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """TLS 1.3 over TCP: one session ticket per connection (OpenSSL's default is two), and a
    new connection that presents it is resumed."""
    tickets: list[object] = []

    def on_message(conn: object, direction: str, version: object, kind: object, msg: object,
                   data: bytes) -> None:  # fmt: skip
        if direction == "read" and msg == ssl._TLSMessageType.NEWSESSION_TICKET:  # type: ignore[attr-defined]
            tickets.append(msg)

    ctx = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
    ctx.set_alpn_protocols(["http/1.1"])
    ctx._msg_callback = on_message  # type: ignore[attr-defined]
    listener = TcpListener(RecordingApp(), host="127.0.0.1", port=0, tls=tls)
    await listener.start()
    try:
        first = await asyncio.to_thread(_get, listener.port, ctx, None)
        assert first.version() == "TLSv1.3" and not first.session_reused
        assert len(tickets) == 1
        second = await asyncio.to_thread(_get, listener.port, ctx, first.session)
        assert second.session_reused
        second.close()
    finally:
        first.close()
        await listener.stop()


async def test_an_answer_that_leaves_the_body_unread_says_it_closes(tls: TlsMaterial) -> None:
    """hypercorn's HTTP/1.1 closes a connection whose answer came before the request's body: the
    answer says so (`connection: close`), so a keep-alive client opens a new connection for its
    next request instead of losing it. A request that was read, or had no body, keeps it."""

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "POST" and scope["path"] == "/read":
            while (await receive()).get("more_body"):
                pass
        status = 200 if scope["path"] == "/read" or scope["method"] == "GET" else 404
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    listener = TcpListener(refuse, host="127.0.0.1", port=0)
    await listener.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listener.port}") as client:
            refused = await client.post("/nope", content=b"x" * 100_000)
            assert refused.status_code == 404 and refused.headers["connection"] == "close"
            after = await client.get("/any")  # on a new connection: not lost
            assert after.status_code == 200 and "connection" not in after.headers
            read = await client.post("/read", content=b"x" * 100_000)
            assert read.status_code == 200 and "connection" not in read.headers
    finally:
        await listener.stop()
