"""ASGI plumbing shared by the proxy and admin apps: types, error rendering, JSON, lifespan."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from edge.errors import JSON_HEADERS, EdgeError
from edge.stages.forward import new_request_id
from transport.asgi import BodyWriter

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def render_error(send: Send, err: EdgeError, writer: BodyWriter | None = None) -> None:
    """The one place an `EdgeError` becomes a response.

    Every error carries an `x-request-id`, so that a client can quote it: the app sets the
    request's own (`edge.app`: the client's when well-formed, else one it made, so that the
    access log's line names it too); an error without one, or with `-`, gets a new one. With the
    listener's
    body writer (`quicedge.body_writer`) head and body leave in one write: a flood of refusals
    (429s) then costs one system call each, not two."""
    body = err.body()
    headers = err.headers(length=len(body))
    if not any(k == b"x-request-id" and v != b"-" for k, v in headers):
        headers = [(k, v) for k, v in headers if k != b"x-request-id"]
        headers.append((b"x-request-id", new_request_id().encode()))
    start = {"type": "http.response.start", "status": err.status, "headers": headers}
    if writer is not None:
        if not writer.write_head(start, body, more=False):
            await writer.drained()
        return
    await send(start)
    await send({"type": "http.response.body", "body": body, "more_body": False})


def body_writer(scope: Scope) -> BodyWriter | None:
    """The listener's `quicedge.body_writer`, if it offers one."""
    extensions = scope.get("extensions")
    return extensions.get("quicedge.body_writer") if extensions else None


async def send_json(
    send: Send, status: int, obj: Any, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    headers = [*JSON_HEADERS, *extra, (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge lifespan events; the wiring starts and stops the fleet, not the server."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
