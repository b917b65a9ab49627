"""One HTTP/1.1 connection: an asyncio ``Protocol`` around an httptools (llhttp) parser.

One request at a time per connection (RFC 9112 §9.3.2: pipelined requests are answered in
order). One read can hold several requests; those behind the one being answered wait, parsed,
in a queue, and reading pauses while a request's unread body or a pipelined request is
buffered. A bad request behind good ones is answered (400, and close) after them. llhttp sets
no limit on the size of a head: it is summed from the callbacks and, while the head is
incomplete, from the bytes fed. Parsing stops after a request that ends the connection
(``Connection: close``, HTTP/1.0, an upgrade): nothing after it is read. The idle timeout and
the request head and body deadlines (a slowloris gets 408 and a close) are one lazily re-armed
timer per connection; connections over the listener's or one client's cap are reset at once.
Each request's ASGI channel and response writer is an ``h1_cycle._Cycle``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections import deque
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import unquote

import httptools

from transport.h1_cycle import DISCARD_MAX, _Cycle

if TYPE_CHECKING:
    from transport.h1_server import H1Listener

log = logging.getLogger("quicedge.h1")

BODY_BUFFER = 64 * 1024
"""Request-body bytes buffered for the app before reading pauses."""
MAX_PIPELINED = 32
"""Pipelined requests parsed and waiting behind the one being answered; the one past them is
answered 503 and the connection closes (RFC 9112 §9.3.2: the client retries what was not
answered). One read could queue 4,411 requests, 25 times the bytes it held."""
LINGER = 30.0
"""Seconds a connection closed while its client may still be sending goes on reading (and
dropping) what comes, so that the client reads its answer instead of a reset (nginx's
lingering close, with its default)."""

CHUNK_FRAMING = 64
"""Bytes a chunk's size line and its CRLFs may take beyond its data before the body's framing
counts against the head's limit (`max_header_bytes`): chunk extensions and trailers are
counted there, as llhttp bounds neither."""

_ERROR = "HTTP/1.1 {} {}\r\ncontent-length: 0\r\nconnection: close\r\nx-request-id: {}\r\n\r\n"
"""A refusal of the listener's own: with a fresh `x-request-id` (as the app makes them) for the
client to quote, as every answer of the edge carries one (docs/errors.md)."""
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_METHODS = {m.encode(): m for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH")}


_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~%!$&'()*+,;=-]*)(?::[0-9]*)?")
"""A Host header's value, or an absolute-form target's authority: RFC 3986's host and port
(RFC 9112 §3.2: a request with any other is a 400)."""

_HOSTS_SEEN: set[bytes] = set()
"""Host values already found valid (`_host_ok`): a listener sees few, and a set lookup costs a
tenth of the regex."""
_HOSTS_SEEN_MAX = 256


def _host_ok(value: bytes) -> bool:
    """Whether `value` is a host and port (`_HOST`), remembering the first few that are."""
    if _HOST.fullmatch(value) is None:
        return False
    if len(_HOSTS_SEEN) < _HOSTS_SEEN_MAX:
        _HOSTS_SEEN.add(value)
    return True


_DETACHED = httptools.HttpRequestParser(object())
"""What a closed connection's parser is replaced with: a parser refers to its protocol, and
that cycle kept what a partial line had buffered (1.5 GB after a trailer flood) until a full
collection, which `transport.collector` makes rare."""


class _Stop(Exception):
    """Raised in a parser callback to stop parsing; ``H1Protocol._halt`` says why."""


class H1Protocol(asyncio.Protocol):
    """One HTTP/1.1 connection; its parser's callbacks are the ``on_*`` methods."""

    def __init__(self, server: H1Listener, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self.write_paused = False
        self._paused_at = 0.0  # when writing last paused: the client stopped taking the response
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)  # one for every request here
        # llhttp refuses a version other than 0.9, 1.0, 1.1 and 2.0 with a parse error (400);
        # lenient, it takes any one-digit version, and `on_headers_complete` picks (505 for a
        # major version other than 1). Only the version check is relaxed.
        self._parser.set_dangerous_leniencies(lenient_version=True)
        self._max_head = server.options.max_header_bytes
        self._requests_left = server.options.max_requests or -1  # -1: no cap
        self._cycle: _Cycle | None = None  # the request being answered
        self._queue: deque[_Cycle] = deque()  # pipelined requests behind it, already parsed
        self._reading: _Cycle | None = None  # the request whose body is being parsed
        # Parsing stopped: -1 after a request that ends the connection, else the status that
        # answers a bad request once those before it are answered.
        self._halt = 0
        # The request head being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0  # as the callbacks deliver it
        self._in_head = True
        self._head_fed = 0  # bytes fed while the head was incomplete
        self._body_fed = 0  # bytes fed by reads that began in the body being parsed
        self._read_at = 0.0  # time.perf_counter() of the last read
        self._reading_paused = False
        self._next_waits = False  # the next request waits until the client reads its answers
        self._drain: asyncio.Future[None] | None = None
        self._closed = False
        self._lost = False  # the transport is gone (`_closed` comes first, when we close)
        self._unsent = -1  # once closed: the bytes still to write at the last progress
        self._unsent_since = 0.0  # ... and when that was
        self._idle_since: float = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._client: tuple[str, int] | None = None
        self._local: tuple[str, int] | None = None
        self.host: str | None = None  # the client's address
        self.admitted = False  # counted by the listener's gate
        self._head_since = 0.0  # perf_counter() of the first read of the head being parsed
        self._body_since = 0.0  # perf_counter() of the read that completed the reading head

    # asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # inherited from the listener on Linux; set it anyway elsewhere
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self._client = (str(peer[0]), int(peer[1])) if peer else None
        self._local = (str(local[0]), int(local[1])) if local else None
        self.host = self._client[0] if self._client else None
        if self.server.gate.admit(self.host) is not None:
            # Over a cap: closed at once (a reset, so that no buffer is kept for it).
            self._closed = True
            transport.abort()  # type: ignore[attr-defined]
            return
        self.admitted = True
        self.server.connections.add(self)
        self._idle_since = self.loop.time()
        self._timer = self.loop.call_later(self.server.timer_period, self._on_timer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = self._lost = True
        self._parser = _DETACHED
        self.server.forget(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._cycle is not None and not self._cycle.finished:
            self._cycle.gone()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def eof_received(self) -> bool:
        # As hypercorn: a client that half-closes has gone; the app gets http.disconnect.
        return False

    def pause_writing(self) -> None:
        self.write_paused = True
        self._paused_at = self.loop.time()  # the send deadline runs from here

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self._next_waits:
            self._next_waits = False
            self._next()

    def data_received(self, data: bytes) -> None:
        if self._halt:
            return  # nothing after a last or a bad request is read
        self._read_at = time.perf_counter()
        cycle = self._cycle
        was_complete = cycle is not None and cycle.complete
        reading = None
        if self._in_head:
            if not self._head_fed:
                self._head_since = self._read_at  # the head deadline runs from here
            self._head_fed += len(data)
        else:
            reading = self._reading
            self._body_fed += len(data)
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self._halt >= 0:
                cause = exc.__context__  # what a callback raised
                if cause is not None and not isinstance(cause, _Stop):
                    log.error("h1 parser callback failed", exc_info=cause)
                self._stop(self._halt or 400)
        else:
            if self._in_head and self._head_fed > self._max_head:
                # llhttp sets no limit, and httptools keeps a partial header line itself.
                self._stop(431)
            elif reading is not None and reading is self._reading and self._over_framing(reading):
                self._stop(431)
        cycle = self._cycle
        if cycle is None or self._closed:
            return
        cycle.wake()
        if cycle.complete:
            if was_complete or self._queue or self._url:
                # A pipelined request behind the one in progress: read no more until then.
                # Reading goes on otherwise, so that a client that leaves is seen at once.
                self._pause_reading()
        elif cycle.body_bytes > BODY_BUFFER:
            self._pause_reading()

    # parser callbacks (httptools): one feed_data per read may parse several requests

    def on_url(self, url: bytes) -> None:
        self._url += url  # in pieces when the request line is split across reads

    def on_header(self, name: bytes, value: bytes) -> None:
        # Trailer fields (RFC 9112 §7.1.2) come here too, after `on_headers_complete`: they
        # are dropped at the message's end (`on_message_complete`), as the apps take none.
        self._head_size += len(name) + len(value) + 4
        # ASGI wants lowercase names; llhttp keeps the case and trailing whitespace.
        self._headers.append((name.lower(), value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        url, headers = self._url, self._headers
        self._url, self._headers = b"", []
        self._in_head = False
        size = self._head_size + len(url)
        self._head_size = 0
        if size > self._max_head:
            self._halt_with(431)  # a whole head in one read; _head_fed counts one in pieces
        parser = self._parser
        version = parser.get_http_version()
        if version == "1.1":
            keep_alive = parser.should_keep_alive()  # Connection: close is a token here
        elif version == "1.0":
            keep_alive = False  # a response with Connection: keep-alive is not worth it
        elif version.startswith("1."):
            # RFC 9112 §2.3: a later minor version of HTTP/1 is served as the highest this
            # server conforms to, and answered as such (llhttp keeps it alive as 1.1).
            version = "1.1"
            keep_alive = parser.should_keep_alive()
        else:
            self._halt_with(505)  # 0.9, 2.0 and other major versions
        hosts = 0
        expect_100 = False
        declared = -1
        for name, value in headers:
            if name == b"host":
                hosts += 1
                if value not in _HOSTS_SEEN and not _host_ok(value):
                    self._halt_with(400)
            elif name == b"content-length":
                declared = int(value)  # llhttp took it as a number, and only one
            elif name == b"transfer-encoding":
                # RFC 9112 §6.1: HTTP/1.0 framing with it is faulty; a coding other than
                # chunked would reach the app undecoded.
                if version == "1.0":
                    self._halt_with(400)
                if value.lower() != b"chunked":
                    self._halt_with(501)
            elif name == b"expect" and value.lower() == b"100-continue":
                expect_100 = version == "1.1"
        if hosts > 1 or (not hosts and version == "1.1"):
            self._halt_with(400)  # RFC 9112 §3.2
        method = parser.get_method()
        if parser.should_upgrade():
            self._upgrade(headers)
            keep_alive = False
        elif url[:1] != b"/":
            url = self._origin_form(url, method, headers)
        self._requests_left -= 1
        if not self._requests_left:
            keep_alive = False  # the connection's last: it retires (`max_requests`)
        path, _, query = url.partition(b"?")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": version,
            "method": _METHODS.get(method) or method.decode(),
            "scheme": "http",
            "path": unquote(path.decode("ascii")),  # llhttp refuses other bytes in a path
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self._client,
            "server": self._local,
            "extensions": {
                "transport": "h1",
                "early_data": False,
                "handshake_wait_s": 0.0,
                "arrived_at": self._read_at,
            },
        }
        cycle = _Cycle(self, scope, keep_alive=keep_alive)
        scope["extensions"]["quicedge.body_writer"] = cycle
        scope["extensions"]["quicedge.on_disconnect"] = cycle.notify_disconnect
        cycle.expect_100 = expect_100
        cycle.declared = declared
        self._reading = cycle
        self._body_since = self._read_at  # the body deadline runs from here
        if self._cycle is None:
            self._cycle = cycle
            self.server.spawn(self._run(cycle), self.loop)
        else:
            if len(self._queue) >= MAX_PIPELINED:
                self._reading = None
                self._halt_with(503)
            self._queue.append(cycle)  # answered in order (RFC 9112 §9.3.2)

    def on_chunk_header(self) -> None:
        if self._reading is not None:
            self._reading.chunks += 1

    def on_body(self, body: bytes) -> None:
        cycle = self._reading
        if cycle is not None:
            cycle.received += len(body)
            if cycle.discarded >= 0:  # answered already: only the connection wants it read
                cycle.discarded += len(body)
                if cycle.discarded > DISCARD_MAX:
                    self._linger()
                    self._halt_with(-1)
                return
            cycle.body.append(body)
            cycle.body_bytes += len(body)
            cycle.expect_100 = False  # the client sent the body without waiting

    def on_message_complete(self) -> None:
        cycle, self._reading = self._reading, None
        self._in_head = True
        self._head_fed = 0
        self._body_fed = 0
        if self._headers:  # trailer fields: kept, they became the next request's headers
            self._headers = []
            self._head_size = 0
        if cycle is not None:
            cycle.complete = True
            cycle.expect_100 = False
            if not cycle.keep_alive:
                self._halt_with(-1)  # the connection ends with this request: parse no further
            if cycle.discarded >= 0:
                self.finish(cycle)  # its answer went out already: on to the next request

    def _over_framing(self, cycle: _Cycle) -> bool:
        """Whether what the reads of `cycle`'s body brought beyond its data (chunk size lines,
        extensions, trailers) is past the head's limit: llhttp reads a chunk extension or a
        trailer section of any size, and one client fed 3 GB of extension in 4 s."""
        return self._body_fed - cycle.received > self._max_head + CHUNK_FRAMING * cycle.chunks

    def _halt_with(self, status: int) -> NoReturn:
        self._halt = status
        raise _Stop

    def _origin_form(self, url: bytes, method: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The path and query of a target not in origin form (RFC 9112 §3.2): an absolute URI's,
        whose authority then replaces the Host header's, as §3.2.2 asks; `*` for OPTIONS as it
        is; anything else is a 400."""
        if url == b"*" and method == b"OPTIONS":
            return url
        scheme, sep, rest = url.partition(b"://")
        if not sep or scheme.lower() not in (b"http", b"https"):
            self._halt_with(400)
        end = len(rest)
        for mark in (b"/", b"?"):
            at = rest.find(mark)
            if 0 <= at < end:
                end = at
        authority, target = rest[:end], rest[end:]
        if not authority or b"@" in authority or _HOST.fullmatch(authority) is None:
            self._halt_with(400)  # userinfo is not allowed in an http(s) URI either (RFC 9110)
        headers[:] = [(n, authority if n == b"host" else v) for n, v in headers]
        return target if target[:1] == b"/" else b"/" + target

    def _upgrade(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Upgrade or CONNECT: we speak no other protocol, so answer as HTTP/1.1 and close.

        httptools has llhttp skip the body of such a request; one that has a body is refused
        rather than handed to the app without it.
        """
        for name, value in headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                self._halt_with(400)

    # requests

    async def _run(self, cycle: _Cycle) -> None:
        scope = cycle.scope
        try:
            await self.server.app(scope, cycle.receive, cycle.send)
        except Exception:
            log.exception("ASGI app failed on %s %s", scope["method"], scope["path"])
            self._failed(cycle)
        else:
            if not cycle.finished:
                if not cycle.started and not cycle.disconnected:  # (a client gone gets none)
                    log.error("ASGI app returned without a response")
                self._failed(cycle)
        finally:
            # The scope's extensions refer to the cycle, which refers to the scope: left in
            # place, that reference cycle would be freed by the garbage collector only, every
            # request's (docs/benchmarks.md, "Fifth pass").
            extensions = scope["extensions"]
            extensions.pop("quicedge.body_writer", None)
            extensions.pop("quicedge.on_disconnect", None)

    def _failed(self, cycle: _Cycle) -> None:
        """500 when nothing was sent yet; otherwise close, so the client sees it cut short."""
        if self._closed or cycle.finished or cycle.disconnected:
            return
        cycle.finished = True
        if not cycle.started:
            self.write(_ERROR.format(500, "Internal Server Error", os.urandom(16).hex()).encode())
        self.close()

    def _stop(self, status: int) -> None:
        """Parsing failed: answer ``status`` after the requests before the bad one."""
        self._halt = status
        reading = self._reading
        if reading is not None and reading is not self._cycle:
            self._queue.pop()  # a pipelined request cut short: it never reaches the app
        self._reading = None
        cycle = self._cycle
        if cycle is None or not cycle.complete:
            self._refuse(status)
        # else finish() refuses once the queue is answered

    def _refuse(self, status: int, *, linger: bool = True) -> None:
        """A malformed request (400) or an oversize head (431): answer and close, reading on
        for a while (`_linger`) unless `linger` is False."""
        self.server.refused_request(status)
        cycle = self._cycle
        if cycle is not None and cycle.started:
            if not cycle.finished:  # malformed body mid-response: the app sees disconnect
                cycle.gone()
            self.close()
            return
        if cycle is not None:
            cycle.gone()
        self.write(_ERROR.format(status, HTTPStatus(status).phrase, os.urandom(16).hex()).encode())
        if linger:
            self._linger()
        else:
            self.close()

    def finish(self, cycle: _Cycle) -> None:
        """The response is complete: next request on this connection, or close."""
        if self._closed:
            return
        if not cycle.complete and cycle.keep_alive and not self.server.draining:
            if not cycle.expect_100 and cycle.discarded < 0:
                # Answered before its body arrived (an error that needed none): the rest is
                # read and dropped, so the connection serves the next request. Closing with
                # bytes unread would reset it, and could cost the client the answer.
                cycle.discarded = 0
                cycle.body.clear()
                cycle.body_bytes = 0
                self._resume_reading()
                return
        if not cycle.keep_alive or not cycle.complete or self.server.draining:
            # An unread remainder of the body would have to be read to find the next request.
            if cycle.complete:
                self.close()
            else:
                self._linger()
            return
        self._idle_since = self.loop.time()
        if self.write_paused:
            # The client takes none of its answers: no next request until it does, or until
            # `send_timeout` ends the connection. One that pipelined requests and never read
            # had every answer buffered (+544 MiB in 20 s).
            self._next_waits = True
            return
        self._next()

    def _next(self) -> None:
        """On to the next request once the last is answered: a pipelined one, or reading."""
        if self._closed:
            return
        if not self._queue:
            self._cycle = None
            if self._halt > 0:
                self._refuse(self._halt)
                return
        else:
            cycle = self._cycle = self._queue.popleft()
            self.server.spawn(self._run(cycle), self.loop)
            if cycle.complete and (self._queue or self._url):
                return  # more pipelined requests: reading stays paused
            if cycle.body_bytes > BODY_BUFFER:
                return
        self._resume_reading()

    def body_consumed(self) -> None:
        if self._cycle is not None and not self._cycle.complete:
            self._resume_reading()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()

    # output and lifetime

    def write(self, data: bytes) -> None:
        if not self._closed and self._transport is not None:
            self._transport.write(data)

    async def drained(self) -> None:
        """Wait until the transport's buffer is under its low-water mark (or the connection is
        gone; one closed after its answer still writes it, for `send_timeout` at most)."""
        while self.write_paused and not self._lost:
            if self._drain is None or self._drain.done():
                self._drain = self.loop.create_future()
            await self._drain

    def close(self) -> None:
        if not self._closed and self._transport is not None:
            self._closed = True
            self._transport.close()  # flushes what is buffered, then connection_lost

    def _linger(self) -> None:
        """Close after the answer while the client may still be sending: the answer and then
        our end of the stream go out, and what the client sends is read and dropped until it
        closes, or for `LINGER` seconds. Closed with its bytes unread, the connection is reset,
        and a client still writing its body (Python's `http.client`) lost its 413 five times
        out of five."""
        transport = self._transport
        if self._closed or transport is None:
            return
        self._closed = True  # nothing more is written
        if not self._halt:
            self._halt = -1  # nor parsed: `data_received` drops what comes
        self._reading = None
        self._queue.clear()
        self._cycle = None
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._resume_reading()
        self.loop.call_later(LINGER, transport.close)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    @property
    def idle(self) -> bool:
        return self._cycle is None

    def _on_timer(self) -> None:
        """Idle keep-alive, the head and body deadlines and the send timeout, checked every
        `timer_period`.

        The deadlines start from a read's clock (no clock read or timer per request), so a
        deadline is noticed at the first check after it passed: within a quarter of the
        shortest timeout."""
        self._timer = None
        options = self.server.options
        period = self.server.timer_period
        if self._transport is None:
            return
        if (self.write_paused and self.loop.time() - self._paused_at > options.send_timeout) or (
            self._closed and self._flush_stalled(options.send_timeout)
        ):
            # The client took none of the response for `send_timeout`: nothing more will go,
            # and the app hears of it as the client's going (its disconnect callback). Closed,
            # the connection still holds what is unwritten (the end of its last answer, which
            # the app wrote without a wait): the transport lets go only once it is written.
            self.server.timed_out("send")
            self.abort()
            return
        if self._closed:
            self._timer = self.loop.call_later(period, self._on_timer)  # until it is written
            return
        if self._cycle is None:
            if self._head_fed:  # a head is arriving
                if time.perf_counter() - self._head_since > options.head_timeout:
                    self._timed_out("head")
                    return
            else:
                left = self._idle_since + options.keep_alive_timeout - self.loop.time()
                if left <= 0:
                    self.close()
                    return
                period = min(period, left)
        elif self._reading is self._cycle and not self._cycle.complete:  # its body is arriving
            if time.perf_counter() - self._body_since > options.body_timeout:
                self._timed_out("body")
                return
        self._timer = self.loop.call_later(period, self._on_timer)

    def _flush_stalled(self, limit: float) -> bool:
        """Whether the bytes a closed connection has yet to write (the end of its last answer,
        which the app wrote without a wait) have not shrunk for `limit` seconds: asyncio's
        transport lets go of a connection only once they are written, and a client that never
        reads would hold both for ever."""
        assert self._transport is not None
        left = self._transport.get_write_buffer_size()
        now = self.loop.time()
        if self._unsent < 0 or left < self._unsent:
            self._unsent, self._unsent_since = left, now  # progress (or the first look)
            return False
        return left > 0 and now - self._unsent_since > limit

    def _timed_out(self, phase: str) -> None:
        """A head or body past its deadline: 408 (or a close, once a response began)."""
        self.server.timed_out(phase)
        self._halt = 408
        self._reading = None
        self._refuse(408, linger=False)  # a client that slow gets no more time
