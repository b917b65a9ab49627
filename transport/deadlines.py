"""The request body at the ASGI seam, for the listener that does not handle it itself: its
deadline, and the close that follows an answer given before it arrived.

hypercorn (the TLS listener) bounds a request head with its idle timer, but once the head is
parsed nothing bounds how long the body takes: a client that sends a byte now and then holds
the request, and the app's task waiting in `receive()`, for ever. `with_body_deadline` gives each
request `timeout` seconds from its start to deliver the whole body; past it the client gets
408 (when no response has begun) and the app gets `http.disconnect`, and whatever the app sends
afterwards is dropped. Our own listeners (`h1_protocol`, `h3_session`) keep the deadline in their
connection or stream timers instead, at no cost per message.

hypercorn's HTTP/1.1 closes a connection whose response ended before the request's body had
arrived (an error that needed none: 401, 404), without saying so in the response: a keep-alive
client then sends its next request into a closed connection. Such a response gets
`connection: close` here, so the client opens a new one. (Our HTTP/1.1 listener reads and drops
the rest of the body and keeps the connection; HTTP/2 streams need neither.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from transport.asgi import ASGIApp, Message, Receive, Scope, Send

_DISCONNECT: Message = {"type": "http.disconnect"}
_TIMEOUT_BODY = b"request body not received in time\n"
_TIMEOUT_HEAD: Message = {
    "type": "http.response.start",
    "status": 408,
    "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"%d" % len(_TIMEOUT_BODY)),
        (b"connection", b"close"),
    ],
}


def with_body_deadline(
    app: ASGIApp, timeout: float, on_timeout: Callable[[str], None] | None = None
) -> ASGIApp:
    """Wrap `app` so that each HTTP request's body must arrive within `timeout` seconds."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # a request with no body has none to leave unread (and the app need not ask for it)
        state = {"body_done": not _has_body(scope), "started": False, "late": False}

        async def timed_receive() -> Message:
            if state["body_done"] or state["late"]:
                return await receive() if not state["late"] else _DISCONNECT
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                state["late"] = True
                if on_timeout is not None:
                    on_timeout("body")
                if not state["started"]:
                    state["started"] = True
                    await send(_TIMEOUT_HEAD)
                    await send({"type": "http.response.body", "body": _TIMEOUT_BODY})
                return _DISCONNECT
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_done"] = True
            return message

        async def guarded_send(message: Message) -> None:
            if state["late"]:
                return  # the 408 answered the request
            if message["type"] == "http.response.start":
                state["started"] = True
                if not state["body_done"] and scope.get("http_version") == "1.1":
                    headers = [*message.get("headers", ()), (b"connection", b"close")]
                    message = {**message, "headers": headers}
            await send(message)

        await app(scope, timed_receive, guarded_send)

    return wrapped


def _has_body(scope: Scope) -> bool:
    """Whether the request says a body follows (RFC 9112 §6.3: a length above 0, or chunked).
    Over HTTP/2 a body needs no `content-length` (RFC 9113 §8.1: DATA frames until the stream
    ends), so only a length of 0 says there is none; a request that ended with its headers
    hands the app its empty body at the first `receive`."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return scope.get("http_version") == "2"
