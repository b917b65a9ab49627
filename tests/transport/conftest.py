"""Transport test fixtures: an H3 server on a free port with a recording app."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from certs import DevCertificates
from tests.helpers import free_port
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


class PrivateRedis:
    """A redis-server of one test's own, so the test may stop it."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is required (run `make test`)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail("private redis-server did not start")
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    try:
        yield server
    finally:
        server.stop()
