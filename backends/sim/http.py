"""A small HTTP/1.1 server: asyncio `Protocol` + h11, keep-alive, chunked streaming.

Why not a framework: the stand-in must stream thousands of tokens per second on one core, and
the only HTTP features it needs are keep-alive, bounded bodies, chunked responses with a
flush per chunk, and noticing a client that goes away (to abort its request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from time import perf_counter
from typing import cast

import h11

log = logging.getLogger("backends.sim.http")

MAX_HEADER_BYTES = 64 * 1024
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    query: str
    headers: list[tuple[bytes, bytes]]  # lowercase names
    body: bytes
    read_at: float
    """`perf_counter()` of the socket read that completed the request (benchmarks split
    latency with it; a pipelined request gets the latest read before it was parsed)."""

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class Responder:
    """Answers one request. Writes never block the loop; they wait while the socket is full."""

    __slots__ = ("_chunked", "_proto", "disconnected", "on_disconnect", "on_done", "started")

    def __init__(self, proto: HttpProtocol) -> None:
        self._proto = proto
        self._chunked = False
        self.started = False
        self.disconnected = False
        self.on_disconnect: Callable[[], object] | None = None
        self.on_done: Callable[[], object] | None = None
        """Called once the handler has returned or failed: the answer is written or abandoned."""

    async def send(
        self, status: int, body: bytes, content_type: bytes = b"application/json"
    ) -> None:
        """A whole response with a Content-Length."""
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
        await self.start(status, headers)
        await self.write(body)
        await self.end()

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The response head. Without a Content-Length the body is streamed: chunked for an
        HTTP/1.1 client (framed here, the hot path), close-delimited for HTTP/1.0 (by h11)."""
        self.started = True
        if self._proto.peer_http11 and not any(k == b"content-length" for k, _ in headers):
            headers = [*headers, (b"transfer-encoding", b"chunked")]
            self._chunked = True
        self._proto.send_event(
            h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b""))
        )

    async def write(self, data: bytes) -> None:
        if data:
            await self._proto.writable()
            if self._chunked:
                # RFC 9112 §7.1 chunk; h11 only frames the last chunk (EndOfMessage).
                self._proto.write_raw(b"%x\r\n%b\r\n" % (len(data), data))
            else:
                self._proto.send_event(h11.Data(data=data))

    async def end(self) -> None:
        self._proto.send_event(h11.EndOfMessage())


Handler = Callable[[HttpRequest, Responder], Awaitable[None]]


class HttpProtocol(asyncio.Protocol):
    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        keep_alive: float,
        connections: set[HttpProtocol],
    ) -> None:
        self._handler = handler
        self._max_body = max_body_bytes
        self._keep_alive = keep_alive
        self._connections = connections
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self._transport: asyncio.Transport | None = None
        self._request: h11.Request | None = None
        self._body = bytearray()
        self._read_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._responder: Responder | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._can_write: asyncio.Future[None] | None = None
        self._closed = False

    # -- asyncio callbacks ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an asyncio.Transport subclass: uvloop's
        # TCPTransport is not one, and an isinstance assert here would leave us without it.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._connections.add(self)
        self._arm_idle_timer()

    def data_received(self, data: bytes) -> None:
        self._read_at = perf_counter()  # first, so that parsing is not counted as network time
        self._conn.receive_data(data)
        self._pump()

    def eof_received(self) -> bool:
        # A half-closed client cannot read our answer anyway: treat it as gone.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._connections.discard(self)
        self._cancel_idle_timer()
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_exception(ConnectionResetError("client went away"))
        responder = self._responder
        if responder is not None and not responder.disconnected:
            responder.disconnected = True
            if responder.on_disconnect is not None:
                responder.on_disconnect()

    def pause_writing(self) -> None:
        if self._can_write is None or self._can_write.done():
            self._can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)

    # -- writing -------------------------------------------------------------------------------

    async def writable(self) -> None:
        if self._closed:
            raise ConnectionResetError("client went away")
        if self._can_write is not None and not self._can_write.done():
            await self._can_write

    @property
    def peer_http11(self) -> bool:
        return self._request is not None and self._request.http_version == b"1.1"

    def write_raw(self, data: bytes) -> None:
        if not self._closed and self._transport is not None:
            self._transport.write(data)

    def send_event(self, event: h11.Event) -> None:
        data = self._conn.send(event)
        if data and not self._closed and self._transport is not None:
            self._transport.write(data)

    def close(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.close()

    # -- reading -------------------------------------------------------------------------------

    def _pump(self) -> None:
        while self._task is None and not self._closed:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._reject(exc.error_status_hint, str(exc))
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._cancel_idle_timer()
                self._request = event
                self._body = bytearray()
                # h11 bounds only *incomplete* heads; a complete oversize head arrives whole.
                if sum(len(k) + len(v) for k, v in event.headers) > MAX_HEADER_BYTES:
                    self._reject(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")
                    return
                length = _content_length(event.headers)
                if length is not None and length > self._max_body:
                    self._reject(413, f"request body of {length} bytes exceeds {self._max_body}")
                    return
                if self._conn.they_are_waiting_for_100_continue:
                    # curl sends `Expect: 100-continue` for bodies over 1 KiB and would
                    # otherwise wait a second before sending the body (RFC 9110 §10.1.1).
                    self.send_event(h11.InformationalResponse(status_code=100, headers=[]))
            elif isinstance(event, h11.Data):
                self._body += event.data
                if len(self._body) > self._max_body:
                    self._reject(413, f"request body exceeds {self._max_body} bytes")
                    return
            elif isinstance(event, h11.EndOfMessage):
                self._dispatch()
                return
            elif isinstance(event, h11.ConnectionClosed):
                self.close()
                return

    def _dispatch(self) -> None:
        assert self._request is not None
        target = self._request.target.decode("latin-1")
        path, _, query = target.partition("?")
        request = HttpRequest(
            method=self._request.method.decode("ascii"),
            path=path,
            query=query,
            headers=[(k.lower(), v) for k, v in self._request.headers],
            body=bytes(self._body),
            read_at=self._read_at,
        )
        self._body = bytearray()
        self._responder = Responder(self)
        self._task = asyncio.get_running_loop().create_task(self._run(request, self._responder))

    async def _run(self, request: HttpRequest, responder: Responder) -> None:
        try:
            await self._handler(request, responder)
        except (ConnectionResetError, asyncio.CancelledError):
            self.close()
            return
        except Exception:
            log.exception("handler failed for %s %s", request.method, request.path)
            if not responder.started and not self._closed:
                with contextlib.suppress(Exception):
                    await responder.send(500, b'{"error":{"message":"internal error"}}')
            self.close()
            return
        finally:
            self._task = None
            self._responder = None
            if responder.on_done is not None:
                responder.on_done()
        self._next_cycle()

    def _next_cycle(self) -> None:
        conn = self._conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            self._arm_idle_timer()
            self._pump()
        else:
            self.close()

    def _reject(self, status: int, message: str) -> None:
        """Answer a request we cannot parse or accept, then close the connection."""
        if self._conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = b'{"error":{"message":%s}}' % _json_str(message)
            with contextlib.suppress(h11.LocalProtocolError):
                self.send_event(
                    h11.Response(
                        status_code=status,
                        headers=[
                            (b"content-type", b"application/json"),
                            (b"content-length", b"%d" % len(body)),
                            (b"connection", b"close"),
                        ],
                    )
                )
                self.send_event(h11.Data(data=body))
                self.send_event(h11.EndOfMessage())
        self.close()

    # -- keep-alive ----------------------------------------------------------------------------

    def _arm_idle_timer(self) -> None:
        self._cancel_idle_timer()
        loop = asyncio.get_running_loop()
        self._idle_timer = loop.call_later(self._keep_alive, self.close)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for key, value in headers:
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _json_str(text: str) -> bytes:
    return json.dumps(text).encode()
