"""Keep-alive HTTP/1.1 connection pool to the backends (the upstream hot path).

One `UpstreamPool` serves every backend. Per backend it keeps idle keep-alive connections (used
most-recently-first, closed after `idle_timeout`), and bounds the number of open connections at
`max_connections_per_backend`: a request that finds the cap reached waits for a free slot.

Each connection is a small `asyncio.Protocol` with an llhttp parser (`httptools`) that frames
its responses in C as bytes arrive; the consumer takes the body parsed so far in one piece. Once
more than `READ_HIGH_WATER` body bytes wait unread, reading from the socket pauses, so a slow
consumer does not grow a buffer without bound. Requests are written by hand, in one write, after
checking that nothing in them could be read as a second request on the wire.

A response that is closed before its body is complete closes its connection: that is how an
upstream request is aborted (the backend sees the disconnect). TCP_NODELAY is set on every socket:
the request goes out in one write and must not wait for Nagle's algorithm (RFC 896) to release it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import cast
from urllib.parse import urlsplit

import httptools

from backends.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from backends.urgent_reads import UrgentReads

log = logging.getLogger(__name__)

READ_HIGH_WATER = 256 * 1024  # buffered unread body bytes above which the socket is paused
_URGENT_READ_SIZE = 64 * 1024  # a head and first tokens; under malloc's mmap threshold
URGENT_AFTER = 0.0005
"""Seconds without any upstream read after which a request start reads the urgent sockets
itself (`UrgentReads`): a loop that polls more often serves first tokens in its own order."""
MAX_RESPONSE_HEAD = 64 * 1024  # a status line and headers longer than this are refused
# Not HEAD: a response parser does not know the request's method, and would read the body a
# HEAD response announces but never sends.
_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
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
    urgent_reads: int = 0
    """Reads of a due first token made between request starts, out of the loop's turn."""
    backends: dict[str, BackendPoolStats] = field(default_factory=dict)

    @property
    def reuse_ratio(self) -> float:
        """Share of requests that were sent on an already open (warm) connection."""
        return self.reused / self.requests if self.requests else 0.0


class _ResponseParser:
    """Sans-I/O reader of one connection's responses: llhttp (httptools) does the framing.

    llhttp checks what h11 checked (status line, header syntax, Content-Length against
    Transfer-Encoding, chunk framing) in C, and hands over each piece of body as it is parsed:
    one callback per chunk instead of a pass through a Python state machine. The callbacks only
    record; the consumer takes the body bytes gathered so far in one piece.
    """

    __slots__ = (
        "_head_bytes",
        "_informational",
        "body",
        "body_bytes",
        "done",
        "error",
        "extra",
        "head_done",
        "headers",
        "keep_alive",
        "parser",
        "status",
    )

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.reset()

    def reset(self) -> None:
        """Ready for the next response on the same connection."""
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.keep_alive = False
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.done = False  # the whole response (head and body) was parsed
        self.extra = False  # bytes followed its end: nobody asked for them, never reuse
        self.error: str | None = None
        self._informational = False
        self._head_bytes = 0

    def feed(self, data: bytes) -> None:
        if not self.head_done:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.error = "it switched protocols"
        except httptools.HttpParserError as exc:
            if self.done:
                self.extra = True  # garbage after a complete response: only reuse suffers
            else:
                self.error = str(exc) or type(exc).__name__
        if not self.head_done and self._head_bytes > MAX_RESPONSE_HEAD and self.error is None:
            self.error = f"response head over {MAX_RESPONSE_HEAD} bytes"

    def feed_eof(self) -> None:
        """The connection closed: the end of a body that runs until close (RFC 9112 §6.3 (8))."""
        if self.head_done and not self.done and self._until_close():
            self.done = True

    def _until_close(self) -> bool:
        for name, value in self.headers:
            if name == b"content-length" or (name == b"transfer-encoding" and value == b"chunked"):
                return False
        return not self.keep_alive

    def take_body(self) -> bytes:
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.body_bytes = 0
        return data

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.done:
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # after the head: trailer fields, read and dropped
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            # 1xx (RFC 9110 §15.2): llhttp ends it without a body; the final response follows.
            self._informational = True
            self.headers = []
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.body_bytes += len(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
        else:
            self.done = True


class _Connection(asyncio.Protocol):
    """One TCP connection to a backend: its transport, its parser and the consumer's waiter."""

    def __init__(self, host: _Host) -> None:
        self.host = host
        self.response = _ResponseParser()
        self.transport: asyncio.Transport | None = None
        # Kept: asyncio.get_running_loop() costs a getpid() system call each time on 3.11.
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.in_flight = False  # a request was sent and its response is not complete
        self.received_any = False  # any byte of the current response arrived
        self.unread_since = 0.0  # perf_counter() of the read that brought the oldest unread body
        self.sink: Callable[[], bool] | None = None
        """Called after each read that parsed something; True: it took care of it, the waiting
        consumer need not wake (see `UpstreamResponse.set_sink`)."""
        self.on_head: Callable[[], None] | None = None
        """Called from the read that completed the response head, before the consumer wakes."""
        self.fd = -1
        self.urgent: UrgentReads | None = None  # the set this socket is in while it is urgent
        self._wait_timeout: float | None = None
        self.eof = False
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
            self.fd = sock.fileno()

    def data_received(self, data: bytes) -> None:
        if not self.in_flight:
            # RFC 9112 §9.3: a server must not send a response nobody asked for; the
            # connection can no longer be trusted to frame the next response.
            self.close()
            return
        self.received_any = True
        response = self.response
        now = self.host.pool.last_read = time.perf_counter()
        if not response.body:
            self.unread_since = now
        response.feed(data)
        if response.body_bytes > READ_HIGH_WATER and not self._paused:
            assert self.transport is not None
            self._paused = True
            self.transport.pause_reading()
        if self.on_head is not None and response.head_done:
            on_head, self.on_head = self.on_head, None
            on_head()
            self._wake()
            return
        sink = self.sink
        if sink is not None and sink():
            if self._deadline is not None and self._wait_timeout is not None:
                self._deadline = self.loop.time() + self._wait_timeout  # progress: a new chunk
            return
        self._wake()

    def eof_received(self) -> bool | None:
        self.eof = True
        self.response.feed_eof()
        self._wake()
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.not_urgent()
        if not self.eof:
            self.eof = True
            self.response.feed_eof()
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
        return not self.closed and not self.eof and not self.in_flight

    def send(self, data: bytes, *, is_urgent: bool = False) -> None:
        """Write a request; `is_urgent`: its first token may be read out of turn (`UrgentReads`)."""
        assert self.transport is not None
        self.response.reset()
        self.sink = None
        self.in_flight = True
        self.received_any = False
        self.transport.write(data)
        urgent = self.host.pool.urgent
        if urgent is not None and self.fd >= 0 and is_urgent:
            self.urgent = urgent
            urgent.add(self.fd, self._read_now)

    def _read_now(self) -> None:
        """Read out of the loop's turn (`UrgentReads`); EOF and errors are left to the
        transport's own read, which sees them too."""
        if self.closed or self.eof or self._paused:
            self.not_urgent()
            return
        try:
            data = os.read(self.fd, _URGENT_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.not_urgent()
            return
        if not data:
            self.not_urgent()
            return
        self.host.pool.urgent_reads += 1
        try:
            self.data_received(data)
        except Exception:
            # This runs inside another request's task: fail this connection as the transport
            # would have (the loop reports an error raised in data_received and closes it),
            # not the request that happened to read it.
            log.exception("reading %s out of turn", self.host.base_url)
            self.close()

    def not_urgent(self) -> None:
        """Leave the urgent set: the first token went on, or the response or connection ended."""
        if self.urgent is not None:
            self.urgent.discard(self.fd)
            self.urgent = None

    def take_body(self) -> bytes:
        """The body bytes parsed and not yet consumed; reading resumes if it was paused."""
        data = self.response.take_body()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def _wait(self, timeout: float | None, what: str) -> None:
        loop = self.loop
        waiter = loop.create_future()
        self._waiter = waiter
        self._wait_timeout = timeout
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
            # Unless the next request's wait began first: a sink can end the response and
            # release the connection while this task still has to resume (`take_end`).
            if self._waiter is waiter:
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
        loop = self.loop
        # Timers may fire a little early (the loop's clock resolution, libuv's milliseconds).
        if deadline - loop.time() <= 0.001:
            waiter.set_exception(TimeoutError())
        else:
            self._arm(loop, deadline)  # the deadline moved on since the timer was set

    def close(self) -> None:
        self.not_urgent()
        self.sink = None
        self.on_head = None
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
        self.eof = True
        self._wake()


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

    def release(self, conn: _Connection) -> None:
        """The response is complete: keep the connection if HTTP allows it, else close it."""
        if conn.closed:
            return
        response = conn.response
        conn.in_flight = False
        conn.sink = None
        conn.on_head = None
        conn.not_urgent()
        if response.keep_alive and not response.extra and not conn.eof:
            self._keep(conn)
        else:
            conn.close()

    def _keep(self, conn: _Connection) -> None:
        self.active -= 1
        self.idle.append(conn)
        conn.idle_handle = conn.loop.call_later(self.pool.idle_timeout, conn.close)
        self.wake_one()

    def stats(self) -> BackendPoolStats:
        waiting = sum(1 for w in self.waiters if not w.done())
        return BackendPoolStats(idle=len(self.idle), active=self.active, waiting=waiting)


class UpstreamResponse:
    """Status and headers of a backend response; the body is read by iterating."""

    __slots__ = (
        "_chunk_timeout",
        "_conn",
        "_done",
        "_host",
        "arrived_at",
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
    ) -> None:
        self._host = host
        self._conn: _Connection | None = conn
        self._chunk_timeout = chunk_timeout
        self._done = False
        self.status = status
        self.headers = headers
        self.reused = reused
        self.arrived_at = 0.0
        """`time.perf_counter()` of the socket read that brought the first byte of the body
        bytes last returned: the time they waited in the edge starts there."""

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
        chunk, and nothing that has arrived waits for anything that has not. Body bytes parsed
        before a framing error are returned first; the next call raises."""
        conn = self._conn
        if conn is None:
            raise StopAsyncIteration
        response = conn.response
        while True:
            if response.body:
                self.arrived_at = conn.unread_since
                out = conn.take_body()
            else:
                out = b""
            if response.done:
                self._done = True
                self._conn = None
                self._host.release(conn)
                if out:
                    return out
                raise StopAsyncIteration
            if out:
                return out
            if response.error is not None or conn.eof:
                self._abort()
                cause = response.error or "the connection closed before the end of the body"
                raise UpstreamProtocolError(
                    f"{self._host.base_url} broke off the response body: {cause}",
                    base_url=self._host.base_url,
                )
            try:
                await conn._wait(self._chunk_timeout, "body chunk")
            except UpstreamError:
                self._abort()
                raise
            if self._done:  # a sink took the end meanwhile (`take_end`)
                raise StopAsyncIteration

    def set_sink(self, sink: Callable[[], bool] | None) -> None:
        """Run `sink` from the connection's read callback each time a read parsed something,
        instead of waking the task iterating this response. The sink takes what it can with
        `take_ready` and returns True when the iterating task need not wake; returning False
        (the end of the body, an error, a sink that cannot take more now) wakes it, and
        iterating finishes the body as usual: whatever the sink left, then the end or the
        error. While the sink takes chunks, each one counts as progress for `chunk_timeout`."""
        if self._conn is not None:
            self._conn.sink = sink

    def take_ready(self) -> bytes:
        """The body bytes parsed so far, without waiting (b"" when none); sets `arrived_at`."""
        conn = self._conn
        if conn is None or not conn.response.body:
            return b""
        self.arrived_at = conn.unread_since
        return conn.take_body()

    def take_end(self) -> bool:
        """True when the body is complete and all of it was taken: the response ends here,
        and its connection goes back to the pool, as iterating to the end would do."""
        conn = self._conn
        if conn is None or not conn.response.done or conn.response.body:
            return False
        self._done = True
        self._conn = None
        self._host.release(conn)
        return True

    def first_token_passed(self) -> None:
        """The first content token went on to the client: from now on this response's reads
        wait for the loop's turn like any other (`UrgentReads`)."""
        if self._conn is not None:
            self._conn.not_urgent()

    @property
    def settled(self) -> bool:
        """Nothing more will arrive: the body is complete, broken off, or the connection closed."""
        conn = self._conn
        return conn is None or conn.response.done or conn.response.error is not None or conn.eof

    async def read(self) -> bytes:
        """The whole (remaining) body."""
        return b"".join([chunk async for chunk in self])

    def _abort(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def abort(self) -> None:
        """Close the connection now if the body is incomplete (aborts the upstream request)."""
        self._abort()

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


# RFC 9110 §5.1 and §5.5: a header name is a token; a value holds no CR, LF or NUL.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(rb"[\r\n\x00]")
_TARGET = re.compile(r"/[\x21-\x7e]*")


def _encode_request(
    host: _Host, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes
) -> bytes:
    """The request head and body as one write. Raises ValueError on what would be invalid
    on the wire (a header injection, a target with spaces) instead of sending it."""
    if method not in _METHODS:
        raise ValueError(f"invalid upstream request: method {method!r} is not supported")
    if _TARGET.fullmatch(path) is None:
        raise ValueError(f"invalid upstream request: bad target {path[:60]!r}")
    parts = [
        b"%b %b HTTP/1.1\r\nhost: %b\r\ncontent-length: %d\r\n"
        % (method.encode(), path.encode(), host.host_header, len(body))
    ]
    for name, value in headers:
        if name.lower() in _DROP_HEADERS:
            continue
        if _TOKEN.fullmatch(name) is None or _BAD_VALUE.search(value) is not None:
            raise ValueError(f"invalid upstream request: bad header {name[:40]!r}")
        parts.append(b"%b: %b\r\n" % (name, value.strip(b" \t")))
    parts.append(b"\r\n")
    parts.append(body)
    return b"".join(parts)


async def _read_head(
    conn: _Connection, timeout: float | None, began: list[UpstreamResponse]
) -> None:
    """Wait for the status line and headers of the response to the request just sent. Once
    `began` holds the response, its head was handled in the read callback (`on_head`); the
    whole response may have ended there too, and the connection gone to another request."""
    response = conn.response
    while not began and not response.head_done:
        if response.error is not None:
            raise UpstreamProtocolError(
                f"{conn.host.base_url} sent an invalid response: {response.error}",
                base_url=conn.host.base_url,
            )
        if conn.eof:
            raise UpstreamProtocolError(
                f"{conn.host.base_url} closed the connection before the response head",
                base_url=conn.host.base_url,
            )
        await conn._wait(timeout, "response")


def _response_of(conn: _Connection, reused: bool, chunk_timeout: float | None) -> UpstreamResponse:
    return UpstreamResponse(
        host=conn.host,
        conn=conn,
        status=conn.response.status,
        headers=conn.response.headers,
        reused=reused,
        chunk_timeout=chunk_timeout,
    )


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to every backend, bounded per backend."""

    def __init__(
        self,
        *,
        max_connections_per_backend: int = 128,
        idle_timeout: float = 60.0,
        connect_timeout: float = 2.0,
        urgent_reads: bool = True,
    ) -> None:
        if max_connections_per_backend < 1:
            raise ValueError("max_connections_per_backend must be at least 1")
        if idle_timeout <= 0 or connect_timeout <= 0:
            raise ValueError("idle_timeout and connect_timeout must be positive")
        self.max_connections_per_backend = max_connections_per_backend
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.urgent = UrgentReads() if urgent_reads and UrgentReads.available else None
        """Sockets whose first token is due, read between request starts (`UrgentReads`)."""
        self.last_read = 0.0
        """`perf_counter()` of the last read of any upstream socket."""
        self.urgent_reads = 0
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
        on_head: Callable[[UpstreamResponse], None] | None = None,
    ) -> UpstreamResponse:
        """Send one request; return once the status line and headers arrived.

        `on_head`, if given, gets the response from inside the read callback that completed its
        head, before this call returns: a relay can pass the head and the first token on
        without waiting for this task's turn (it must not raise). Such a response's socket is
        urgent until its first token went on (`UrgentReads`): reading it early helps only where
        a callback can act on what it brings. After sending, the urgent sockets of other
        responses are read at once if the loop has read none for `URGENT_AFTER`."""
        host = self._host(base_url)
        data = _encode_request(host, method, path, headers, body)
        self._requests += 1
        for attempt in (0, 1):
            conn, reused = await host.acquire()
            began: list[UpstreamResponse] = []
            try:
                conn.send(data, is_urgent=on_head is not None)
                if on_head is not None:
                    conn.on_head = partial(
                        self._head_arrived, conn, reused, chunk_timeout, on_head, began
                    )
                self.read_urgent()
                await _read_head(conn, first_byte_timeout, began)
            except (UpstreamError, OSError) as exc:
                stale = reused and not conn.received_any and conn.eof
                conn.close()
                if stale and attempt == 0 and not isinstance(exc, UpstreamTimeout):
                    # The backend closed this idle connection just as we reused it (its
                    # keep-alive timeout raced our request); nothing was processed, so a
                    # fresh connection is safe (RFC 9112 §9.3.1).
                    continue
                if isinstance(exc, UpstreamError):
                    raise
                raise UpstreamProtocolError(
                    f"{base_url} failed before the response head: {exc}", base_url=base_url
                ) from None
            except BaseException:
                conn.close()  # cancelled: the request may be half sent
                raise
            if reused:
                self._reused += 1
            if began:
                return began[0]
            return _response_of(conn, reused, chunk_timeout)
        raise AssertionError("unreachable")

    @staticmethod
    def _head_arrived(
        conn: _Connection,
        reused: bool,
        chunk_timeout: float | None,
        on_head: Callable[[UpstreamResponse], None],
        began: list[UpstreamResponse],
    ) -> None:
        response = _response_of(conn, reused, chunk_timeout)
        began.append(response)
        on_head(response)

    def read_urgent(self) -> None:
        """Read, now, the sockets whose first token is due and has arrived (`UrgentReads`),
        unless an upstream socket was read in the last `URGENT_AFTER` seconds."""
        urgent = self.urgent
        if urgent is not None and time.perf_counter() - self.last_read > URGENT_AFTER:
            urgent.poll()

    def stats(self) -> PoolStats:
        return PoolStats(
            requests=self._requests,
            reused=self._reused,
            connects=self._connects,
            urgent_reads=self.urgent_reads,
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
        if self.urgent is not None:
            self.urgent.close()
            self.urgent = None

    def __repr__(self) -> str:
        parts = [f"{u}: {h.active} active, {len(h.idle)} idle" for u, h in self._hosts.items()]
        return f"<UpstreamPool {'; '.join(parts) or 'empty'}>"


__all__ = ["BackendPoolStats", "PoolStats", "UpstreamPool", "UpstreamResponse"]
