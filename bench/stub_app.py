"""An instant SGLang-shaped streaming answer as an ASGI app: no backend, no proxy.

Served behind the transport listeners it measures what the protocols alone cost (handshakes and
round trips), the floor under any TTFT through the edge. Tests use it as a known answer.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

WORDS = ["Hello", " from", " the", " stub", " server", "."]


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


async def stub_app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """ASGI: any POST streams `chat_events` at once; the body's "prompt_tokens" sets the usage.

    The `x-stub-*` headers tell the client which HTTP version and whether early data carried
    the request (from the transport's ASGI extensions)."""
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
        (b"x-quicedge-backend", b"stub"),
        (b"x-stub-http-version", scope.get("http_version", "?").encode()),
        (b"x-stub-early-data", b"1" if extensions.get("early_data") else b"0"),
        (b"x-stub-transport", str(extensions.get("transport", "?")).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for event in chat_events(int(request.get("prompt_tokens", 7)), 3):
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
