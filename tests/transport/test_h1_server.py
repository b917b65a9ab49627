"""transport.h1_server over real sockets: raw asyncio streams and httpx."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httptools
import httpx
import pytest

from tests.helpers import settled, wait_until
from tests.transport.apps import RecordingApp, collector_finds, ok_app
from transport.asgi import ASGIApp, Message, Receive, Scope, Send
from transport.h1_cycle import _Cycle
from transport.h1_protocol import DISCARD_MAX, MAX_PIPELINED
from transport.h1_server import H1Listener
from transport.tcp import TcpOptions

Response = tuple[int, dict[str, str], bytes]
GET = b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n"


@asynccontextmanager
async def serving(app: ASGIApp, **options: Any) -> AsyncIterator[H1Listener]:
    listener = H1Listener(app, host="127.0.0.1", port=0, options=TcpOptions(**options))
    await listener.start()
    try:
        yield listener
    finally:
        await listener.stop()


@asynccontextmanager
async def connect(
    listener: H1Listener,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    try:
        yield reader, writer
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader, *, head_only: bool = False) -> Response:
    """One response: framed by content-length, chunked, or the connection's end."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            assert name.lower() not in headers, f"{name} twice"
            headers[name.lower()] = value.strip()
    if head_only or status in (100, 204, 304):
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                assert await reader.readuntil(b"\r\n") == b"\r\n"
                return status, headers, body
            body += (await reader.readexactly(size + 2))[:-2]
    return status, headers, await asyncio.wait_for(reader.read(), 5)


async def at_eof(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(1), 5) == b""


async def test_scope_extensions_and_keep_alive_over_httpx() -> None:
    app = RecordingApp()
    async with serving(app) as listener, httpx.AsyncClient() as client:
        url = f"http://127.0.0.1:{listener.port}"
        r1 = await client.post(f"{url}/echo?x=1", content=b"abc")
        r2 = await client.get(f"{url}/a%20b")
    assert r1.status_code == 200 and r2.status_code == 200
    view = json.loads(r1.content)
    assert view == {
        "path": "/echo",
        "early_data": False,
        "transport": "h1",
        "handshake_wait_s": 0.0,
        "body_bytes": 3,
        "http_version": "1.1",
    }
    assert app.seen[1].path == "/a b"
    assert ("host", f"127.0.0.1:{listener.port}") in [
        (n.decode(), v.decode()) for n, v in app.seen[0].headers
    ]


async def test_scope_shape() -> None:
    scopes: list[Scope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scopes.append({**scope, "extensions": dict(scope["extensions"])})  # as the app saw it
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body"})

    async with serving(app) as listener, connect(listener) as (reader, writer):
        sent = time.perf_counter()
        writer.write(b"GET /p%2Fq?a=b&c HTTP/1.1\r\nHost: x\r\nX-Y: z \t\r\n\r\n")
        status, headers, _ = await read_response(reader)
        answered = time.perf_counter()
    assert status == 204 and "content-length" not in headers
    scope = scopes[0]
    assert scope["type"] == "http" and scope["asgi"]["version"] == "3.0"
    assert scope["method"] == "GET" and scope["scheme"] == "http"
    assert scope["path"] == "/p/q" and scope["raw_path"] == b"/p%2Fq"
    assert scope["query_string"] == b"a=b&c" and scope["root_path"] == ""
    assert scope["headers"] == [(b"host", b"x"), (b"x-y", b"z")]  # names lowercased
    assert scope["server"] == ("127.0.0.1", listener.port)
    assert scope["client"][0] == "127.0.0.1"
    extensions = dict(scope["extensions"])
    assert sent <= extensions.pop("arrived_at") <= answered  # the read of the head
    writer = extensions.pop("quicedge.body_writer")  # writes without an await (the relay's)
    assert callable(writer.write_body) and callable(writer.drained)
    assert callable(extensions.pop("quicedge.on_disconnect"))  # a callback, not a task
    assert extensions == {"transport": "h1", "early_data": False, "handshake_wait_s": 0.0}


async def test_the_disconnect_callback_runs_once_when_the_client_leaves_mid_response() -> None:
    calls: list[str] = []
    started = asyncio.Event()
    done = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        on_disconnect = scope["extensions"]["quicedge.on_disconnect"]
        if scope["path"] == "/unregistered":
            on_disconnect(lambda: calls.append("unregistered"))
            on_disconnect(None)
        else:
            on_disconnect(lambda: calls.append(scope["path"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        started.set()
        while (await receive())["type"] != "http.disconnect":
            pass
        done.set()

    async with serving(app) as listener:
        for path in ("/leave", "/unregistered"):
            started.clear()
            done.clear()
            async with connect(listener) as (reader, writer):
                writer.write(b"GET %b HTTP/1.1\r\nhost: x\r\n\r\n" % path.encode())
                await asyncio.wait_for(started.wait(), 5)
            await asyncio.wait_for(done.wait(), 5)
    assert calls == ["/leave"]


async def test_tcp_nodelay_on_accepted_connections() -> None:
    async with serving(RecordingApp()) as listener, connect(listener) as (reader, writer):
        writer.write(GET)
        await read_response(reader)
        (conn,) = listener.connections
        sock = conn._transport.get_extra_info("socket")  # type: ignore[union-attr]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_pipelined_requests_are_answered_in_order() -> None:
    app = RecordingApp()
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nab"
            b"GET /stream?n=2 HTTP/1.1\r\nhost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            b"3\r\nxyz\r\n0\r\n\r\n"
        )
        first = await read_response(reader)
        for _ in range(2):
            app.release.put_nowait(None)
        second = await read_response(reader)
        third = await read_response(reader)
    assert json.loads(first[2])["body_bytes"] == 2
    assert second[1]["transfer-encoding"] == "chunked" and second[2] == b"0;1;"
    assert json.loads(third[2])["body_bytes"] == 3
    assert [s.path for s in app.seen] == ["/echo", "/stream", "/echo"]


async def test_chunked_and_streamed_request_bodies() -> None:
    messages: list[Message] = []
    first = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            messages.append(message)
            first.set()
            if not message.get("more_body"):
                break
        body = b"".join(m["body"] for m in messages)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(
            b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n4\r\nabcd\r\n"
        )
        await writer.drain()
        await asyncio.wait_for(first.wait(), 5)
        assert messages[0] == {"type": "http.request", "body": b"abcd", "more_body": True}
        writer.write(b"2;ext=1\r\nef\r\n0\r\n\r\n")
        status, _, body = await read_response(reader)
    assert (status, body) == (200, b"abcdef")
    assert messages[-1]["more_body"] is False


async def test_every_split_of_a_request_is_parsed_the_same() -> None:
    app = RecordingApp()
    request = (
        b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n" + GET
    )
    async with serving(app) as listener:
        for cut in range(1, len(request)):
            async with connect(listener) as (reader, writer):
                writer.write(request[:cut])
                await writer.drain()
                await asyncio.sleep(0)
                writer.write(request[cut:])
                one = await read_response(reader)
                two = await read_response(reader)
            assert json.loads(one[2])["body_bytes"] == 5, cut
            assert two[0] == 200, cut


async def test_expect_100_continue() -> None:
    app = RecordingApp()
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(
            b"POST /echo HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 3\r\n\r\n"
        )
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(b"abc")
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["body_bytes"] == 3
        writer.write(GET)  # and the connection goes on
        assert (await read_response(reader))[0] == 200


async def test_expect_100_refused_without_reading_closes() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 417, "headers": []})
        await send({"type": "http.response.body", "body": b"no"})

    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(
            b"POST / HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 3\r\n\r\n"
        )
        status, headers, body = await read_response(reader)
        assert (status, body) == (417, b"no")  # no 100 first: the app never asked for the body
        assert headers["connection"] == "close"  # and the client is told
        assert await at_eof(reader)


async def refuse_unread(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers 404 to a POST without reading its body (as an unknown route is), else `ok_app`."""
    if scope["method"] == "POST":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"no"})
    else:
        await ok_app(scope, receive, send)


@pytest.mark.parametrize(
    "body",
    [b"content-length: 5\r\n\r\n", b"transfer-encoding: chunked\r\n\r\n2\r\nab\r\n"],
    ids=["content-length", "chunked"],
)
async def test_a_body_answered_before_it_arrived_is_dropped_and_the_connection_goes_on(
    body: bytes,
) -> None:
    async with serving(refuse_unread) as listener, connect(listener) as (reader, writer):
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\n" + body)
        status, headers, answer = await read_response(reader)
        assert (status, answer) == (404, b"no") and "connection" not in headers
        # the rest of the body comes after the answer, and then the next request
        writer.write(b"hello" if b"content-length" in body else b"3\r\ncde\r\n0\r\n\r\n")
        writer.write(GET)
        assert (await read_response(reader))[0] == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_an_answer_before_a_body_past_the_discard_limit_reaches_a_client_still_sending(
    chunked: bool,
) -> None:
    """Closed with the rest of the body unread, the connection was reset, and a client that
    reads only once it has sent its whole body (Python's `http.client`) lost the answer. An
    answer to a declared body that large says `connection: close`; either way the connection
    reads on, dropping what comes, until the client closes it."""
    size = DISCARD_MAX + 64 * 1024
    if chunked:
        head, body = (
            b"transfer-encoding: chunked\r\n\r\n",
            b"%x\r\n%b\r\n0\r\n\r\n" % (size, b"y" * size),
        )
    else:
        head, body = b"content-length: %d\r\n\r\n" % size, b"y" * size
    async with serving(refuse_unread) as listener, connect(listener) as (reader, writer):
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\n" + head)
        await writer.drain()
        await asyncio.sleep(0.05)  # the answer goes out before the body comes
        writer.write(body)
        await writer.drain()
        status, headers, _ = await read_response(reader)
        assert status == 404 and (chunked or headers["connection"] == "close")
        assert await at_eof(reader)


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000 + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000, 431),
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n\r\n", 400),  # no Host (RFC 9112 §3.2)
        (b"GET / HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: x\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", 400),
        (
            b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n"
            b"transfer-encoding: chunked\r\n\r\n",
            400,  # RFC 9112 §6.1: request smuggling
        ),
        (b"GET / HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: x\r\nx-a: b\r\n c\r\n\r\n", 400),  # obs-fold
        (b"GET /\xc3\xa9 HTTP/1.1\r\nhost: x\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\nhost: x\r\n\r\n", 505),
        (b"GET / HTTP/1.1\r\nhost: a b/c@d\r\n\r\n", 400),  # not a host (RFC 9112 §3.2)
        (b"GET * HTTP/1.1\r\nhost: x\r\n\r\n", 400),  # `*` is for OPTIONS only
        (b"GET http://u@x/ HTTP/1.1\r\nhost: x\r\n\r\n", 400),
        (b"GET ftp://x/ HTTP/1.1\r\nhost: x\r\n\r\n", 400),
        (
            b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            501,  # a coding the app would get undecoded
        ),
        (b"POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (
            b"POST / HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: h2c\r\n"
            b"content-length: 3\r\n\r\nabc",
            400,  # the parser would skip the body of an upgrade
        ),
    ],
)
async def test_bad_requests_are_answered_and_closed(request_bytes: bytes, status: int) -> None:
    app = RecordingApp()
    async with serving(app, max_header_bytes=16 * 1024) as listener:
        async with connect(listener) as (reader, writer):
            writer.write(request_bytes)
            got, headers, _ = await read_response(reader)
            assert got == status and headers["connection"] == "close"
            assert await at_eof(reader)
        async with connect(listener) as (reader, writer):  # the listener is unharmed
            writer.write(GET)
            assert (await read_response(reader))[0] == 200


async def test_an_oversize_head_in_many_reads_is_refused() -> None:
    """The parser keeps a partial header line to itself: the bytes fed are counted too."""
    app = RecordingApp()
    async with serving(app, max_header_bytes=4096) as listener, connect(listener) as (r, w):
        w.write(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: ")
        for _ in range(9):  # one header line, never finished: 4.6 KB in all
            await asyncio.sleep(0.005)
            w.write(b"a" * 512)
            await w.drain()
        status, headers, _ = await read_response(r)
        assert (status, headers["connection"]) == (431, "close")
        assert await at_eof(r)
    assert app.seen == []


async def test_heads_in_many_reads_are_counted_per_request() -> None:
    app = RecordingApp()
    head = b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 3000 + b"\r\n\r\n"
    async with serving(app, max_header_bytes=4096) as listener, connect(listener) as (r, w):
        for _ in range(3):  # 9 KB of heads on one connection, each under the limit
            for at in range(0, len(head), 500):
                w.write(head[at : at + 500])
                await w.drain()
                await asyncio.sleep(0.002)
            assert (await read_response(r))[0] == 200
    assert len(app.seen) == 3


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, keep-alive\r\nupgrade: h2c\r\n\r\n",
        b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n",
    ],
)
async def test_upgrade_is_answered_as_http11_then_closed(request_bytes: bytes) -> None:
    """We speak no other protocol: the request gets an ordinary answer, what follows is not read."""
    app = RecordingApp()
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(request_bytes + b"\x00\x01 not http " + GET)
        status, headers, _ = await read_response(reader)
        assert (status, headers["connection"]) == (200, "close")
        assert await at_eof(reader)
    assert len(app.seen) == 1


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: keep-alive, Close\r\n\r\n",
        b"GET /echo HTTP/1.0\r\nconnection: keep-alive\r\n\r\n",
    ],
)
async def test_nothing_after_a_last_request_is_read(request_bytes: bytes) -> None:
    app = RecordingApp()
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(request_bytes + GET + b"NOT HTTP\r\n\r\n")
        status, headers, _ = await read_response(reader)
        assert (status, headers["connection"]) == (200, "close")
        assert await at_eof(reader)
    assert len(app.seen) == 1


@pytest.mark.parametrize(
    "bad",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n",
    ],
)
async def test_a_bad_request_behind_good_ones_is_answered_after_them(bad: bytes) -> None:
    app = RecordingApp()
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(b"GET /stream?n=1 HTTP/1.1\r\nhost: x\r\n\r\n" + GET + bad)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        app.release.put_nowait(None)  # the first answer is under way when the bad one is read
        assert await reader.readuntil(b"0\r\n\r\n") == b"2\r\n0;\r\n0\r\n\r\n"
        assert (await read_response(reader))[0] == 200
        status, headers, _ = await read_response(reader)
        assert (status, headers["connection"]) == (400, "close")
        assert await at_eof(reader)
    assert head.startswith(b"HTTP/1.1 200 ")
    assert [s.path for s in app.seen] == ["/stream", "/echo"]  # the bad one never reaches it


async def test_a_pipelined_request_waits_with_reading_paused() -> None:
    app = RecordingApp()
    size = 300_000
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(b"GET /stream?n=1 HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"y" * size)
        (conn,) = listener.connections
        transport = conn._transport
        assert transport is not None
        await wait_until(lambda: not transport.is_reading())  # the pipelined bytes arrived
        assert len(app.seen) == 1
        app.release.put_nowait(None)
        assert await reader.readuntil(b"0\r\n\r\n") == b"2\r\n0;\r\n0\r\n\r\n"
        status, _, body = await read_response(reader)
        assert (status, json.loads(body)["body_bytes"]) == (200, size)
        assert transport.is_reading()
        writer.write(GET)  # and the connection goes on
        assert (await read_response(reader))[0] == 200


async def test_disconnect_mid_response_reaches_the_app() -> None:
    app = RecordingApp()
    async with serving(app) as listener:
        async with connect(listener) as (reader, writer):
            writer.write(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
            await reader.readuntil(b"first\r\n")
        assert await asyncio.wait_for(app.disconnects.get(), 5) == "/hold"
    assert app.seen[0].disconnected


async def test_disconnect_while_the_app_waits_for_the_body() -> None:
    app = RecordingApp()
    async with serving(app) as listener:
        async with connect(listener) as (_, writer):
            writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nab")
            await writer.drain()
            await wait_until(lambda: len(app.seen) == 1)  # the app runs, waiting for the rest
        assert await asyncio.wait_for(app.disconnects.get(), 5) == "/echo"


async def test_send_waits_while_the_client_does_not_read() -> None:
    sent = 0
    chunk = b"x" * 65536

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal sent
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(400):  # 25 MiB
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent += 1
        await send({"type": "http.response.body", "body": b""})

    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(GET)
        assert await settled(lambda: sent) < 400  # held by the transport's high-water mark
        status, _, body = await read_response(reader)
    assert status == 200 and len(body) == 400 * len(chunk)


async def test_reading_pauses_while_the_app_does_not_read_the_body() -> None:
    release = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await release.wait()
        total = 0
        while True:
            message = await receive()
            total += len(message["body"])
            if not message["more_body"]:
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"%d" % total})

    size = 4 * 1024 * 1024
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"y" * size)
        await wait_until(lambda: len(listener.connections) == 1)
        (conn,) = listener.connections
        await wait_until(lambda: not conn._transport.is_reading())  # type: ignore[union-attr]
        release.set()
        status, _, body = await read_response(reader)
    assert (status, body) == (200, b"%d" % size)


async def test_head_response_has_no_body() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]}
        )
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else b"hello"}
        )

    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n" + GET)
        status, headers, _ = await read_response(reader, head_only=True)
        assert (status, headers["content-length"]) == (200, "5")
        assert await read_response(reader) == (200, {"content-length": "5"}, b"hello")


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        b"GET /echo HTTP/1.0\r\n\r\n",
    ],
)
async def test_connection_close_and_http10(request_bytes: bytes) -> None:
    app = RecordingApp()
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(request_bytes)
        status, headers, body = await read_response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await at_eof(reader)
    assert json.loads(body)["http_version"] == request_bytes.split(b"\r\n")[0][-3:].decode()


async def test_a_connection_retires_after_its_max_requests_with_its_last_answer_whole() -> None:
    """`max_requests` 3: the third answer says `connection: close` and the connection ends;
    a fourth request pipelined behind it is not read (the client sends it again elsewhere)."""
    async with serving(RecordingApp(), max_requests=3) as listener, connect(listener) as io:
        reader, writer = io
        for _ in range(2):
            writer.write(GET)
            status, headers, _ = await read_response(reader)
            assert status == 200 and "connection" not in headers
        writer.write(GET + GET)
        status, headers, body = await read_response(reader)
        assert status == 200 and headers["connection"] == "close" and body
        assert await at_eof(reader)
    async with serving(RecordingApp()) as uncapped, connect(uncapped) as (reader, writer):
        for _ in range(5):  # no cap by default
            writer.write(GET)
            assert "connection" not in (await read_response(reader))[1]


async def test_http10_streamed_response_ends_with_the_connection() -> None:
    app = RecordingApp()
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(b"GET /stream?n=2 HTTP/1.0\r\n\r\n")
        app.release.put_nowait(None)
        app.release.put_nowait(None)
        status, headers, body = await read_response(reader)
    assert "transfer-encoding" not in headers and body == b"0;1;"


async def test_app_connection_close_header_closes() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"Connection", b"close")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"bye"})

    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(GET)
        assert await read_response(reader) == (
            200,
            {"transfer-encoding": "chunked", "connection": "close"},
            b"bye",
        )
        assert await at_eof(reader)


async def test_idle_keep_alive_connections_time_out() -> None:
    async with serving(RecordingApp(), keep_alive_timeout=0.2) as listener:
        async with connect(listener) as (reader, writer):
            writer.write(GET)
            await read_response(reader)
            assert await at_eof(reader)
        async with connect(listener) as (reader, _):  # and a connection that never asks
            assert await at_eof(reader)


async def test_a_long_response_outlives_the_idle_timeout() -> None:
    app = RecordingApp()
    async with serving(app, keep_alive_timeout=0.1) as listener, connect(listener) as (r, w):
        w.write(b"GET /stream?n=2 HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.3)
        app.release.put_nowait(None)
        app.release.put_nowait(None)
        assert (await read_response(r))[2] == b"0;1;"


async def test_app_error_before_the_response_is_500() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/silent":
            return
        if scope["path"] == "/split":  # response splitting is refused
            headers = [(b"x", b"a\r\nset-cookie: b")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
        raise RuntimeError("boom")

    async with serving(app) as listener:
        for path in (b"/boom", b"/silent", b"/split"):
            async with connect(listener) as (reader, writer):
                writer.write(b"GET %b HTTP/1.1\r\nhost: x\r\n\r\n" % path)
                status, headers, _ = await read_response(reader)
                assert (status, headers["connection"]) == (500, "close")
                assert await at_eof(reader)


async def test_app_error_mid_response_closes_without_the_last_chunk() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        await asyncio.sleep(0.05)
        raise RuntimeError("boom")

    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(GET)
        with pytest.raises(asyncio.IncompleteReadError):
            await read_response(reader)


async def test_response_framing() -> None:
    """Chunked unless the app gives a length; the head is sent before the body is ready."""
    app = RecordingApp()
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert headers == {"transfer-encoding": "chunked"} and body == b"x" * 20000
        writer.write(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert (status, headers["transfer-encoding"]) == (200, "chunked")
        writer.write(b"GET /stream?n=1 HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)  # before any body
        assert b"transfer-encoding: chunked" in head
        app.release.put_nowait(None)
        assert await reader.readuntil(b"0\r\n\r\n") == b"2\r\n0;\r\n0\r\n\r\n"


async def test_no_body_for_204_and_304() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        status = int(scope["path"][1:])
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"dropped"})

    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(b"GET /204 HTTP/1.1\r\nhost: x\r\n\r\nGET /304 HTTP/1.1\r\nhost: x\r\n\r\n")
        assert await read_response(reader) == (204, {}, b"")
        assert await read_response(reader) == (304, {}, b"")
        writer.write(b"GET /200 HTTP/1.1\r\nhost: x\r\n\r\n")
        assert await read_response(reader) == (200, {"transfer-encoding": "chunked"}, b"dropped")


@pytest.mark.parametrize("body", [b"abc", b"abcdefg"])
async def test_body_that_misses_its_content_length_closes(body: bytes) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(GET + GET)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert len(await asyncio.wait_for(reader.read(), 5)) <= 5  # then the end, no 2nd answer


async def test_drain_finishes_open_responses_and_closes_idle_connections() -> None:
    app = RecordingApp()
    listener = H1Listener(app, host="127.0.0.1", port=0, options=TcpOptions(graceful_timeout=5))
    await listener.start()
    async with connect(listener) as (busy_r, busy_w), connect(listener) as (idle_r, idle_w):
        idle_w.write(GET)
        await read_response(idle_r)
        busy_w.write(b"GET /stream?n=1 HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await asyncio.wait_for(busy_r.readuntil(b"\r\n\r\n"), 5)
        stopping = asyncio.create_task(listener.stop())
        assert await at_eof(idle_r)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", listener.port)
        assert not stopping.done()
        app.release.put_nowait(None)
        assert await busy_r.readuntil(b"0\r\n\r\n") == b"2\r\n0;\r\n0\r\n\r\n"
        assert await at_eof(busy_r)
        await asyncio.wait_for(stopping, 5)
    assert b"200" in head


async def test_drain_timeout_cuts_what_is_left() -> None:
    app = RecordingApp()
    listener = H1Listener(app, host="127.0.0.1", port=0, options=TcpOptions(graceful_timeout=0.2))
    await listener.start()
    async with connect(listener) as (reader, writer):
        writer.write(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        await reader.readuntil(b"first\r\n")
        await asyncio.wait_for(listener.stop(), 5)
        assert await asyncio.wait_for(app.disconnects.get(), 5) == "/hold"


async def test_listener_never_started_releases_its_port() -> None:
    listener = H1Listener(RecordingApp(), host="127.0.0.1", port=0)
    port = listener.port
    await listener.stop()
    again = H1Listener(RecordingApp(), host="127.0.0.1", port=port)
    await again.stop()


@pytest.mark.parametrize(
    "scenario",
    [
        test_scope_shape,
        test_tcp_nodelay_on_accepted_connections,
        test_pipelined_requests_are_answered_in_order,
        test_a_pipelined_request_waits_with_reading_paused,
        test_expect_100_continue,
        test_disconnect_mid_response_reaches_the_app,
        test_send_waits_while_the_client_does_not_read,
        test_reading_pauses_while_the_app_does_not_read_the_body,
        test_drain_finishes_open_responses_and_closes_idle_connections,
    ],
)
def test_on_uvloop(scenario: Any) -> None:
    """uvloop's transports (the default loop of ``quicedge serve``) behave the same."""
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


async def test_the_body_writer_writes_a_whole_response_with_its_head() -> None:
    """`write_head` frames the head, the first body bytes and (more=False) the end together;
    the connection then serves the next request."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body_writer = scope["extensions"]["quicedge.body_writer"]
        await receive()
        start = {"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]}
        assert body_writer.write_head(start, b"data: 1\n\n", more=False)
        with pytest.raises(RuntimeError, match="sent twice"):
            body_writer.write_head(start)

    async with serving(app) as listener, connect(listener) as (reader, writer):
        for _ in range(2):
            writer.write(GET)
            status, headers, body = await read_response(reader)
            assert status == 200 and headers["x-a"] == "1" and body == b"data: 1\n\n"
            assert headers["transfer-encoding"] == "chunked"


async def test_a_served_request_leaves_no_reference_cycle() -> None:
    """What a request allocates is freed by reference counting when it is done, not left for
    the garbage collector, whose every collection stalls every request in flight."""
    with collector_finds() as found:
        async with serving(ok_app) as listener, connect(listener) as (reader, writer):
            for _ in range(3):
                writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nab")
                assert (await read_response(reader))[0] == 200
    assert [o for o in found if isinstance(o, _Cycle)] == []


async def test_trailer_fields_reach_no_request() -> None:
    """llhttp reports trailer fields as it does header fields: they became headers of the
    connection's next request (a trailer `x-request-id` or `authorization` set the next
    request's, and a trailer `host` made it a 400)."""
    app = RecordingApp()
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(
            b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            b"2\r\nab\r\n0\r\nx-injected: 1\r\nhost: y\r\n\r\n" + GET
        )
        assert (await read_response(reader))[0] == 200
        assert (await read_response(reader))[0] == 200
    assert [dict(s.headers) for s in app.seen] == [
        {b"host": b"x", b"transfer-encoding": b"chunked"},
        {b"host": b"x"},
    ]


@pytest.mark.parametrize(
    "framing",
    [b"0\r\n" + b"x-t: y\r\n" * 4000, b"5;" + b"e" * 40_000],
    ids=["trailers", "chunk-extension"],
)
async def test_a_body_framed_past_the_head_limit_is_refused(framing: bytes) -> None:
    """llhttp reads chunk extensions and trailer sections of any size: one client fed 3 GB of
    extension in 4 s, and a trailer flood held 1.5 GB after the client left."""
    async with serving(ok_app, max_header_bytes=16 * 1024) as listener:
        async with connect(listener) as (reader, writer):
            writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
            for start in range(0, len(framing), 1000):  # in pieces: no read ends the body
                writer.write(framing[start : start + 1000])
                await writer.drain()
                await asyncio.sleep(0)
            status, headers, _ = await read_response(reader)
            assert status == 431 and headers["connection"] == "close"


async def test_many_small_chunks_are_not_framing_past_the_limit() -> None:
    body = b"1\r\nz\r\n" * 5000 + b"0\r\nx-t: y\r\n\r\n"
    async with serving(RecordingApp(), max_header_bytes=1024) as listener:
        async with connect(listener) as (reader, writer):
            writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
            for start in range(0, len(body), 700):
                writer.write(body[start : start + 700])
                await writer.drain()
            status, _, answer = await read_response(reader)
            assert status == 200 and json.loads(answer)["body_bytes"] == 5000


async def test_a_closed_connection_leaves_no_reference_cycle_with_its_parser() -> None:
    """A parser refers to its protocol: left in place, it and what a partial line had buffered
    waited for a full collection (1.5 GB after a trailer flood)."""
    with collector_finds() as found:
        async with serving(ok_app) as listener, connect(listener) as (reader, writer):
            writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"1\r\na\r\n")
            await wait_until(
                lambda: any(c._reading and c._reading.received for c in listener.connections)
            )
            writer.write(b"0\r\nx-partial: " + b"v" * 4000)  # a trailer line never ended
            await wait_until(lambda: any(c._body_fed > 4000 for c in listener.connections))
    assert [o for o in found if isinstance(o, httptools.HttpRequestParser)] == []


async def test_pipelined_requests_wait_while_the_client_reads_no_answer() -> None:
    """Each answer was whole in the transport's buffer when the next pipelined request began:
    a client that pipelined requests and never read had every answer buffered (+544 MiB in
    20 s). Now the next waits for the client to read."""
    answered = 0
    answer = b"a" * 1_000_000

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal answered
        answered += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": answer})

    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(GET * 30)
        assert await settled(lambda: answered) < 30
        (connection,) = listener.connections
        assert connection._transport.get_write_buffer_size() < 2 * len(answer)
        for _ in range(30):  # and each is answered as the client reads
            status, _, body = await read_response(reader)
            assert status == 200 and body == answer


async def test_pipelined_requests_past_the_cap_get_503_and_the_connection_closes() -> None:
    """One read queued every request it held (4,411, 25 times its bytes): the one past
    `MAX_PIPELINED` waiting is answered 503 after those before it, as a client that pipelines
    retries what was not answered."""
    async with serving(ok_app) as listener, connect(listener) as (reader, writer):
        writer.write(GET * (MAX_PIPELINED + 20))
        statuses = []
        while not statuses or statuses[-1] == 200:
            statuses.append((await read_response(reader))[0])
        assert statuses[-1] == 503 and len(statuses) > MAX_PIPELINED
        assert await at_eof(reader)


async def test_an_absolute_form_target_is_served_with_its_authority_as_host() -> None:
    """RFC 9112 §3.2.2: a server accepts an absolute URI as the target, and its authority
    replaces the Host header's. The whole URI was taken for the path (404)."""
    app = RecordingApp()
    async with serving(app) as listener, connect(listener) as (reader, writer):
        writer.write(b"GET http://example.com:8080/echo?a=1 HTTP/1.1\r\nhost: other\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.write(b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
    seen = app.seen[0]
    assert seen.path == "/echo" and dict(seen.headers)[b"host"] == b"example.com:8080"
    assert app.seen[1].path == "*"
