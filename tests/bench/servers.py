"""Real servers for the bench tests: an SSE-streaming ASGI app served by hypercorn (TLS, ALPN h2
and http/1.1, or plain http) and by the edge's own HTTP/3 listener (0-RTT with single-use tickets).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from certs import DevCertificates
from tests.helpers import async_wait_for_tcp
from transport.h3_server import H3Server
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial

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
    extensions = scope.get("extensions") or {}
    headers = [
        (b"content-type", b"text/event-stream"),
        (b"x-quicedge-backend", b"test-backend"),
        (b"x-test-http-version", scope.get("http_version", "?").encode()),
        (b"x-test-early-data", b"1" if extensions.get("early_data") else b"0"),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for event in chat_events(int(request.get("prompt_tokens", 7)), 3):
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@asynccontextmanager
async def hypercorn_server(certs: DevCertificates | None, port: int) -> AsyncIterator[None]:
    """hypercorn on 127.0.0.1:port serving `sse_app`: TLS (ALPN h2, http/1.1) when `certs` are
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
    task = asyncio.create_task(hypercorn_serve(sse_app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    try:
        await async_wait_for_tcp("127.0.0.1", port)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@asynccontextmanager
async def edge_h3(certs: DevCertificates, app: Any = None) -> AsyncIterator[H3Server]:
    """The edge's own HTTP/3 listener (single-use tickets in memory) serving `sse_app`."""
    tls = TlsMaterial(CertificateFiles(certs.cert, certs.key))
    server = H3Server(app or sse_app, tls=tls, tickets=MemoryTicketStore())
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.aclose()
