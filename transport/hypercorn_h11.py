"""hypercorn's HTTP/1.1 protocol, parsing as strictly as the plain listener and never switching.

The TLS listener serves HTTP/1.1 (ALPN ``http/1.1``, or none) with hypercorn 0.18's
`H11Protocol` on h11 0.16. An audit of it against hostile clients found six defects, each
measured against `quicedge serve --tcp` with a relay recording what reached the backend:

- A request with both `Content-Length` and `Transfer-Encoding` was framed by the chunked
  coding and the connection kept: bytes that a front end framing by `Content-Length` counts as
  the body ran as a second, smuggled request, which reached the backend. RFC 9112 §6.1 lets a
  server refuse such a request, and says it MUST close the connection after it either way.
  `GuardedH11Protocol` answers `400` and closes before the app sees it, as the plain listener
  (and nginx) do; so it does for `Transfer-Encoding` in an HTTP/1.0 request, whose framing
  RFC 9112 §6.1 calls faulty.
- A `Connection: close` (or HTTP/1.0) request followed in the same read by any byte, a stray
  CRLF or a pipelined request, got `400` written over its answer: the request had reached the
  backend, which then saw it aborted. h11 raises "Got data when expecting EOF" for bytes read
  after such a request, and hypercorn answers that error like a malformed request. Here what
  follows a request that ends the connection is never parsed, whether it came in the same read
  or later (RFC 9112 §9.6: later requests MUST NOT be processed; §2.2: a stray CRLF SHOULD be
  ignored); the answer goes out whole and the connection then closes. Bytes that arrive while
  that answer is being sent are dropped, not buffered, so a client cannot grow the connection's
  buffer for as long as a streamed answer lasts.
- A keep-alive request after a stray CRLF (which some clients send after a body they framed
  by its length) got `400` and a close: h11 raises "no request line received" on an empty line
  where a request line should be. RFC 9112 §2.2 says a server SHOULD ignore at least one; here
  (`_read_request_head`) they are dropped, as llhttp does on the plain listener.
- An answer given before the request's body arrived (a 413 to an upload over the limit, a
  401) was lost by a client still writing that body: hypercorn closed the connection with the
  body's bytes unread, the kernel reset it, and Python's `http.client` got `SSLEOFError` five
  times out of five. What the client still sends is now read and dropped (`_maybe_recycle`)
  until it closes, or for the idle timer's time (`head_timeout`), as the plain listener does.
- A bare `Upgrade: h2c` (without `Connection: upgrade` or `HTTP2-Settings`, even in an
  HTTP/1.0 request) got `101 Switching Protocols` and HTTP/2 frames. RFC 9113 §3.1 removed the
  h2c upgrade, and HTTP/2 over TLS is negotiated by ALPN alone (§3.2); an intermediary that
  forwarded the header as end-to-end would face a protocol switch it never asked for ("h2c
  smuggling"). The upgrade is never made now, on a plain connection either (quicedge's plain
  listeners are `h1_server`'s, which make none): the request is served as HTTP/1.1. The HTTP/2
  preface (`PRI * HTTP/2.0`) is still taken as prior knowledge on a plain connection (§3.3),
  and over TLS it is a request of an unsupported version.
- h11 accepted what llhttp refuses on the plain listener: an `HTTP/2.0` or `HTTP/3.0` request
  line (served; now `505`), a method in lowercase (hypercorn upper-cased `get` into `GET`,
  though methods are case-sensitive (RFC 9110 §9.1) and no registered one has a lowercase
  letter; now `400`), a control character in a field value (RFC 9110 §5.5; now `400`), a bare
  LF ending a line of the head (RFC 9112 §2.2 lets h11 take it as CRLF; a front end that
  does not would see other fields; now `400`), a bare CR in a chunk extension (RFC 9112 §2.2;
  now `400`) and a chunk size of 20 hex digits, which waited out the body deadline for 2^80
  bytes (now `400` at once: over 64 bits, where llhttp stops too). A front end that parses
  such a request another way would disagree with the edge on where it ends.

Every refusal answers with a short text body and `connection: close`, and the connection
closes; so do h11's own (hypercorn's had an empty body). Other connections are unaffected.

*Upstream:* as of hypercorn 0.18.0, `H11Protocol._check_protocol` switches to h2c on the Upgrade
header alone, over TLS too, and serves a request whose framing h11 accepted; h11 frames a
request with both length headers by the chunked coding, and keeps its lenient value and
chunk-line grammar on purpose (python-hyper/h11#57). A hypercorn that refused such framing and
made the h2c upgrade only on a plain connection asked with `Connection: Upgrade,
HTTP2-Settings` would replace `_handle_events` and `_refusal`; the chunk-line check goes when
h11 parses chunk lines strictly. Check pgjones/hypercorn#317 (its h2c upgrade reworked after
0.18.0) when moving the pin.

`install()` swaps it in where hypercorn's `ProtocolWrapper` looks the class up, once per
process; `transport.tcp` calls it. The override copies `H11Protocol._handle_events` and reads
h11's chunked reader's state (`h11._readers.ChunkedReader`), so `install()` refuses a hypercorn
other than 0.18 and an h11 other than 0.16 (the first with the fixed chunk-footer check,
CVE-2025-43859, which this reader keeps).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import h11
import hypercorn
import hypercorn.protocol
from h11._readers import ChunkedReader, ReadersType, maybe_read_from_IDLE_client
from h11._receivebuffer import ReceiveBuffer
from h11._util import Sentinel
from h11._writers import WritersType
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.events import Body, Data, EndBody
from hypercorn.protocol.h11 import STREAM_ID, H2ProtocolAssumedError, H11Protocol

from transport.pins import off_pin

TESTED_MINOR = "0.18"
"""hypercorn version whose `H11Protocol` this override was written and tested against."""

TESTED_H11_MINOR = "0.16"
"""h11 version whose `ChunkedReader` `_StrictChunkedReader` extends."""

ON_REFUSED_REQUEST_ATTRIBUTE = "quicedge_on_refused_request"
"""The hypercorn config attribute holding what to call with each refusal's status."""

_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
"""Control characters, which RFC 9110 §5.5 does not allow in a field value (HTAB it does)."""

_CHUNK_LINE = re.compile(rb"(?P<size>[0-9A-Fa-f]{1,20})(?:;[^\x00-\x08\x0a-\x1f\x7f]*)?[ \t]*\r\n")
"""A chunk-size line: h11's grammar (trailing whitespace allowed, the extension not parsed),
with no control character in the extension."""

_HEAD_END = re.compile(rb"\n\r?\n")
"""How h11 finds the end of a head (`h11._receivebuffer.blank_line_regex`)."""

_BARE_LF = re.compile(rb"(?<!\r)\n")
"""An LF not preceded by CR: llhttp refuses one in a request head, h11 takes it as a line's
end (RFC 9112 §2.2 lets it), and a front end that does neither would see other fields."""

_CHUNK_SIZE_LIMIT = 1 << 64
"""The first chunk size refused as too large (llhttp's limit)."""

_CLOSING = (h11.MUST_CLOSE, h11.CLOSED)
"""The client's states once it sent a request that ends the connection, or closed it."""


class _StrictChunkedReader(ChunkedReader):
    """h11's reader of a chunked request body, with the chunk-size line checked by
    `_CHUNK_LINE` and `_CHUNK_SIZE_LIMIT`; chunk data and trailers are h11's."""

    def __call__(self, buf: ReceiveBuffer) -> h11.Data | h11.EndOfMessage | None:
        if self._reading_trailer or self._bytes_in_chunk:
            return super().__call__(buf)
        if self._bytes_to_discard:
            # The CRLF after a chunk's data, checked as h11 does: h11 would read the next
            # chunk-size line itself right after it.
            data = buf.maybe_extract_at_most(len(self._bytes_to_discard))
            if data is None:
                return None
            if data != self._bytes_to_discard[: len(data)]:
                raise h11.LocalProtocolError("malformed chunk footer")
            self._bytes_to_discard = self._bytes_to_discard[len(data) :]
            if self._bytes_to_discard:
                return None
        line = buf.maybe_extract_next_line()
        if line is None:
            return None
        match = _CHUNK_LINE.fullmatch(line)
        if match is None or int(match["size"], 16) >= _CHUNK_SIZE_LIMIT:
            raise h11.LocalProtocolError("illegal chunk header")
        self._bytes_in_chunk = int(match["size"], 16)
        self._reading_trailer = not self._bytes_in_chunk
        return super().__call__(buf)  # the chunk's data, or the trailer section


class _StrictConnection(h11.Connection):
    """h11's connection, reading request heads with `_read_request_head` and chunked request
    bodies with `_StrictChunkedReader`."""

    def _get_io_object(
        self,
        role: type[Sentinel],
        event: h11.Event | None,
        io_dict: ReadersType | WritersType,
    ) -> Callable[..., Any] | None:
        io = super()._get_io_object(role, event, io_dict)
        if io is maybe_read_from_IDLE_client:
            return _read_request_head
        return _StrictChunkedReader() if isinstance(io, ChunkedReader) else io


def _read_request_head(buf: ReceiveBuffer) -> h11.Request | None:
    """h11's reader of a request head, which first drops empty lines before the request line
    and refuses a head with a bare LF."""
    data = buf._data
    skip = 0
    while True:
        # RFC 9112 §2.2: a server SHOULD ignore at least one empty line (CRLF) before a
        # request line; some clients end a body with one its length does not count. h11
        # raised "no request line received" for it (the next request got 400); llhttp drops
        # them on the plain listener.
        if data[skip : skip + 1] == b"\n":
            skip += 1
        elif data[skip : skip + 2] == b"\r\n":
            skip += 2
        else:
            break
    if skip:
        buf.maybe_extract_at_most(skip)
    # Where h11 will find the head's end, searched from where h11 will search.
    end = _HEAD_END.search(data, buf._multiple_lines_search)
    if end is not None and _BARE_LF.search(data, 0, end.end()) is not None:
        raise h11.LocalProtocolError("bare LF in the request head")
    return maybe_read_from_IDLE_client(buf)


class GuardedH11Protocol(H11Protocol):
    """`H11Protocol` that refuses ambiguous or malformed requests before the app sees them,
    never parses what follows a request that ends the connection, and never switches to h2c."""

    _refused = False
    """The connection answered a refusal and is closing: nothing more is read."""

    _lingering = False
    """The answer went out before the request's body arrived: what the client still sends is
    read and dropped until it closes, or the idle timer closes the connection."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection = _StrictConnection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )

    async def handle(self, event: Event) -> None:
        if isinstance(event, RawData) and self._ignores_input():
            return  # RFC 9112 §9.6: not processed, nor kept until the answer is out
        await super().handle(event)

    def _ignores_input(self) -> bool:
        connection = self.connection
        if isinstance(connection, h11.Connection):
            return self._refused or self._lingering or connection.their_state in _CLOSING
        return False  # a WebSocket's frames

    async def _maybe_recycle(self) -> None:
        connection = self.connection
        if (
            isinstance(connection, h11.Connection)
            and connection.their_state is h11.SEND_BODY
            and connection.our_state in (h11.DONE, h11.MUST_CLOSE)
            and not self.context.terminated.is_set()
        ):
            # Answered before the body arrived (a 413, a 401): closed now, with the body's
            # bytes unread, the connection is reset, and a client still writing them loses
            # the answer. They are read and dropped instead, as nginx's lingering close (and
            # the plain listener) does; the client closes once it has the answer, or the
            # idle timer (the head deadline) closes the connection.
            await self._close_stream()
            self._lingering = True
            await self.send(Updated(idle=True))
            return
        await super()._maybe_recycle()

    async def _handle_events(self) -> None:
        # hypercorn's loop, with the request checked before its stream starts, no h2c
        # upgrade, and a stop after a request that ends the connection.
        while True:
            connection = self.connection
            if isinstance(connection, h11.Connection) and connection.their_state in _CLOSING:
                break  # h11 would raise on any byte after it, and hypercorn answer 400
            if connection.they_are_waiting_for_100_continue:
                await self._send_h11_event(
                    h11.InformationalResponse(
                        status_code=100, headers=self.config.response_headers("h11")
                    )
                )
            try:
                event = connection.next_event()
            except h11.RemoteProtocolError as error:
                if connection.our_state in {h11.IDLE, h11.SEND_RESPONSE}:
                    await self._refuse(error.error_status_hint)
                else:
                    await self.send(Closed())
                break
            if isinstance(event, h11.Request):
                await self.send(Updated(idle=False))
                if not self.ssl and _is_h2_preface(event):
                    raise H2ProtocolAssumedError(
                        b"PRI * HTTP/2.0\r\n\r\n" + connection.trailing_data[0]
                    )
                refusal = _refusal(event)
                if refusal is None and event.http_version != b"1.1":
                    event, refusal = _as_http11(event)
                if refusal is not None:
                    await self._refuse(*refusal, head=event.method == b"HEAD")
                    break
                await self._create_stream(event)
            elif event is h11.PAUSED:
                await self.can_read.clear()
                await self.can_read.wait()
            elif isinstance(event, h11.ConnectionClosed) or event is h11.NEED_DATA:
                break
            elif self.stream is None:
                break
            elif isinstance(event, h11.Data):
                await self.stream.handle(Body(stream_id=STREAM_ID, data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                await self.stream.handle(EndBody(stream_id=STREAM_ID))
            elif isinstance(event, Data):  # a WebSocket's bytes, passed through
                await self.stream.handle(event)

    async def _refuse(self, status: int, reason: str = "", *, head: bool = False) -> None:
        """Answer `status` with `reason` (its phrase when empty) as a text body, and close."""
        self._refused = True
        counted: Callable[[int], None] | None = getattr(
            self.config, ON_REFUSED_REQUEST_ATTRIBUTE, None
        )
        if counted is not None:
            counted(status)
        body = f"{reason or HTTPStatus(status).phrase}\n".encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"x-request-id", os.urandom(16).hex().encode()),  # one to quote, as the app's
            *self.config.response_headers("h11"),
        ]
        await self._send_h11_event(h11.Response(status_code=status, headers=headers))
        if not head:  # h11 refuses a body in the answer to HEAD
            await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())
        await self.send(Closed())


def _is_h2_preface(request: h11.Request) -> bool:
    """Whether `request` is how h11 reads the start of the HTTP/2 connection preface."""
    return request.method == b"PRI" and request.target == b"*" and request.http_version == b"2.0"


def _as_http11(request: h11.Request) -> tuple[h11.Request, tuple[int, str] | None]:
    """`request` as the app sees it: one of a later HTTP/1 minor version (`HTTP/1.2`) as
    HTTP/1.1 (RFC 9112 §2.3: processed as the highest minor version this server conforms
    to), which then needs its Host header (h11 asks it of `1.1` alone); else unchanged."""
    if request.http_version == b"1.0":
        return request, None
    try:
        served = h11.Request(
            method=request.method,
            headers=request.headers,
            target=request.target,
            http_version=b"1.1",
            _parsed=True,
        )
    except h11.LocalProtocolError:
        return request, (400, "Bad Request: no Host header (RFC 9112 §3.2)")
    return served, None


def _refusal(request: h11.Request) -> tuple[int, str] | None:
    """The status and reason to refuse `request` with, or None to serve it."""
    if request.http_version[:2] != b"1.":
        return 505, "HTTP version not supported: HTTP/1 only"
    if request.method != request.method.upper():
        # hypercorn would upper-case it into another method.
        return 400, "Bad Request: methods are case-sensitive"
    framing: set[bytes] = set()
    for name, value in request.headers:
        if _CONTROL.search(value):
            return 400, "Bad Request: control character in a header value"
        if name in (b"content-length", b"transfer-encoding"):
            framing.add(name)
    if len(framing) == 2:
        return 400, "Bad Request: both Content-Length and Transfer-Encoding"
    if b"transfer-encoding" in framing and request.http_version == b"1.0":
        return 400, "Bad Request: Transfer-Encoding in HTTP/1.0"
    return None


def install() -> None:
    """Make hypercorn's HTTP/1.1 connections use `GuardedH11Protocol` (idempotent)."""
    for distribution, tested in (("hypercorn", TESTED_MINOR), ("h11", TESTED_H11_MINOR)):
        found = off_pin(distribution, tested)
        if found is not None:
            raise RuntimeError(
                f"transport.hypercorn_h11 is written for {distribution} {tested}.x, found "
                f"{found}: check whether upstream refuses Content-Length with "
                "Transfer-Encoding and dropped the h2c upgrade, and re-test before moving the pin"
            )
    hypercorn.protocol.H11Protocol = GuardedH11Protocol  # type: ignore[misc]


__all__ = [
    "ON_REFUSED_REQUEST_ATTRIBUTE",
    "TESTED_H11_MINOR",
    "TESTED_MINOR",
    "GuardedH11Protocol",
    "install",
]
