"""HTTP/1.1 on the TLS listener (`transport.hypercorn_h11`): a request with both
`Content-Length` and `Transfer-Encoding` is refused before the app sees it, what follows a
request that ends the connection is ignored and its answer goes out whole, `Upgrade: h2c` is
never acted on, and what llhttp refuses on the plain listener is refused here too: each with a
short text body, and a close. Raw TLS sockets (ALPN `http/1.1`) against the real listener."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from certs import DevCertificates
from transport.asgi import Receive, Scope, Send
from transport.tcp import TcpListener, TcpOptions
from transport.tls import TlsMaterial

READ_WAIT = 5.0
"""Seconds a test waits for an answer or a close: far over what either takes."""

CHAT = b'{"model":"m","messages":[]}'


@dataclass
class _App:
    """Answers each request with its method, path and body length once it has the body;
    `/hold` only once `release` is set."""

    seen: list[tuple[str, str]] = field(default_factory=list)
    """(method, path) of each request that reached the app."""
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        self.seen.append((scope["method"], scope["path"]))
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        if scope["path"] == "/hold":
            self.holding.set()
            await self.release.wait()
        body = f"{scope['method']} {scope['path']} {size}".encode()
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@dataclass
class _Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


@dataclass
class _Conn:
    """One TLS connection with ALPN `http/1.1`, written to raw and read answer by answer."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pending: bytearray = field(default_factory=bytearray)

    async def answer(self, *, head: bool = False) -> _Answer:
        """The next answer (framed by its `content-length`; none for a 1xx, or for the answer
        to HEAD: `head`)."""
        while b"\r\n\r\n" not in self.pending:
            await self._more()
        top, _, rest = bytes(self.pending).partition(b"\r\n\r\n")
        lines = top.split(b"\r\n")
        assert lines[0].startswith(b"HTTP/1.1 "), lines[0]
        status = int(lines[0].split()[1])
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
        size = 0 if status < 200 or head else int(headers[b"content-length"])
        while len(rest) < size:
            await self._more()
            rest = bytes(self.pending).partition(b"\r\n\r\n")[2]
        self.pending = bytearray(rest[size:])
        return _Answer(status, headers, rest[:size])

    async def closed(self) -> bool:
        """Whether the server closes the connection (True), or sends more first (False)."""
        if self.pending:
            return False
        try:
            data = await asyncio.wait_for(self.reader.read(65536), READ_WAIT)
        except (ConnectionError, ssl.SSLError):
            return True
        return not data

    async def _more(self) -> None:
        data = await asyncio.wait_for(self.reader.read(65536), READ_WAIT)
        assert data, f"closed before a whole answer: {bytes(self.pending)!r}"
        self.pending += data


@dataclass
class _Served:
    listener: TcpListener
    app: _App
    context: ssl.SSLContext
    conns: list[_Conn] = field(default_factory=list)

    async def connect(self) -> _Conn:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", self.listener.port, ssl=self.context, server_hostname="localhost"
        )
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
        self.conns.append(_Conn(reader, writer))
        return self.conns[-1]

    async def refused(self, request: bytes, status: int) -> _Answer:
        """Sends `request` on a new connection: it must be answered `status` with a text
        body, before the app saw it, and the connection closed."""
        conn = await self.connect()
        conn.writer.write(request)
        head = request.startswith(b"HEAD ")
        answer = await conn.answer(head=head)
        assert (answer.status, answer.headers[b"connection"]) == (status, b"close")
        assert answer.headers[b"content-type"].startswith(b"text/plain")
        assert answer.body.strip() or head
        assert await conn.closed()
        assert self.app.seen == []
        return answer


@pytest.fixture
async def served(tls: TlsMaterial, dev_certs: DevCertificates) -> AsyncIterator[_Served]:
    app = _App()
    listener = TcpListener(app, host="127.0.0.1", port=0, tls=tls, options=TcpOptions())
    await listener.start()
    context = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
    context.set_alpn_protocols(["http/1.1"])
    served = _Served(listener, app, context)
    try:
        yield served
    finally:
        app.release.set()
        for conn in served.conns:
            conn.writer.close()
        await listener.stop()


def _post(*headers: bytes, body: bytes, version: bytes = b"1.1", path: bytes = b"/chat") -> bytes:
    head = b"POST %s HTTP/%s\r\nHost: x\r\n" % (path, version)
    return head + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def _chunked(data: bytes, extension: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n0\r\n\r\n" % (len(data), extension, data)


async def test_content_length_with_transfer_encoding_is_refused_and_what_it_hides_never_runs(
    served: _Served,
) -> None:
    """A front end framing by Content-Length sees one request; hypercorn framed it by the
    chunked coding, kept the connection and ran the bytes after the chunks as a second one."""
    smuggled = _post(b"Content-Length: %d" % len(CHAT), body=CHAT, path=b"/smuggled")
    body = b"0\r\n\r\n" + smuggled
    for headers in (
        (b"Content-Length: %d" % len(body), b"Transfer-Encoding: chunked"),
        (b"Transfer-Encoding: chunked", b"Content-Length: %d" % len(body)),
    ):
        answer = await served.refused(_post(*headers, body=body), 400)
        assert b"Content-Length and Transfer-Encoding" in answer.body


async def test_transfer_encoding_in_http10_is_refused(served: _Served) -> None:
    """RFC 9112 §6.1: such framing is faulty; hypercorn read it chunked."""
    request = _post(b"Transfer-Encoding: chunked", body=_chunked(CHAT), version=b"1.0")
    await served.refused(request, 400)


@pytest.mark.parametrize(
    ("request_", "extra"),
    [
        (_post(b"Connection: close", b"Content-Length: %d" % len(CHAT), body=CHAT), b"\r\n"),
        (_post(b"Content-Length: %d" % len(CHAT), body=CHAT, version=b"1.0"), b"\r\n"),
        (
            _post(b"Connection: close", b"Content-Length: %d" % len(CHAT), body=CHAT),
            b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
        (b"GET /close HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"\x00junk"),
    ],
    ids=["close-crlf", "http10-crlf", "close-pipelined", "close-junk"],
)
async def test_bytes_after_a_request_that_closes_are_ignored_and_its_answer_delivered(
    served: _Served, request_: bytes, extra: bytes
) -> None:
    """In the same write: h11 raised on them, and hypercorn wrote 400 over the request the app
    had already started."""
    conn = await served.connect()
    conn.writer.write(request_ + extra)
    answer = await conn.answer()
    assert answer.status == 200
    method, path = served.app.seen[0]
    assert len(served.app.seen) == 1 and answer.body.startswith(f"{method} {path} ".encode())
    assert await conn.closed()


async def test_bytes_that_arrive_while_a_closing_request_is_answered_are_ignored(
    served: _Served,
) -> None:
    conn = await served.connect()
    conn.writer.write(b"GET /hold HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await asyncio.wait_for(served.app.holding.wait(), READ_WAIT)
    conn.writer.write(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
    await conn.writer.drain()
    await asyncio.sleep(0.05)  # read by the server before the answer, usually; never wrong
    served.app.release.set()
    answer = await conn.answer()
    assert (answer.status, answer.body) == (200, b"GET /hold 0")
    assert await conn.closed()
    assert served.app.seen == [("GET", "/hold")]


@pytest.mark.parametrize(
    "request_",
    [
        b"GET /models HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\n\r\n",
        b"GET /models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n",
        b"GET /models HTTP/1.0\r\nUpgrade: h2c\r\n\r\n",
    ],
    ids=["bare", "full", "http10"],
)
async def test_upgrade_to_h2c_over_tls_is_ignored_and_the_request_served_as_http11(
    served: _Served, request_: bytes
) -> None:
    """hypercorn answered 101 and spoke HTTP/2 on the connection: never over TLS, where h2
    is negotiated by ALPN (RFC 9113 §3.1, §3.2)."""
    conn = await served.connect()
    conn.writer.write(request_)
    answer = await conn.answer()
    assert (answer.status, answer.body) == (200, b"GET /models 0")
    if b"HTTP/1.1" in request_:  # and the connection goes on as HTTP/1.1
        conn.writer.write(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await conn.answer()
        assert (answer.status, answer.body) == (200, b"GET /next 0")


@pytest.mark.parametrize(
    ("request_", "status"),
    [
        (b"GET /models HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"GET /models HTTP/3.0\r\nHost: x\r\n\r\n", 505),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
        (b"get /models HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /models HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n", 400),
        (b"GET /models HTTP/1.1\r\nHost: x\r\nX: a\x7fb\r\n\r\n", 400),
        (b"HEAD /models HTTP/1.1\r\nHost: x\r\nX: a\x1fb\r\n\r\n", 400),
        (b"GET /models HTTP/1.1\nHost: x\n\n", 400),
        (b"GET /models HTTP/1.1\r\nHost: x\nContent-Length: 5\r\n\r\nabcde", 400),
        (b"GET /models HTTP/1.1\r\nHost: x\r\n\n", 400),
    ],
    ids=[
        *("http2", "http3", "h2-preface", "lowercase-method", "ctl-01", "del", "head-ctl"),
        *("bare-lf-lines", "bare-lf-in-a-field", "bare-lf-ending"),
    ],
)
async def test_a_request_the_plain_listener_refuses_is_refused_before_the_app(
    served: _Served, request_: bytes, status: int
) -> None:
    """h11 parsed each, and hypercorn served it (`get` as `GET`)."""
    await served.refused(request_, status)


@pytest.mark.parametrize(
    "chunks",
    [
        b"%x;a\rb\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT),
        b"ffffffffffffffffffff\r\nab",
        b"10000000000000000\r\nab",
    ],
    ids=["bare-cr-in-extension", "20-hex-digits", "65-bits"],
)
async def test_a_malformed_chunk_line_is_refused_at_once(served: _Served, chunks: bytes) -> None:
    """h11 took a bare CR in an extension, and a size of up to 20 hex digits, waiting for
    2^80 bytes until the body deadline; the app has started reading by then."""
    conn = await served.connect()
    conn.writer.write(_post(b"Transfer-Encoding: chunked", body=chunks))
    answer = await conn.answer()
    assert (answer.status, answer.headers[b"connection"]) == (400, b"close")
    assert answer.body.strip()
    assert await conn.closed()


async def test_well_formed_chunked_bodies_are_read_whole(served: _Served) -> None:
    """The stricter chunk-line check keeps what h11 allowed and RFC 9112 §7.1 does too:
    extensions, whitespace after the size, several chunks, leading zeros, trailers."""
    conn = await served.connect()
    chunks = (
        b'5;name=value;quoted="a b"\r\nhello\r\n'
        b"0006 \r\n world\r\n"
        b"%x\r\n%s\r\n" % (len(CHAT), CHAT) + b"0\r\nX-Trailer: yes\r\n\r\n"
    )
    for _ in range(2):
        conn.writer.write(_post(b"Transfer-Encoding: chunked", body=chunks))
        answer = await conn.answer()
        assert (answer.status, answer.body) == (200, b"POST /chat %d" % (11 + len(CHAT)))


async def test_pipelined_keep_alive_requests_are_still_answered_in_order(served: _Served) -> None:
    """The override's copy of hypercorn's read loop keeps its pause between requests."""
    conn = await served.connect()
    conn.writer.write(b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(5)))
    answers = [await conn.answer() for _ in range(5)]
    assert [a.body for a in answers] == [b"GET /%d 0" % i for i in range(5)]
    assert [a.headers.get(b"connection") for a in answers] == [None] * 5


@pytest.mark.parametrize(
    ("first", "stray"),
    [
        (_post(b"Content-Length: %d" % len(CHAT), body=CHAT), b"\r\n"),
        (b"GET /models HTTP/1.1\r\nHost: x\r\n\r\n", b"\r\n\r\n"),
        (b"", b"\r\n"),
        (b"GET /models HTTP/1.1\r\nHost: x\r\n\r\n", b"\n"),
    ],
    ids=["after-a-body", "two-after-a-get", "before-the-first", "bare-lf"],
)
async def test_empty_lines_before_a_request_are_ignored(
    served: _Served, first: bytes, stray: bytes
) -> None:
    """RFC 9112 §2.2: a server SHOULD ignore at least one empty line before a request line, as
    the plain listener does (some clients end a body with a CRLF it does not count). h11
    answered the next request 400 and closed the connection."""
    conn = await served.connect()
    conn.writer.write(first + stray + b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
    if first:
        assert (await conn.answer()).status == 200
    answer = await conn.answer()
    assert (answer.status, answer.body) == (200, b"GET /next 0")
    assert answer.headers.get(b"connection") is None  # kept alive


async def test_a_refusal_leaves_the_other_connections_serving(served: _Served) -> None:
    kept = await served.connect()
    kept.writer.write(b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await kept.answer()).status == 200
    bad = await served.connect()
    bad.writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n")
    bad.writer.write(b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    answer = await bad.answer()
    assert answer.status == 400 and await bad.closed()
    kept.writer.write(b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await kept.answer()).body == b"GET /two 0"


async def test_h11s_own_refusals_carry_a_text_body(served: _Served) -> None:
    """hypercorn's answer to what h11 refuses (here a request line with no version) was empty."""
    answer = await served.refused(b"GET /models\r\nHost: x\r\n\r\n", 400)
    assert answer.body == b"Bad Request\n"
