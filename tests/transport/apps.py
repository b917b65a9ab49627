"""Small ASGI apps for transport tests: they record what the transport handed them."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from transport.asgi import Receive, Scope, Send


@dataclass
class Seen:
    path: str
    method: str
    extensions: dict[str, Any]
    http_version: str
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    disconnected: bool = False


@dataclass
class RecordingApp:
    """Routes: /echo (body + scope facts as JSON), /stream?n=N (N chunks, one per release),
    /hold (answers headers, then waits for http.disconnect), /big (20 kB body)."""

    seen: list[Seen] = field(default_factory=list)
    disconnects: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    release: asyncio.Queue[None] = field(default_factory=asyncio.Queue)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        seen = Seen(
            path=scope["path"],
            method=scope["method"],
            extensions=dict(scope.get("extensions") or {}),
            http_version=scope["http_version"],
            headers=list(scope["headers"]),
        )
        self.seen.append(seen)
        if scope["path"] == "/hold":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            seen.disconnected = True
            await self.disconnects.put(scope["path"])
            return
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                seen.disconnected = True
                await self.disconnects.put(scope["path"])
                return
            seen.body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if scope["path"] == "/big":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"x" * 20_000})
            return
        if scope["path"] == "/stream":
            n = int(scope["query_string"].decode().partition("=")[2] or 3)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(n):
                await self.release.get()
                await send({"type": "http.response.body", "body": b"%d;" % i, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        payload = json.dumps(
            {
                "path": scope["path"],
                "early_data": seen.extensions.get("early_data"),
                "transport": seen.extensions.get("transport"),
                "handshake_wait_s": seen.extensions.get("handshake_wait_s"),
                "body_bytes": len(seen.body),
                "http_version": scope["http_version"],
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})


async def ok_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers 200 `ok` and keeps nothing of the request."""
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def collector_finds() -> Iterator[list[object]]:
    """What the garbage collector finds inside the block is kept (DEBUG_SAVEALL), not freed:
    the list yielded holds it after the block and one last collection. Reference counting
    frees everything else at once, so what is found was left in a reference cycle."""
    found: list[object] = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
