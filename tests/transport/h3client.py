"""A small HTTP/3 test client on aioquic (a *client*: not our server stack), with 0-RTT."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StreamReset,
)
from aioquic.tls import SessionTicket

from tests.helpers import wait_until


@dataclass
class Response:
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)
    reset_code: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    first_data: asyncio.Event = field(default_factory=asyncio.Event)
    arrivals: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n == name), None)


class H3Client(QuicConnectionProtocol):
    def __init__(self, quic: QuicConnection, *args: Any, **kwargs: Any) -> None:
        super().__init__(quic, *args, **kwargs)
        self.quic = quic  # aioquic's own reference (`_quic`) is private
        self.h3 = H3Connection(quic)
        self.responses: dict[int, Response] = {}
        self.handshake: HandshakeCompleted | None = None
        self.handshake_done = asyncio.Event()
        self.terminated: ConnectionTerminated | None = None
        self.goaway_seen = False

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.handshake = event
            self.handshake_done.set()
        elif isinstance(event, ConnectionTerminated):
            self.terminated = event
            for r in self.responses.values():
                r.done.set()
        elif isinstance(event, StreamReset) and event.stream_id in self.responses:
            r = self.responses[event.stream_id]
            r.reset_code = event.error_code
            r.done.set()
        for h3_event in self.h3.handle_event(event):
            r = self.responses.get(getattr(h3_event, "stream_id", -1))
            if r is None:
                continue
            if isinstance(h3_event, HeadersReceived):
                r.status = int(dict(h3_event.headers)[b":status"])
                r.headers = [(n, v) for n, v in h3_event.headers if not n.startswith(b":")]
            elif isinstance(h3_event, DataReceived):
                if h3_event.data:
                    r.body += h3_event.data
                    r.chunks.append(h3_event.data)
                    r.arrivals.put_nowait(h3_event.data)
                    r.first_data.set()
            if getattr(h3_event, "stream_ended", False):
                r.done.set()

    def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: Sequence[tuple[bytes, bytes]] = (),
        end: bool = True,
        raw_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> int:
        """Send a request (without transmitting: the caller decides when) and return its id."""
        stream_id = self.quic.get_next_available_stream_id()
        self.responses[stream_id] = Response()
        fields = raw_headers or [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", b"localhost"),
            (b":path", path.encode()),
            *headers,
        ]
        self.h3.send_headers(stream_id, fields, end_stream=not body and end)
        if body:
            self.h3.send_data(stream_id, body, end_stream=end)
        return stream_id

    def send_now(self) -> None:
        self.transmit()

    def reset(self, stream_id: int, code: int = 0x10C) -> None:
        """Cancel a request (RFC 9114 §4.1.2): RESET_STREAM and STOP_SENDING."""
        self.quic.reset_stream(stream_id, code)
        self.quic.stop_stream(stream_id, code)
        self.transmit()

    async def fetch(self, method: str, path: str, timeout: float = 10.0, **kw: Any) -> Response:
        stream_id = self.request(method, path, **kw)
        self.transmit()
        return await self.wait(stream_id, timeout)

    async def wait(self, stream_id: int, timeout: float = 10.0) -> Response:
        r = self.responses[stream_id]
        await asyncio.wait_for(r.done.wait(), timeout)
        return r


def client_config(
    ca_cert: Any, ticket: SessionTicket | None = None, token: bytes = b""
) -> QuicConfiguration:
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
    config.load_verify_locations(str(ca_cert))
    config.session_ticket = ticket
    config.token = token  # an address token from an earlier connection's NEW_TOKEN
    return config


@asynccontextmanager
async def h3_connect(
    port: int,
    ca_cert: Any,
    *,
    ticket: SessionTicket | None = None,
    tickets: list[SessionTicket] | None = None,
    wait_connected: bool = True,
    host: str = "127.0.0.1",
    token: bytes = b"",
    tokens: list[bytes] | None = None,
) -> AsyncIterator[H3Client]:
    """Connect; with ``ticket`` and ``wait_connected=False`` requests go out in 0-RTT. Address
    tokens the server sends (NEW_TOKEN) go to ``tokens``; ``token`` is presented."""
    sink = tickets if tickets is not None else []
    token_sink = tokens if tokens is not None else []
    async with connect(
        host,
        port,
        configuration=client_config(ca_cert, ticket, token),
        create_protocol=H3Client,
        session_ticket_handler=sink.append,
        token_handler=token_sink.append,
        wait_connected=wait_connected,
    ) as client:
        assert isinstance(client, H3Client)
        yield client


@asynccontextmanager
async def h3_connect_from(source: str, port: int, ca_cert: Any) -> AsyncIterator[H3Client]:
    """Connect to 127.0.0.1 from the loopback address `source` (aioquic's `connect` always
    binds the wildcard address, so the server would see 127.0.0.1)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((source, 0))
    quic = QuicConnection(configuration=client_config(ca_cert))
    transport, protocol = await loop.create_datagram_endpoint(lambda: H3Client(quic), sock=sock)
    client = cast(H3Client, protocol)
    try:
        client.connect(("127.0.0.1", port))
        await client.wait_connected()
        yield client
    finally:
        client.close()
        await client.wait_closed()
        transport.close()


async def fresh_ticket(port: int, ca_cert: Any, host: str = "127.0.0.1") -> SessionTicket:
    """A full handshake that makes one request and returns the ticket the server issued."""
    tickets: list[SessionTicket] = []
    async with h3_connect(port, ca_cert, tickets=tickets, host=host) as client:
        r = await client.fetch("GET", "/echo")
        assert r.status == 200
        # NEW_SESSION_TICKET travels in the server's handshake-completion flight.
        await wait_until(lambda: bool(tickets))
    return tickets[-1]
