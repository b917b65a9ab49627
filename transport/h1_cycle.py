"""One HTTP/1.1 request and its response, for ``h1_protocol.H1Protocol``.

`_Cycle` is the request's ASGI channel: ``receive`` hands the app the body the connection has
buffered (sending ``100 Continue`` when the client waits for it), ``send`` and the
``quicedge.body_writer`` extension (``write_head`` / ``write_body``, no await) frame the
response by hand (RFC 9112 §6: content-length, or chunked where the app gave no framing), each
ASGI message at most one socket write. ``quicedge.on_disconnect`` calls back when the client
goes away before the response is complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from transport.asgi import Message

if TYPE_CHECKING:
    from transport.h1_protocol import H1Protocol

DISCARD_MAX = 1024 * 1024
"""Body bytes read and dropped, after a response that did not wait for them, to keep the
connection (RFC 9112 §9.6); past them it closes. An answer to a request whose declared body
has more than this still to come says `connection: close`."""

_DISCONNECT: Message = {"type": "http.disconnect"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    return f"HTTP/1.1 {status} {reason}\r\n".encode()


_STATUS_LINES = {s.value: _status_line(s.value) for s in HTTPStatus}


class _Cycle:
    """One request and its response."""

    __slots__ = (
        "body",
        "body_bytes",
        "body_done",
        "chunked",
        "chunks",
        "complete",
        "continued",
        "declared",
        "disconnected",
        "discarded",
        "expect_100",
        "finished",
        "head_only",
        "http_10",
        "keep_alive",
        "left",
        "on_gone",
        "proto",
        "received",
        "scope",
        "started",
        "waiter",
    )

    def __init__(self, proto: H1Protocol, scope: dict[str, Any], *, keep_alive: bool) -> None:
        self.proto = proto
        self.scope = scope
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.received = 0  # request-body bytes parsed, kept or not
        self.chunks = 0  # chunks of a chunked request body parsed
        self.declared = -1  # the request's content-length; -1: none
        self.complete = False  # the whole request body has arrived
        self.discarded = -1  # answered before its body arrived: the body bytes dropped since
        self.body_done = False  # ... and has been handed to the app
        self.expect_100 = False
        self.continued = False
        self.head_only = scope["method"] == "HEAD"
        self.http_10 = scope["http_version"] == "1.0"
        self.keep_alive = keep_alive
        self.started = False
        self.finished = False
        self.disconnected = False
        self.chunked = False
        self.left = -1  # body bytes still owed under the app's content-length; -1: none given
        self.waiter: asyncio.Future[None] | None = None
        self.on_gone: Callable[[], None] | None = None

    def notify_disconnect(self, callback: Callable[[], None] | None) -> None:
        """The ``quicedge.on_disconnect`` extension: `callback` runs if the client goes away."""
        self.on_gone = callback

    def gone(self) -> None:
        """The client went away (or its request broke off) before the response was complete."""
        self.disconnected = True
        self.wake()
        callback, self.on_gone = self.on_gone, None
        if callback is not None:
            callback()

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def receive(self) -> Message:
        while True:
            if self.disconnected or self.finished:
                return _DISCONNECT
            if self.body or (self.complete and not self.body_done):
                body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
                self.body.clear()
                self.body_bytes = 0
                self.body_done = self.complete
                self.proto.body_consumed()
                return {"type": "http.request", "body": body, "more_body": not self.complete}
            if self.expect_100 and not self.continued and not self.started:
                # RFC 9110 §10.1.1: the app asked for the body, so tell the client to send it.
                self.continued = True
                self.proto.write(_CONTINUE)
            self.waiter = self.proto.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            # Written at once: holding it back one loop turn to share a write with the first
            # body chunk measured no better (docs/benchmarks.md, "Edge-added latency").
            self.write_head(message)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        more = message.get("more_body", False)
        if not self.write_body(message.get("body", b""), more) or (
            not more and self.proto.write_paused
        ):
            # The last one too: what the client has not taken stays the app's to account for
            # (a non-streamed answer is counted in the edge's budget until `send` returns).
            await self.proto.drained()

    def write_head(self, start: Message, body: bytes = b"", more: bool = True) -> bool:
        """`http.response.start` and the first `http.response.body` in one write (the
        ``quicedge.body_writer`` extension)."""
        if self.started:
            raise RuntimeError("http.response.start sent twice")
        head = self._head(int(start["status"]), start.get("headers") or ())
        self.started = True  # after _head: a bad header still leaves room for a 500
        return self._write(head, body, more)

    def write_body(self, body: bytes, more: bool = True) -> bool:
        """`http.response.body` without an await (the ``quicedge.body_writer`` extension):
        False when the client's buffer is full and the caller must await `drained()`."""
        if not self.started or self.finished:
            raise RuntimeError("http.response.body outside a response")
        return self._write(b"", body, more)

    def _write(self, head: bytes, body: bytes, more: bool) -> bool:
        if self.disconnected:
            return True  # nothing to wait for: the app learns of it from receive()
        out = head
        if self.chunked:
            if body:
                out += b"%x\r\n%b\r\n" % (len(body), body)
            if not more:
                out += b"0\r\n\r\n"
        elif not self.head_only:
            out += body
            if self.left >= 0:
                self.left -= len(body)
                if self.left < 0 or (not more and self.left):
                    # The client would read the wrong bytes as the next response: close instead.
                    self.proto.close()
                    raise RuntimeError("response body does not match its content-length")
        if out:
            self.proto.write(out)
        if not more:
            self.finished = True
            self.wake()
            self.proto.finish(self)
            return True
        return not self.proto.write_paused

    async def drained(self) -> None:
        await self.proto.drained()

    def _head(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
        """The response head, with framing (RFC 9112 §6) added where the app gave none."""
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
        framed = False
        close = not self.keep_alive or self.proto.server.draining
        if self.expect_100 and not self.continued:
            close = True  # its body was never asked for: the connection cannot go on after it
        elif not self.complete and self.declared - self.received > DISCARD_MAX:
            close = True  # more body to come than is worth reading to keep the connection
        for name, value in headers:
            if b"\n" in name or b"\r" in name or b"\n" in value or b"\r" in value:
                raise ValueError("CR or LF in a response header")  # response splitting
            lname = name.lower()
            if lname == b"connection":
                close = close or b"close" in value.lower()
                continue
            if lname == b"content-length":
                framed = True
                self.left = int(value)
            elif lname == b"transfer-encoding":
                framed = self.chunked = True  # the app asked for chunked: we encode it
            parts.append(b"%b: %b\r\n" % (name, value))
        no_body = self.head_only or status < 200 or status in (204, 304)
        if no_body:
            self.chunked = False
            self.head_only = True  # 1xx, 204, 304: whatever body the app sends is dropped
        elif not framed:
            if self.http_10:
                close = True  # RFC 9112 §6.3 (8): the body ends when the connection closes
            else:
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
        if close:
            self.keep_alive = False
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)
