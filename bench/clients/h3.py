"""HTTP/3 client on aioquic: a new QUIC connection per request or one shared connection, with
optional 0-RTT resumption from saved session tickets (RFC 9001 §4.6, RFC 8446 §2.3)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import ssl
import time
from collections import deque
from pathlib import Path
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, QuicEvent, StreamReset
from aioquic.tls import SessionTicket

from bench.clients.base import ClientOptions, StreamingClient, Target
from bench.stream import RequestResult, StreamParser, TextCallback
from transport.aioquic_private import peer_reset_token
from transport.stateless_reset import STATELESS_RESET, looks_like_reset
from transport.tickets import decode_ticket, encode_ticket

TICKET_WAIT_S = 5.0  # how long a 0-RTT client waits for the next ticket after an answer


class TicketStore:
    """What a client keeps from one connection to the next: the session tickets the server gave
    us, each used at most once (servers that protect 0-RTT against replay accept a ticket only
    once, RFC 8446 §8.1), and each server's newest address token (NEW_TOKEN, RFC 9000 §8.1.3),
    presented once. Optionally mirrored to a file."""

    def __init__(self, path: Path | None = None) -> None:
        self._tickets: deque[SessionTicket] = deque()
        self.tokens: dict[str, bytes] = {}
        """The newest address token from each server (by server name), presented once, on the
        next connection to it, as browsers do: it spares the server's limit of three times the
        bytes received before the address is validated."""
        self._path = path
        if path is not None and path.exists():
            tickets, self.tokens = load_tickets(path)
            self._tickets.extend(tickets)

    def add(self, ticket: SessionTicket) -> None:
        self._tickets.append(ticket)

    def take(self, server_name: str) -> SessionTicket | None:
        """The newest valid ticket for `server_name`, removed from the store."""
        while self._tickets:
            ticket = self._tickets.pop()
            if ticket.is_valid and ticket.server_name == server_name:
                return ticket
        return None

    def __len__(self) -> int:
        return len(self._tickets)

    def save(self) -> None:
        """Write the unused tickets and the tokens to the file, one JSON line each (mode 0600:
        a ticket holds a resumption secret)."""
        if self._path is None:
            return
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as handle:
            for ticket in self._tickets:
                handle.write(encode_ticket(ticket) + b"\n")
            for server_name, token in self.tokens.items():
                handle.write(_encode_token(server_name, token) + b"\n")


_TOKEN_KEY = "address_token"


def _encode_token(server_name: str, token: bytes) -> bytes:
    line = {_TOKEN_KEY: base64.b64encode(token).decode(), "server_name": server_name}
    return json.dumps(line, separators=(",", ":")).encode()


def load_tickets(path: Path) -> tuple[list[SessionTicket], dict[str, bytes]]:
    """The tickets and address tokens saved by `TicketStore.save`; ValueError for a file that
    is not one."""
    tickets: list[SessionTicket] = []
    tokens: dict[str, bytes] = {}
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        if _TOKEN_KEY.encode() not in line:
            tickets.append(decode_ticket(line))
            continue
        try:
            entry = json.loads(line)
            tokens[str(entry["server_name"])] = base64.b64decode(entry[_TOKEN_KEY], validate=True)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed stored address token: {exc}") from None
    return tickets, tokens


class _H3Protocol(QuicConnectionProtocol):
    """Routes HTTP/3 events to per-stream queues and remembers the handshake outcome."""

    def __init__(
        self, quic: QuicConnection, *, ticket_received: asyncio.Future[None], **kwargs: Any
    ) -> None:
        super().__init__(quic, **kwargs)
        self.quic = quic  # aioquic's own reference (`_quic`) is private
        self.ticket_received = ticket_received
        # Created now, so a 0-RTT request's HEADERS go in the client's first flight.
        self.h3 = H3Connection(quic)
        self.queues: dict[int, asyncio.Queue[Any]] = {}
        self.handshake = asyncio.get_running_loop().create_future()
        self.terminated = False

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # aioquic as it is does not recognise a stateless reset (RFC 9000 §10.3.1): a request on
        # a connection the server no longer has (it restarted) would wait out the timeout.
        if isinstance(data, bytes) and looks_like_reset(data, peer_reset_token(self.quic)):
            if not self.terminated:
                self.quic_event_received(
                    ConnectionTerminated(
                        error_code=0, frame_type=None, reason_phrase=STATELESS_RESET
                    )
                )
            return
        super().datagram_received(data, addr)

    def error_received(self, exc: Exception) -> None:
        if isinstance(exc, ConnectionRefusedError) and not self.handshake.done():
            self.handshake.set_exception(
                ConnectionRefusedError(exc.errno, "nothing listens on that UDP port")
            )
            self.handshake.exception()  # retrieved: nobody may be waiting on it (0-RTT)
        super().error_received(exc)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted) and not self.handshake.done():
            self.handshake.set_result(event.early_data_accepted)
        elif isinstance(event, ConnectionTerminated):
            self.terminated = True
            if not self.handshake.done():
                self.handshake.set_exception(
                    ConnectionError(f"QUIC connection closed: {event.reason_phrase or event}")
                )
                self.handshake.exception()  # retrieved: nobody may be waiting on it
            for queue in self.queues.values():
                queue.put_nowait(event)
        elif isinstance(event, StreamReset) and event.stream_id in self.queues:
            self.queues[event.stream_id].put_nowait(event)
        for h3_event in self.h3.handle_event(event):
            self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        stream_id = getattr(event, "stream_id", None)
        if stream_id is not None and stream_id in self.queues:
            self.queues[stream_id].put_nowait(event)


class H3Client(StreamingClient):
    transport = "h3"

    def __init__(self, options: ClientOptions, *, tickets: TicketStore | None = None) -> None:
        self._options = options
        self.tickets = tickets if tickets is not None else TicketStore()
        self._shared: tuple[_H3Protocol, asyncio.DatagramTransport] | None = None
        self._shared_early = False
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    def _configuration(self, target: Target) -> QuicConfiguration:
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
        config.server_name = target.server_name
        if self._options.insecure:
            config.verify_mode = ssl.CERT_NONE
        elif self._options.cacert:
            config.load_verify_locations(self._options.cacert)
        if self._options.zero_rtt:
            config.session_ticket = self.tickets.take(target.server_name)
        config.token = self.tickets.tokens.pop(target.server_name, b"")
        return config

    async def _open(self, target: Target) -> tuple[_H3Protocol, asyncio.DatagramTransport, bool]:
        """Open a connection. With a ticket and 0-RTT on, return before the handshake completes
        so the first request rides in early data; otherwise after it (1 RTT)."""
        if target.scheme != "https":
            raise ValueError("h3 needs an https:// URL")
        loop = asyncio.get_running_loop()
        config = self._configuration(target)
        early = config.session_ticket is not None
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_DGRAM)
        addr = infos[0][4]
        ticket_received = loop.create_future()

        def keep_ticket(ticket: SessionTicket) -> None:
            self.tickets.add(ticket)
            if not ticket_received.done():
                ticket_received.set_result(None)

        def keep_token(token: bytes) -> None:
            self.tickets.tokens[target.server_name] = token

        quic = QuicConnection(
            configuration=config, session_ticket_handler=keep_ticket, token_handler=keep_token
        )
        # A connected socket: the kernel reports an ICMP "port unreachable" to it (an
        # unconnected one never hears it), so nothing listening fails at once, not at the timeout.
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _H3Protocol(quic, ticket_received=ticket_received),
            remote_addr=(str(addr[0]), int(addr[1])),
        )
        assert isinstance(protocol, _H3Protocol)
        # the address as the transport holds it (IPv6: four fields), which its sends must match
        protocol.connect(transport.get_extra_info("peername"), transmit=not early)
        if not early:
            await protocol.handshake
        return protocol, transport, early

    def _close_later(self, protocol: _H3Protocol, transport: asyncio.DatagramTransport) -> None:
        """Close without making the caller wait out the draining period (RFC 9000 §10.2)."""

        async def close() -> None:
            protocol.close()
            try:
                await asyncio.wait_for(protocol.wait_closed(), 5.0)
            except TimeoutError:
                pass
            finally:
                transport.close()

        task = asyncio.create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _connection(
        self, result: RequestResult, target: Target
    ) -> tuple[_H3Protocol, asyncio.DatagramTransport]:
        if self._options.new_connection_per_request:
            protocol, transport, early = await self._open(target)
            result.early_data = early
            return protocol, transport
        async with self._lock:
            if self._shared is None or self._shared[0].terminated:
                protocol, transport, early = await self._open(target)
                self._shared, self._shared_early = (protocol, transport), early
                result.early_data = early
            else:
                result.reused_connection = True
            return self._shared

    async def _exchange(
        self,
        result: RequestResult,
        target: Target,
        method: str,
        headers: list[tuple[str, str]],
        body: bytes,
        on_text: TextCallback | None,
    ) -> None:
        start = result.start
        protocol, transport = await self._connection(result, target)
        if not result.early_data and not result.reused_connection:
            result.connect_s = time.perf_counter() - start
        stream_id = protocol.quic.get_next_available_stream_id()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        protocol.queues[stream_id] = queue
        try:
            request_headers = [
                (b":method", method.encode()),
                (b":scheme", b"https"),
                (b":authority", target.authority.encode()),
                (b":path", target.path.encode()),
                (b"content-length", str(len(body)).encode()),
            ] + [(k.lower().encode(), v.encode()) for k, v in headers]
            protocol.h3.send_headers(stream_id, request_headers, end_stream=not body)
            if body:
                protocol.h3.send_data(stream_id, body, end_stream=True)
            protocol.transmit()
            await self._read_response(result, queue, start, on_text)
            if result.early_data:
                accepted = await asyncio.wait_for(protocol.handshake, self._options.timeout)
                result.early_data_accepted = bool(accepted)
            if self._options.zero_rtt and self._options.new_connection_per_request:
                # A 0-RTT answer can beat the server's NewSessionTicket (sent once our Finished
                # arrives, a round trip later): wait for it, or the next request has none.
                # This is after every timestamp of the result, so it is not measured.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(protocol.ticket_received), TICKET_WAIT_S)
        finally:
            protocol.queues.pop(stream_id, None)
            if self._options.new_connection_per_request:
                self._close_later(protocol, transport)

    async def _read_response(
        self,
        result: RequestResult,
        queue: asyncio.Queue[Any],
        start: float,
        on_text: TextCallback | None,
    ) -> None:
        parser: StreamParser | None = None
        while True:
            event = await queue.get()
            now = time.perf_counter() - start
            if isinstance(event, ConnectionTerminated):
                why = f" ({event.reason_phrase})" if event.reason_phrase else ""
                raise ConnectionError(f"connection closed before the response ended{why}")
            if isinstance(event, StreamReset):
                raise ConnectionError(f"stream reset by server (error {event.error_code})")
            if isinstance(event, HeadersReceived):
                if parser is None:
                    for name, value in event.headers:
                        key, text = name.decode().lower(), value.decode()
                        if key == ":status":
                            result.status = int(text)
                        elif not key.startswith(":"):
                            result.headers.append((key, text))
                    result.headers_s = now
                    content_type = result.header("content-type") or ""
                    parser = StreamParser(
                        result, event_stream="event-stream" in content_type, on_text=on_text
                    )
                # else: trailers, ignored
            elif isinstance(event, DataReceived):
                if parser is None:
                    raise ConnectionError("DATA before HEADERS")
                if event.data:
                    parser.feed(event.data, now)
            if getattr(event, "stream_ended", False):
                if parser is None:
                    raise ConnectionError("stream ended without a response")
                parser.finish(now)
                return

    async def aclose(self) -> None:
        if self._shared is not None:
            self._close_later(*self._shared)
            self._shared = None
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)
