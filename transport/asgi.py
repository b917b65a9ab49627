"""ASGI types shared by the listeners, and the scope extensions every transport adds.

Scope extensions (``scope["extensions"]``): ``transport`` (h3, h2, h1), ``early_data`` (the
request came in 0-RTT), ``handshake_wait_s`` (a deferred 0-RTT request waited this long for the
handshake) and, where the listener knows it, ``arrived_at``: the ``time.perf_counter()`` of the
socket read that completed the request head, so that the app can count the time the request
spent in the listener and the event loop's queue before it ran. Our HTTP/1.1 listener also
offers ``quicedge.body_writer`` (a `BodyWriter`): the response written without an await, so that
a relay can pass a chunk on from inside the upstream connection's read callback, and send the head
with whatever body bytes came with it in one write; and ``quicedge.on_disconnect``, a callback
when the client goes away mid-response.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyWriter(Protocol):
    """The ``quicedge.body_writer`` scope extension: `http.response.body` without an await."""

    def write_head(self, start: Message, body: bytes = b"", more: bool = True) -> bool:
        """`start` (an `http.response.start` message) and the first body bytes, in one write;
        False when the client's buffer is full (await `drained`)."""
        ...

    def write_body(self, body: bytes, more: bool = True) -> bool:
        """Frame and write `body`; False when the client's buffer is full (await `drained`)."""
        ...

    async def drained(self) -> None:
        """Return once the client's buffer is below its low-water mark, or it has gone."""
        ...


OnDisconnect = Callable[[Callable[[], None] | None], None]
"""The ``quicedge.on_disconnect`` scope extension: register a callback (None: unregister) that
the server calls once, from its connection-lost callback, if the client goes away before the
response is complete. An app that waits for ``http.disconnect`` needs a task to wait in; this
costs none."""


def with_tcp_extensions(app: ASGIApp) -> ASGIApp:
    """Wrap an app served by hypercorn: ``transport`` = h2/h1, ``early_data`` False.

    TLS over TCP in Python has no early-data API (stdlib ``ssl``), so nothing arrives early.
    """

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            extensions = dict(scope.get("extensions") or {})
            extensions["transport"] = "h2" if scope.get("http_version") == "2" else "h1"
            extensions["early_data"] = False
            extensions["handshake_wait_s"] = 0.0
            scope = {**scope, "extensions": extensions}
        await app(scope, receive, send)

    return wrapped
