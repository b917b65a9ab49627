"""Small real servers for the bench tests: an SSE-streaming ASGI app under hypercorn (TLS, h2 and
http/1.1) and a minimal aioquic HTTP/3 server that issues single-use session tickets (0-RTT).

The H3 server stands in until the edge's own H3 listener can be started from tests; it speaks
real QUIC and HTTP/3, so the bench client is exercised exactly as against the edge.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from aioquic.asyncio import serve
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import HandshakeCompleted, ProtocolNegotiated, QuicEvent
from aioquic.tls import SessionTicket
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from certs import DevCertificates

WORDS = ["Hello", " from", " the", " test", " server", "."]


def chat_events(prompt_tokens: int, cached_tokens: int) -> list[bytes]:
    """An SGLang-shaped chat completion stream: role chunk, content chunks, usage, [DONE]."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {
            "id": "t",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": word}) for word in WORDS]
    events.append(chunk({}, "stop"))
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(WORDS),
        "total_tokens": prompt_tokens + len(WORDS),
        "prompt_tokens_details": {"cached_tokens": cached_tokens} if cached_tokens else None,
    }
    events.append(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


async def sse_app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """ASGI: any POST streams `chat_events`; the body's "prompt_tokens" sets the usage."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    request = json.loads(body or b"{}")
    headers = [
        (b"content-type", b"text/event-stream"),
        (b"x-quicedge-backend", b"test-backend"),
        (b"x-test-http-version", scope.get("http_version", "?").encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for event in chat_events(int(request.get("prompt_tokens", 7)), 3):
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@asynccontextmanager
async def hypercorn_tls(certs: DevCertificates, port: int) -> AsyncIterator[None]:
    """hypercorn on 127.0.0.1:port with TLS (ALPN h2 and http/1.1) serving `sse_app`."""
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.certfile = str(certs.cert)
    config.keyfile = str(certs.key)
    config.alpn_protocols = ["h2", "http/1.1"]
    config.accesslog = None
    config.errorlog = None
    stop = asyncio.Event()
    task = asyncio.create_task(hypercorn_serve(sse_app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    try:
        from tests.helpers import async_wait_for_tcp

        await async_wait_for_tcp("127.0.0.1", port)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


class _H3Server(QuicConnectionProtocol):
    """Answers every request with `chat_events`; headers tell whether it arrived in 0-RTT."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._h3: H3Connection | None = None
        self._handshake_done = False
        self._early: dict[int, bool] = {}
        self._bodies: dict[int, bytes] = {}

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated) and event.alpn_protocol in H3_ALPN:
            self._h3 = H3Connection(self._quic)
        elif isinstance(event, HandshakeCompleted):
            self._handshake_done = True
        if self._h3 is None:
            return
        for h3_event in self._h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                # A request seen before the handshake completed came in 0-RTT (see aioquic notes).
                self._early[h3_event.stream_id] = not self._handshake_done
                self._bodies[h3_event.stream_id] = b""
                if h3_event.stream_ended:
                    self._respond(h3_event.stream_id)
            elif isinstance(h3_event, DataReceived):
                self._bodies[h3_event.stream_id] = (
                    self._bodies.get(h3_event.stream_id, b"") + h3_event.data
                )
                if h3_event.stream_ended:
                    self._respond(h3_event.stream_id)

    def _respond(self, stream_id: int) -> None:
        assert self._h3 is not None
        request = json.loads(self._bodies.pop(stream_id) or b"{}")
        early = self._early.pop(stream_id, False)
        self._h3.send_headers(
            stream_id,
            [
                (b":status", b"200"),
                (b"content-type", b"text/event-stream"),
                (b"x-quicedge-backend", b"test-backend"),
                (b"x-test-early-data", b"1" if early else b"0"),
            ],
        )
        events = chat_events(int(request.get("prompt_tokens", 7)), 3)
        for event in events[:-1]:
            self._h3.send_data(stream_id, event, end_stream=False)
        self._h3.send_data(stream_id, events[-1], end_stream=True)
        self.transmit()


class TicketVault:
    """Single-use server-side ticket store (RFC 8446 §8.1)."""

    def __init__(self) -> None:
        self.tickets: dict[bytes, SessionTicket] = {}
        self.fetched = 0

    def add(self, ticket: SessionTicket) -> None:
        self.tickets[ticket.ticket] = ticket

    def pop(self, label: bytes) -> SessionTicket | None:
        self.fetched += 1
        return self.tickets.pop(label, None)


@asynccontextmanager
async def aioquic_h3(certs: DevCertificates, port: int) -> AsyncIterator[TicketVault]:
    config = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    config.load_cert_chain(str(certs.cert), str(certs.key))
    vault = TicketVault()
    server = await serve(
        "127.0.0.1",
        port,
        configuration=config,
        create_protocol=_H3Server,
        session_ticket_fetcher=vault.pop,
        session_ticket_handler=vault.add,
    )
    try:
        yield vault
    finally:
        server.close()
