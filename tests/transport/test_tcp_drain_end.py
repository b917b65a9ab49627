"""The TLS listener's drain running out with answers still streaming: the connections end as
the listener asked, quietly. They were logged as asyncio errors with tracebacks (HTTP/1.1: the
cancelled connection task read by 3.11's stream callback; HTTP/2: hypercorn's idle timer
restarted in its cancelled task group, "TaskGroup is shutting down"), and on HTTP/2 the error
escaped `stop()` itself."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import h2.config
import h2.connection
import pytest

from certs.dev import DevCertificates
from transport.tcp import TcpListener, TcpOptions
from transport.tls import CertificateFiles, TlsMaterial


async def endless(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
    while True:
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("alpn", ["http/1.1", "h2"])
async def test_a_drain_that_runs_out_ends_streams_without_errors(
    dev_certs: DevCertificates, alpn: str, caplog: pytest.LogCaptureFixture
) -> None:
    tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))
    listener = TcpListener(endless, host="127.0.0.1", port=0, tls=tls,
                           options=TcpOptions(graceful_timeout=0.2))  # fmt: skip
    await listener.start()
    context = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
    context.set_alpn_protocols([alpn])
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", listener.port, ssl=context, server_hostname="localhost"
    )
    try:
        if alpn == "h2":
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            conn.send_headers(1, [(":method", "GET"), (":path", "/"), (":scheme", "https"),
                                  (":authority", "localhost")], end_stream=True)  # fmt: skip
            writer.write(conn.data_to_send())
        else:
            writer.write(b"GET / HTTP/1.1\r\nhost: localhost\r\n\r\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(100), 5)  # the stream is under way
        caplog.set_level(logging.ERROR)
        await asyncio.wait_for(listener.stop(), 5)  # returns: nothing escapes it
        await asyncio.sleep(0.05)  # callbacks of the ended connection tasks run
    finally:
        writer.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
