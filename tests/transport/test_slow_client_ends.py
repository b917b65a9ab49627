"""A client that takes none of an answer whose end has already been written.

The send timeout is timed on a write that waits, and the last write of an answer does not wait:
it hands everything to the transport and the app returns. What the transport still holds must
be bounded all the same, or a client that never reads would keep it, and its connection under
the caps, for ever: on our HTTP/1.1 listener a connection closed after its answer
(`connection: close`, HTTP/1.0) waits for its buffer to drain before it lets go, and over
HTTP/3 a stream whose response ended keeps its unacknowledged bytes (and its place among the
connection's streams) until the client takes them. Each is cut off after `send_timeout`.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aioquic.h3.connection import ErrorCode
from prometheus_client import CollectorRegistry

from tests.helpers import wait_until
from tests.transport.conftest import H3Factory
from tests.transport.h3client import h3_connect
from transport.aioquic_private import unacked_bytes
from transport.h1_server import H1Listener
from transport.h3_session import H3Limits
from transport.metrics import TransportMetrics
from transport.tcp import TcpListener, TcpOptions

ANSWER = 16 * 1024 * 1024
"""Far more than the kernel's socket buffers take on loopback (a few MB)."""


class WholeAnswer:
    """Answers every request with one `ANSWER`-byte body in a single last message: the app's
    sends never wait, and it returns at once."""

    def __init__(self, size: int = ANSWER) -> None:
        self.size = size
        self.returned = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = [(b"content-length", b"%d" % self.size)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"x" * self.size, "more_body": False})
        self.returned.set()


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        b"GET / HTTP/1.0\r\nhost: x\r\n\r\n",
    ],
    ids=["connection-close", "http-1.0"],
)
@pytest.mark.parametrize("kind", ["h1", "hypercorn"])
async def test_a_closing_connection_whose_client_takes_none_is_cut_off(
    kind: str, request_line: bytes
) -> None:
    """The answer is written whole and the connection closes after it: a client that reads
    none of it is cut off after the send timeout, and the connection leaves the listener."""
    app = WholeAnswer()
    timeouts: list[str] = []
    options = TcpOptions(send_timeout=0.5)
    served: H1Listener | TcpListener
    if kind == "h1":
        served = H1Listener(app, host="127.0.0.1", port=0, options=options)
        served.on_timeout = timeouts.append
    else:
        served = TcpListener(app, host="127.0.0.1", port=0, options=options,
                             on_timeout=timeouts.append)  # fmt: skip
    await served.start()
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", served.port))
        sock.sendall(request_line)  # and never reads
        await asyncio.wait_for(app.returned.wait(), 5)
        await wait_until(lambda: timeouts == ["send"], timeout=10)
        if isinstance(served, H1Listener):
            await wait_until(lambda: not served.connections, timeout=5)
    finally:
        sock.close()
        await served.stop()


def withhold_credit(client: Any) -> None:
    """The client acknowledges what it receives but never raises its flow-control limits
    (MAX_STREAM_DATA, MAX_DATA): the answer stops at its windows."""
    client.quic._write_stream_limits = lambda *args, **kwargs: None
    client.quic._write_connection_limits = lambda *args, **kwargs: None


async def test_an_http3_answer_ended_while_the_client_grants_no_credit_is_reset(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """The response ended (FIN written) with most of it still held for a client that grants no
    credit: after the send timeout the stream is reset, which frees what it held."""
    app = WholeAnswer(3 * 1024 * 1024)  # past the client's windows (1 MiB each)
    registry = CollectorRegistry()
    async with h3_server(
        app=app, limits=H3Limits(send_timeout=0.5), metrics=TransportMetrics(registry)
    ) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as client:
            withhold_credit(client)
            stream_id = client.request("GET", "/whole")
            client.transmit()
            await asyncio.wait_for(app.returned.wait(), 5)
            response = client.responses[stream_id]
            await asyncio.wait_for(response.done.wait(), 10)
            assert response.reset_code == ErrorCode.H3_REQUEST_CANCELLED
            assert len(response.body) < app.size
            (protocol,) = server.connections()
            # the reset acknowledged, the stream is gone, and with it what it held
            await wait_until(lambda: unacked_bytes(protocol.quic, stream_id) == 0, timeout=5)
    sent = registry.get_sample_value(
        "quicedge_request_timeouts_total", {"listener": "h3", "phase": "send"}
    )
    assert sent == 1
