"""A request line of a later HTTP/1.x (`HTTP/1.2`) is served as HTTP/1.1 on both TCP listeners
(RFC 9112 §2.3: a recipient processes a higher minor version within major version 1 as the
highest it conforms to, and answers with its own version); other major versions get `505`.
Raw sockets against the plain listener (`h1_server`, llhttp) and the TLS one (hypercorn, h11)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from certs import DevCertificates
from transport.asgi import Receive, Scope, Send
from transport.h1_server import H1Listener
from transport.tcp import TcpListener, TcpOptions
from transport.tls import TlsMaterial

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class _VersionApp:
    """Answers each request with the `http_version` of its scope."""

    def __init__(self) -> None:
        self.versions: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        self.versions.append(scope["http_version"])
        await receive()
        body = scope["http_version"].encode()
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def _listening(
    kind: str, app: _VersionApp, tls: TlsMaterial, dev_certs: DevCertificates
) -> AsyncIterator[Connect]:
    listener: H1Listener | TcpListener
    context: ssl.SSLContext | None = None
    if kind == "plain":
        listener = H1Listener(app, host="127.0.0.1", port=0, options=TcpOptions())
    else:
        listener = TcpListener(app, host="127.0.0.1", port=0, tls=tls, options=TcpOptions())
        context = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
        context.set_alpn_protocols(["http/1.1"])
    await listener.start()
    writers: list[asyncio.StreamWriter] = []

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host = "localhost" if context is not None else None
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", listener.port, ssl=context, server_hostname=host
        )
        writers.append(writer)
        return reader, writer

    try:
        yield connect
    finally:
        for writer in writers:
            writer.close()
        await listener.stop()


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, int, bytes]:
    """The next answer's status line's version and status, and its body (by content-length)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.split(b"\r\n")
    version, status = lines[0].split(b" ")[:2]
    size = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            size = int(value)
    body = await asyncio.wait_for(reader.readexactly(size), 5)
    return version, int(status), body


@pytest.mark.parametrize("kind", ["plain", "tls"])
@pytest.mark.parametrize("minor", [b"2", b"9"])
async def test_a_later_http1_minor_version_is_served_as_http11_and_kept_alive(
    tls: TlsMaterial, dev_certs: DevCertificates, kind: str, minor: bytes
) -> None:
    app = _VersionApp()
    async with _listening(kind, app, tls, dev_certs) as connect:
        reader, writer = await connect()
        writer.write(b"GET /a HTTP/1.%s\r\nHost: x\r\n\r\n" % minor)
        assert await _answer(reader) == (b"HTTP/1.1", 200, b"1.1")
        writer.write(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection: kept alive
        assert await _answer(reader) == (b"HTTP/1.1", 200, b"1.1")
    assert app.versions == ["1.1", "1.1"]


@pytest.mark.parametrize("kind", ["plain", "tls"])
@pytest.mark.parametrize("version", [b"2.0", b"3.0", b"9.9", b"0.9"])
async def test_another_major_version_is_refused_505(
    tls: TlsMaterial, dev_certs: DevCertificates, kind: str, version: bytes
) -> None:
    app = _VersionApp()
    async with _listening(kind, app, tls, dev_certs) as connect:
        reader, writer = await connect()
        writer.write(b"GET /a HTTP/%s\r\nHost: x\r\n\r\n" % version)
        assert (await _answer(reader))[1] == 505
    assert app.versions == []


@pytest.mark.parametrize("kind", ["plain", "tls"])
async def test_a_later_http1_minor_version_without_host_is_refused_as_http11_would_be(
    tls: TlsMaterial, dev_certs: DevCertificates, kind: str
) -> None:
    """RFC 9112 §3.2: served as HTTP/1.1, it needs its Host header (h11 asks it of 1.1 only)."""
    app = _VersionApp()
    async with _listening(kind, app, tls, dev_certs) as connect:
        reader, writer = await connect()
        writer.write(b"GET /a HTTP/1.2\r\n\r\n")
        assert (await _answer(reader))[1] == 400
    assert app.versions == []
