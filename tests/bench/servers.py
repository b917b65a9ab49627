"""Real servers for the bench tests: the stub streaming app behind the edge's own listeners: TCP
(hypercorn; TLS with ALPN h2 and http/1.1, or plain http) and HTTP/3 (0-RTT, single-use tickets).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from bench.stub_app import stub_app
from certs import DevCertificates
from tests.helpers import async_wait_for_tcp
from transport.h3_server import H3Server
from transport.metrics import TransportMetrics
from transport.tcp import TcpListener
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial


@asynccontextmanager
async def edge_tcp(certs: DevCertificates | None, app: Any = None) -> AsyncIterator[TcpListener]:
    """The edge's own TCP listener on a free port serving `stub_app`: TLS (ALPN h2, http/1.1)
    when `certs` are given, plain HTTP/1.1 otherwise."""
    tls = TlsMaterial(CertificateFiles(certs.cert, certs.key)) if certs is not None else None
    listener = TcpListener(app or stub_app, host="127.0.0.1", port=0, tls=tls)
    await listener.start()
    try:
        await async_wait_for_tcp("127.0.0.1", listener.port)
        yield listener
    finally:
        await listener.stop()


@asynccontextmanager
async def edge_h3(
    certs: DevCertificates, app: Any = None, metrics: TransportMetrics | None = None
) -> AsyncIterator[H3Server]:
    """The edge's own HTTP/3 listener (single-use tickets in memory) serving `stub_app`."""
    tls = TlsMaterial(CertificateFiles(certs.cert, certs.key))
    server = H3Server(app or stub_app, tls=tls, tickets=MemoryTicketStore(), metrics=metrics)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.aclose()
