"""Real servers for the bench tests: the stub streaming app served by hypercorn (TLS, ALPN h2 and
http/1.1, or plain http) and by the edge's own HTTP/3 listener (0-RTT with single-use tickets).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from bench.stub_app import stub_app
from certs import DevCertificates
from tests.helpers import async_wait_for_tcp
from transport.h3_server import H3Server
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial


@asynccontextmanager
async def hypercorn_server(certs: DevCertificates | None, port: int) -> AsyncIterator[None]:
    """hypercorn on 127.0.0.1:port serving `stub_app`: TLS (ALPN h2, http/1.1) when `certs` are
    given, plain http otherwise."""
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    if certs is not None:
        config.certfile = str(certs.cert)
        config.keyfile = str(certs.key)
        config.alpn_protocols = ["h2", "http/1.1"]
    config.accesslog = None
    config.errorlog = None
    stop = asyncio.Event()
    task = asyncio.create_task(hypercorn_serve(stub_app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    try:
        await async_wait_for_tcp("127.0.0.1", port)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@asynccontextmanager
async def edge_h3(certs: DevCertificates, app: Any = None) -> AsyncIterator[H3Server]:
    """The edge's own HTTP/3 listener (single-use tickets in memory) serving `stub_app`."""
    tls = TlsMaterial(CertificateFiles(certs.cert, certs.key))
    server = H3Server(app or stub_app, tls=tls, tickets=MemoryTicketStore())
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.aclose()
