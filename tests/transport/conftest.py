"""Transport test fixtures: an H3 server on a free port with a recording app."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from certs import DevCertificates
from tests.helpers import RedisServer, child_output, free_port, free_udp_port
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


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of one test's own, so the test may stop it."""
    try:
        server = RedisServer()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()


class ServeProcess:
    """``quicedge serve`` in a child process on free ports; stopped with SIGTERM."""

    def __init__(self, *args: str, ready_timeout: float = 60.0) -> None:
        self.h3_port = free_udp_port()
        self.tcp_port = free_port()
        self.admin_port = free_port()
        cmd = [
            sys.executable, "-m", "edge.cli", "serve",
            "--h3", f"127.0.0.1:{self.h3_port}",
            "--tcp", f"127.0.0.1:{self.tcp_port}",
            "--admin", f"127.0.0.1:{self.admin_port}",
            *args,
        ]  # fmt: skip
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        pending = b""
        deadline = time.monotonic() + ready_timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    self.stop()
                    pytest.fail(f"serve not ready in {ready_timeout}s: {self.lines}")
                chunk = os.read(fd, 65536)
                if not chunk:
                    pytest.fail(f"serve exited ({self.proc.wait()}): {self.lines} {self.errors()}")
                pending += chunk
                *done, pending = pending.split(b"\n")
                self.lines.extend(line.decode() for line in done)
                if "ready" in self.lines:
                    return

    def errors(self) -> str:
        return child_output(self.stderr)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def metric(self, sample: str) -> float:
        for line in self.metrics().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        raise AssertionError(f"no sample {sample}")

    def wait_metric(self, sample: str, at_least: float, timeout: float = 10.0) -> None:
        """Poll `/metrics` until `sample` reaches `at_least`."""
        deadline = time.monotonic() + timeout
        while self.metric(sample) < at_least:
            assert time.monotonic() < deadline, f"{sample} stayed under {at_least}"
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


@pytest.fixture
def serve_process() -> Iterator[Callable[..., ServeProcess]]:
    started: list[ServeProcess] = []

    def start(*args: str) -> ServeProcess:
        started.append(ServeProcess(*args))
        return started[-1]

    yield start
    for proc in started:
        proc.stop()
