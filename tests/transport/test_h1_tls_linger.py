"""HTTP/1.1 on the TLS listener: an answer given before the request's body arrived (a 413 to an
upload over the limit, a 401) reaches a client still writing that body. hypercorn closed the
connection at once with the body's bytes unread, the kernel reset it, and Python's
`http.client` got `SSLEOFError` instead of its 413, five times out of five. Real TLS sockets and
a real client against the real listener."""

from __future__ import annotations

import asyncio
import http.client
import ssl

from certs import DevCertificates
from transport.asgi import Receive, Scope, Send
from transport.tcp import TcpListener, TcpOptions
from transport.tls import TlsMaterial

BODY = b"x" * (4 << 20)
"""More than the socket buffers hold: the client is still writing when the answer comes."""


async def _refuses_unread(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers 413 without reading the body, as the edge does to an upload over its limit."""
    if scope["type"] != "http":
        return
    body = b"too large\n"
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _post(port: int, context: ssl.SSLContext) -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=BODY)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


async def test_an_answer_before_the_body_reaches_a_client_still_sending_it(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    listener = TcpListener(_refuses_unread, host="127.0.0.1", port=0, tls=tls)
    await listener.start()
    try:
        context = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
        for _ in range(2):
            assert await asyncio.to_thread(_post, listener.port, context) == (413, b"too large\n")
    finally:
        await listener.stop()


async def test_a_client_that_keeps_sending_after_the_answer_is_closed_at_the_idle_timeout(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """What it sends is read and dropped, for `head_timeout` (the idle timer) at most."""
    options = TcpOptions(head_timeout=0.5)
    listener = TcpListener(_refuses_unread, host="127.0.0.1", port=0, tls=tls, options=options)
    await listener.start()
    context = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
    context.set_alpn_protocols(["http/1.1"])
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", listener.port, ssl=context, server_hostname="localhost"
        )
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 413 ")

        async def send_forever() -> None:
            while True:
                writer.write(b"x" * 65536)
                await writer.drain()
                await asyncio.sleep(0.01)

        sender = asyncio.create_task(send_forever())
        try:
            rest = b""
            while chunk := await asyncio.wait_for(reader.read(65536), 5):
                rest += chunk
            assert rest == b"too large\n"  # then the close
        finally:
            sender.cancel()
            writer.close()
    finally:
        await listener.stop()
