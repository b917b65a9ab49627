"""Keep-alive HTTP/1.1 connection pool to the backends (the upstream hot path).

One `UpstreamPool` serves every backend. Per backend it keeps idle keep-alive connections (used
most-recently-first, closed after `idle_timeout`), and bounds the number of open connections at
`max_connections_per_backend`: a request that finds the cap reached waits for a free slot.

Each connection is a small `asyncio.Protocol` around an `h11.Connection`. Bytes the backend sends
are buffered by the protocol and handed to h11 only when the consumer asks for the next event, so
a slow consumer pauses reading from the socket instead of growing a buffer without bound.

A response that is closed before its body is complete closes its connection: that is how an
upstream request is aborted (the backend sees the disconnect). TCP_NODELAY is set on every socket:
the request goes out in one write and must not wait for Nagle's algorithm (RFC 896) to release it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import h11

from backends.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

log = logging.getLogger(__name__)

READ_HIGH_WATER = 256 * 1024  # buffered unread bytes above which the socket is paused
# Hop-by-hop headers (RFC 9110 §7.6.1) and framing headers the pool sets itself.
_DROP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"host",
    }
)


@dataclass(slots=True)
class BackendPoolStats:
    idle: int
    active: int
    waiting: int


@dataclass(slots=True)
class PoolStats:
    requests: int
    reused: int
    connects: int
    backends: dict[str, BackendPoolStats] = field(default_factory=dict)

    @property
    def reuse_ratio(self) -> float:
        """Share of requests that were sent on an already open (warm) connection."""
        return self.reused / self.requests if self.requests else 0.0


class _Connection(asyncio.Protocol):
    """One TCP connection to a backend and its h11 state."""

    def __init__(self, host: _Host) -> None:
        self.host = host
        self.h11 = h11.Connection(our_role=h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.received_any = False  # any byte of the current response arrived
        self._buf = bytearray()
        self._eof = False
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self.idle_handle: asyncio.TimerHandle | None = None
        # One timer per connection for the first-byte and chunk timeouts, re-armed lazily:
        # a wait only moves the deadline, where a timer per wait (one per streamed chunk)
        # would cost a heap insert and a cancel each time.
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an asyncio.Transport subclass: uvloop's
        # TCPTransport is not one, and an isinstance assert here would leave us without it.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.h11.our_state is h11.IDLE:
            # RFC 9112 §9.3: a server must not send a response nobody asked for; the
            # connection can no longer be trusted to frame the next response.
            self.close()
            return
        self.received_any = True
        self._buf += data
        if len(self._buf) > READ_HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        self._eof = True
        self._wake()
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        if not self.closed:
            self.closed = True
            self.host.on_connection_lost(self)
        self._wake()

    # -- used by the pool ------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def usable(self) -> bool:
        return not self.closed and not self._eof and self.h11.our_state is h11.IDLE

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.received_any = False
        self.transport.write(data)

    def take_buffered(self) -> bytes:
        """The bytes received and not yet consumed (for a body decoded outside h11)."""
        data = bytes(self._buf)
        self._buf.clear()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def poll_event(self) -> Any:
        """The next h11 event from bytes already received, or `h11.NEED_DATA`; never waits.

        A pending EOF is left for `next_event`, so an error is raised only by a call that
        could not have returned data instead."""
        conn = self.h11
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA or not self._buf:
                return event
            data = bytes(self._buf)
            self._buf.clear()
            if self._paused and self.transport is not None:
                self._paused = False
                self.transport.resume_reading()
            conn.receive_data(data)

    async def next_event(self, timeout: float | None, what: str) -> Any:
        """The next h11 event, reading from the socket as needed."""
        conn = self.h11
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            if self._buf:
                data = bytes(self._buf)
                self._buf.clear()
                if self._paused and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                conn.receive_data(data)
                continue
            if self._eof:
                conn.receive_data(b"")  # h11 turns a premature EOF into RemoteProtocolError
                continue
            await self._wait(timeout, what)

    async def _wait(self, timeout: float | None, what: str) -> None:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiter = waiter
        if timeout is not None:
            deadline = self._deadline = loop.time() + timeout
            if self._timer is None or self._timer_at > deadline:
                self._arm(loop, deadline)
        try:
            await waiter
        except TimeoutError:
            raise UpstreamTimeout(
                f"no {what} from {self.host.base_url} within {timeout:g}s",
                base_url=self.host.base_url,
            ) from None
        finally:
            self._waiter = None
            self._deadline = None  # the timer, if it fires now, finds nothing to expire

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._on_timer)
        self._timer_at = when

    def _on_timer(self) -> None:
        self._timer = None
        deadline, waiter = self._deadline, self._waiter
        if deadline is None or waiter is None or waiter.done():
            return  # no wait in progress: the next one arms the timer again
        loop = asyncio.get_running_loop()
        # Timers may fire a little early (the loop's clock resolution, libuv's milliseconds).
        if deadline - loop.time() <= 0.001:
            waiter.set_exception(TimeoutError())
        else:
            self._arm(loop, deadline)  # the deadline moved on since the timer was set

    def close(self) -> None:
        if self.idle_handle is not None:
            self.idle_handle.cancel()
            self.idle_handle = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.abort()
        if not self.closed:
            self.closed = True
            self.host.on_connection_lost(self)
        self._eof = True
        self._wake()


# RFC 9112 §7.1: chunk-size [chunk-ext] CRLF; the same grammar h11 accepts (1-20 hex digits, any
# extension after `;`, optional trailing whitespace).
_CHUNK_HEADER = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*", re.DOTALL)
MAX_CHUNK_LINE = 16 * 1024  # a chunk header or trailer line longer than this is refused


class _ChunkedBody:
    """Incremental decoder of a chunked response body (RFC 9112 §7.1).

    h11 yields one event per chunk, through its state machine; this decodes every chunk in the
    bytes at hand in one pass, which is most of what the relay costs per token. The pool uses it
    for chunked responses only (what SGLang streams with); h11 still writes the request and
    parses the status line and headers. Trailer fields are read and dropped, as before.
    """

    __slots__ = ("_left", "_pending", "_state", "done", "error", "extra")

    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)

    def __init__(self) -> None:
        self._pending = b""  # an incomplete chunk header, CRLF or trailer line
        self._left = 0  # bytes of the current chunk's data still to come
        self._state = self._SIZE
        self.done = False
        """The last chunk and the trailer section were read."""
        self.extra = False
        """Bytes followed the end of the body (nothing was asked for: never reuse)."""
        self.error: h11.RemoteProtocolError | None = None
        """A framing error, found after the data `feed` returned with it."""

    def feed(self, data: bytes) -> bytes:
        """The chunk data in `data` (may be empty). A framing error raises
        `h11.RemoteProtocolError`, or, when data came before it, is kept in `error` so that
        the data is relayed first."""
        out: list[bytes] = []
        try:
            self._decode(data, out)
        except h11.RemoteProtocolError as exc:
            if not any(out):
                raise
            self.error = exc
        return b"".join(out) if len(out) != 1 else out[0]

    def _decode(self, data: bytes, out: list[bytes]) -> None:
        buf = self._pending + data if self._pending else data
        self._pending = b""
        pos, end = 0, len(buf)
        while pos < end:
            state = self._state
            if state == self._DATA:
                take = min(self._left, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = self._DATA_END
            elif state == self._DATA_END:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise h11.RemoteProtocolError("chunk data not followed by CRLF")
                pos += 2
                self._state = self._SIZE
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                line = buf[pos:eol]
                pos = eol + 2
                if state == self._SIZE:
                    match = _CHUNK_HEADER.fullmatch(line)
                    if match is None:
                        raise h11.RemoteProtocolError(f"bad chunk header {line[:40]!r}")
                    self._left = int(match.group(1), 16)
                    self._state = self._DATA if self._left else self._TRAILER
                elif not line:  # the blank line after the trailer section: the end
                    self.done = True
                    self.extra = pos < end
                    return
                elif b":" not in line:
                    raise h11.RemoteProtocolError(f"bad trailer field {line[:40]!r}")
        if pos < end:
            self._pending = buf[pos:]
            if len(self._pending) > MAX_CHUNK_LINE:
                raise h11.RemoteProtocolError("chunk header or trailer line too long")


class _Host:
    """The connections of one backend: idle ones (LIFO), the active count and the waiters."""

    def __init__(self, pool: UpstreamPool, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"backend URL must be http://host[:port], got {base_url!r}")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"backend URL must not have a path or query, got {base_url!r}")
        self.pool = pool
        self.base_url = base_url
        self.hostname = parts.hostname
        self.port = parts.port or 80
        self.host_header = parts.netloc.encode("ascii")
        self.idle: collections.deque[_Connection] = collections.deque()
        self.active = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.all: set[_Connection] = set()

    @property
    def open_count(self) -> int:
        return self.active + len(self.idle)

    def on_connection_lost(self, conn: _Connection) -> None:
        """The connection closed (either side): free its slot."""
        if conn not in self.all:
            return
        self.all.discard(conn)
        try:
            self.idle.remove(conn)
        except ValueError:
            self.active -= 1
        self.wake_one()

    def wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.pool.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.hostname, self.port
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"connect to {self.base_url} timed out after {self.pool.connect_timeout:g}s",
                base_url=self.base_url,
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(
                f"connect to {self.base_url} failed: {exc}", base_url=self.base_url
            ) from exc
        self.pool._connects += 1
        self.all.add(conn)
        return conn

    async def acquire(self) -> tuple[_Connection, bool]:
        """A connection for one request and whether it was reused. Takes one active slot."""
        while True:
            while self.idle:
                conn = self.idle.pop()
                if conn.idle_handle is not None:
                    conn.idle_handle.cancel()
                    conn.idle_handle = None
                if conn.usable():
                    self.active += 1
                    return conn, True
                # Closed by the backend while idle (its keep-alive timeout): drop it.
                self.idle.append(conn)
                conn.close()
            if self.open_count < self.pool.max_connections_per_backend:
                self.active += 1
                try:
                    conn = await self.connect()
                except BaseException:
                    self.active -= 1
                    self.wake_one()
                    raise
                return conn, False
            waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self.wake_one()  # pass on the slot we were given
                raise

    def release(self, conn: _Connection, *, decoded_outside: bool = False) -> None:
        """The response is complete: keep the connection if HTTP allows it, else close it.

        `decoded_outside`: the body was read by `_ChunkedBody`, not h11, and the response allows
        keep-alive; h11 never saw the body, so the next request gets a fresh h11 state."""
        if conn.closed:
            return
        h = conn.h11
        if decoded_outside and h.our_state is h11.DONE and not conn._buf and not conn._eof:
            conn.h11 = h11.Connection(our_role=h11.CLIENT)
            self._keep(conn)
        elif h.our_state is h11.DONE and h.their_state is h11.DONE:
            h.start_next_cycle()
            self._keep(conn)
        else:
            conn.close()

    def _keep(self, conn: _Connection) -> None:
        self.active -= 1
        self.idle.append(conn)
        conn.idle_handle = asyncio.get_running_loop().call_later(self.pool.idle_timeout, conn.close)
        self.wake_one()

    def stats(self) -> BackendPoolStats:
        waiting = sum(1 for w in self.waiters if not w.done())
        return BackendPoolStats(idle=len(self.idle), active=self.active, waiting=waiting)


class UpstreamResponse:
    """Status and headers of a backend response; the body is read by iterating."""

    __slots__ = (
        "_body",
        "_chunk_timeout",
        "_conn",
        "_done",
        "_host",
        "_keep_alive",
        "_pending",
        "headers",
        "reused",
        "status",
    )

    def __init__(
        self,
        *,
        host: _Host,
        conn: _Connection,
        status: int,
        headers: list[tuple[bytes, bytes]],
        reused: bool,
        chunk_timeout: float | None,
        body: _ChunkedBody | None = None,
        keep_alive: bool = True,
    ) -> None:
        self._host = host
        self._body = body
        self._keep_alive = keep_alive
        self._conn: _Connection | None = conn
        self._chunk_timeout = chunk_timeout
        self._done = False
        self._pending: h11.RemoteProtocolError | None = None
        self.status = status
        self.headers = headers
        self.reused = reused

    @property
    def complete(self) -> bool:
        """True once the whole body was received."""
        return self._done

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        """All body bytes received so far (at least one), waiting only when there are none.

        Chunks that arrived together come back as one: a consumer that fell behind (a busy
        edge, a burst of tokens) catches up with one write to its client instead of one per
        chunk, and nothing that has arrived waits for anything that has not."""
        conn = self._conn
        if conn is None:
            raise StopAsyncIteration
        if self._body is not None:
            return await self._next_decoded(conn, self._body)
        while True:
            try:
                if self._pending is not None:
                    raise self._pending
                event = await conn.next_event(self._chunk_timeout, "body chunk")
            except UpstreamError:
                self._abort()
                raise
            except h11.RemoteProtocolError as exc:
                self._abort()
                raise UpstreamProtocolError(
                    f"{self._host.base_url} broke off the response body: {exc}",
                    base_url=self._host.base_url,
                ) from None
            if type(event) is h11.Data:
                if event.data:
                    return self._with_buffered(conn, bytes(event.data))
                continue
            if type(event) is h11.EndOfMessage:
                self._finish(conn)
                raise StopAsyncIteration
            self._abort()  # ConnectionClosed or anything unexpected mid-body
            raise UpstreamProtocolError(
                f"{self._host.base_url} closed the connection mid-body",
                base_url=self._host.base_url,
            )

    async def _next_decoded(self, conn: _Connection, body: _ChunkedBody) -> bytes:
        """`__anext__` for a chunked body: every chunk at hand, decoded in one pass."""
        while True:
            data = conn.take_buffered()
            try:
                if body.error is not None:
                    raise body.error
                out = body.feed(data) if data else b""
            except h11.RemoteProtocolError as exc:
                self._abort()
                raise UpstreamProtocolError(
                    f"{self._host.base_url} broke off the response body: {exc}",
                    base_url=self._host.base_url,
                ) from None
            if body.done:
                self._done = True
                self._conn = None
                if body.extra or not self._keep_alive:
                    conn.close()
                else:
                    self._host.release(conn, decoded_outside=True)
                if out:
                    return out
                raise StopAsyncIteration
            if out:
                return out
            if conn._eof:
                self._abort()
                raise UpstreamProtocolError(
                    f"{self._host.base_url} broke off the response body: the connection closed"
                    " before the last chunk",
                    base_url=self._host.base_url,
                )
            try:
                await conn._wait(self._chunk_timeout, "body chunk")
            except UpstreamError:
                self._abort()
                raise

    def _with_buffered(self, conn: _Connection, first: bytes) -> bytes:
        """`first` and the body bytes already buffered behind it, without waiting."""
        parts: list[bytes] | None = None
        while True:
            try:
                event = conn.poll_event()
            except h11.RemoteProtocolError as exc:
                self._pending = exc  # raised by the next call, after this data is relayed
                break
            if type(event) is h11.Data:
                if parts is None:
                    parts = [first]
                parts.append(event.data)
                continue
            if type(event) is h11.EndOfMessage:
                self._finish(conn)  # the next call ends the iteration
            elif event is not h11.NEED_DATA:
                # ConnectionClosed or anything unexpected: let the next call find it.
                self._pending = h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
            break
        return first if parts is None else b"".join(parts)

    def _finish(self, conn: _Connection) -> None:
        self._done = True
        self._conn = None
        self._host.release(conn)

    async def read(self) -> bytes:
        """The whole (remaining) body."""
        return b"".join([chunk async for chunk in self])

    def _abort(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def aclose(self) -> None:
        """Body incomplete: close the connection (aborts the upstream request). Idempotent."""
        self._abort()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._abort()

    def __repr__(self) -> str:
        state = "complete" if self._done else ("open" if self._conn else "closed")
        return f"<UpstreamResponse {self.status} {state} reused={self.reused}>"


def _chunked(headers: list[tuple[bytes, bytes]]) -> bool:
    # h11 refuses any transfer coding but chunked, and chunked wins over content-length
    # (RFC 9112 §6.3), so a response h11 accepted with this header has a chunked body.
    return any(name == b"transfer-encoding" for name, _ in headers)


def _keep_alive(event: h11.Response) -> bool:
    """h11's rule: HTTP/1.1 and no `Connection: close`."""
    if event.http_version < b"1.1":
        return False
    for name, value in event.headers:
        if name == b"connection" and b"close" in value.lower():
            return False
    return True


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to every backend, bounded per backend."""

    def __init__(
        self,
        *,
        max_connections_per_backend: int = 128,
        idle_timeout: float = 60.0,
        connect_timeout: float = 2.0,
    ) -> None:
        if max_connections_per_backend < 1:
            raise ValueError("max_connections_per_backend must be at least 1")
        if idle_timeout <= 0 or connect_timeout <= 0:
            raise ValueError("idle_timeout and connect_timeout must be positive")
        self.max_connections_per_backend = max_connections_per_backend
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self._hosts: dict[str, _Host] = {}
        self._requests = 0
        self._reused = 0
        self._connects = 0
        self._closed = False

    def _host(self, base_url: str) -> _Host:
        host = self._hosts.get(base_url)
        if host is None:
            if self._closed:
                raise UpstreamConnectError("the upstream pool is closed", base_url=base_url)
            host = self._hosts[base_url] = _Host(self, base_url.rstrip("/"))
        return host

    async def warm(self, base_url: str, count: int) -> None:
        """Open up to `count` idle connections (within the cap). Failures are logged, not raised."""
        host = self._host(base_url)
        want = min(count, self.max_connections_per_backend) - host.open_count
        if want <= 0:
            return
        host.active += want  # reserve the slots while connecting
        connects = [host.connect() for _ in range(want)]
        results = await asyncio.gather(*connects, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for result in results:
            if isinstance(result, _Connection):
                if result.closed:
                    continue  # its slot was already freed by on_connection_lost
                host.active -= 1
                host.idle.append(result)
                result.idle_handle = loop.call_later(self.idle_timeout, result.close)
            else:
                host.active -= 1
                log.warning("warming %s: %s", base_url, result)
        host.wake_one()

    @staticmethod
    def _encode(
        host: _Host,
        conn: _Connection,
        method: str,
        path: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
    ) -> bytes:
        out_headers = [(b"host", host.host_header), (b"content-length", b"%d" % len(body))]
        for name, value in headers:
            if name.lower() not in _DROP_HEADERS:
                out_headers.append((name, value))
        try:
            h = conn.h11
            data = h.send(h11.Request(method=method, target=path, headers=out_headers))
            if body:
                data += h.send(h11.Data(data=body))
            data += h.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            conn.close()
            raise ValueError(f"invalid upstream request: {exc}") from None
        return data

    async def request(
        self,
        base_url: str,
        method: str,
        path: str,
        *,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        first_byte_timeout: float | None = None,
        chunk_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Send one request; return once the status line and headers arrived."""
        host = self._host(base_url)
        self._requests += 1
        for attempt in (0, 1):
            conn, reused = await host.acquire()
            try:
                conn.send(self._encode(host, conn, method, path, headers, body))
                while True:
                    event = await conn.next_event(first_byte_timeout, "response")
                    if type(event) is h11.Response:
                        break
                    if type(event) is h11.InformationalResponse:
                        continue  # 1xx (RFC 9110 §15.2): the final response follows
                    raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
            except (UpstreamError, h11.RemoteProtocolError, OSError, ValueError) as exc:
                stale = reused and not conn.received_any and conn._eof
                conn.close()
                if stale and attempt == 0 and not isinstance(exc, UpstreamTimeout):
                    # The backend closed this idle connection just as we reused it (its
                    # keep-alive timeout raced our request); nothing was processed, so a
                    # fresh connection is safe (RFC 9112 §9.3.1).
                    continue
                if isinstance(exc, UpstreamError | ValueError):
                    raise
                raise UpstreamProtocolError(
                    f"{base_url} failed before the response head: {exc}", base_url=base_url
                ) from None
            except BaseException:
                conn.close()  # cancelled: the request may be half sent
                raise
            if reused:
                self._reused += 1
            headers = list(event.headers)
            decoder = None
            if method != "HEAD" and event.status_code not in (204, 304) and _chunked(headers):
                # h11 accepted the head; the body is decoded outside it, starting with the
                # bytes h11 already holds beyond the head.
                decoder = _ChunkedBody()
                conn._buf[:0] = conn.h11.trailing_data[0]
            return UpstreamResponse(
                host=host,
                conn=conn,
                status=event.status_code,
                headers=headers,
                reused=reused,
                chunk_timeout=chunk_timeout,
                body=decoder,
                keep_alive=_keep_alive(event),
            )
        raise AssertionError("unreachable")

    def stats(self) -> PoolStats:
        return PoolStats(
            requests=self._requests,
            reused=self._reused,
            connects=self._connects,
            backends={url: host.stats() for url, host in self._hosts.items()},
        )

    async def aclose(self) -> None:
        """Close every connection; requests in flight see UpstreamProtocolError."""
        self._closed = True
        for host in self._hosts.values():
            for conn in list(host.all):
                conn.close()
            for waiter in host.waiters:
                if not waiter.done():
                    waiter.set_exception(
                        UpstreamConnectError("the upstream pool is closed", base_url=host.base_url)
                    )
        self._hosts.clear()

    def __repr__(self) -> str:
        parts = [f"{u}: {h.active} active, {len(h.idle)} idle" for u, h in self._hosts.items()]
        return f"<UpstreamPool {'; '.join(parts) or 'empty'}>"


__all__ = ["BackendPoolStats", "PoolStats", "UpstreamPool", "UpstreamResponse"]
