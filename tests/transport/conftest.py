"""Transport test fixtures: an H3 server on a free port with a recording app."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from certs import DevCertificates
from tests.transport.apps import RecordingApp
from transport.h3_server import H3Server
from transport.metrics import TransportMetrics
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial

H3Factory = Callable[..., AbstractAsyncContextManager[H3Server]]


@pytest.fixture
def tls(dev_certs: DevCertificates) -> TlsMaterial:
    return TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))


@pytest.fixture
def h3_server(tls: TlsMaterial) -> H3Factory:
    """``async with h3_server(app=..., tickets=..., ...) as server``: started on 127.0.0.1:0."""

    @asynccontextmanager
    async def factory(**kwargs: Any) -> AsyncIterator[H3Server]:
        kwargs.setdefault("app", RecordingApp())
        kwargs.setdefault("tickets", MemoryTicketStore())
        kwargs.setdefault("metrics", TransportMetrics(CollectorRegistry()))
        app = kwargs.pop("app")
        server = H3Server(app, tls=tls, **kwargs)
        await server.start("127.0.0.1", 0)
        try:
            yield server
        finally:
            await server.aclose()

    return factory
