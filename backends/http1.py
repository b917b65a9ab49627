"""HTTP/1.1 for the upstream pool, without I/O: response parsing and request encoding.

`ResponseParser` reads one connection's responses from whatever bytes it is fed, however they
are split; llhttp (`httptools`) does the framing in C. `encode_request` builds a request's head
and body as one write. Neither touches a socket, so both are tested byte by byte
(`tests/backends/test_http1.py`); `backends.connection` feeds the parser from its socket.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import httptools

MAX_RESPONSE_HEAD = 64 * 1024  # a status line and headers longer than this are refused
# Not HEAD: a response parser does not know the request's method, and would read the body a
# HEAD response announces but never sends.
METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
# Hop-by-hop headers (RFC 9110 §7.6.1) and framing headers the encoder sets itself.
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
# RFC 9110 §5.1 and §5.5: a header name is a token; a value holds no CR, LF or NUL.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(rb"[\r\n\x00]")
_TARGET = re.compile(r"/[\x21-\x7e]*")


class ResponseParser:
    """Sans-I/O reader of one connection's responses: llhttp (httptools) does the framing.

    llhttp checks the status line, the header syntax, Content-Length against Transfer-Encoding
    and the chunk framing in C, and hands over each piece of body as it is parsed: one callback
    per chunk instead of a pass through a Python state machine. The callbacks only record; the
    consumer takes the body bytes gathered so far in one piece (`take_body`).
    """

    __slots__ = (
        "_head_bytes",
        "_field_bytes",
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
        """Header fields of the final response, names lower-cased, in order."""
        self.head_done = False
        self.keep_alive = False
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.done = False
        """The whole response (head and body) was parsed."""
        self.extra = False
        """Bytes followed its end: nobody asked for them, so the connection is never reused."""
        self.error: str | None = None
        self._informational = False
        self._head_bytes = 0
        self._field_bytes = 0  # the fields of the head being parsed, as they end

    def feed(self, data: bytes) -> None:
        """Parse `data`; a framing error is recorded in `error`, never raised."""
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
        """The body bytes parsed and not yet taken, in one piece (b"" when none)."""
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
            self._field_bytes += len(name) + len(value) + 4  # ": " and CRLF

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if self._field_bytes > MAX_RESPONSE_HEAD:
            # A head whole within one read: `feed`'s own count stops where the head ends.
            self.error = f"response head over {MAX_RESPONSE_HEAD} bytes"
            return
        self._field_bytes = 0
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
        elif self.error is None:
            self.done = True


def encode_request(
    host_header: bytes,
    method: str,
    path: str,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes,
) -> bytes:
    """The request head and body as one write, framed by Content-Length.

    Raises ValueError on what would be invalid on the wire (a header injection, a target with
    spaces) instead of sending it: nothing in the result can be read as a second request.
    Hop-by-hop and framing headers in `headers` are dropped; the encoder sets its own."""
    if method not in METHODS:
        raise ValueError(f"invalid upstream request: method {method!r} is not supported")
    if _TARGET.fullmatch(path) is None:
        raise ValueError(f"invalid upstream request: bad target {path[:60]!r}")
    parts = [
        b"%b %b HTTP/1.1\r\nhost: %b\r\ncontent-length: %d\r\n"
        % (method.encode(), path.encode(), host_header, len(body))
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


__all__ = ["MAX_RESPONSE_HEAD", "METHODS", "ResponseParser", "encode_request"]
