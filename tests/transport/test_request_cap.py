"""A connection of the TLS listener that has served its `max_requests` retires without losing
an answer. Over HTTP/2: the requests in flight are answered whole, GOAWAY comes when it is
idle (or, for a client that never leaves it idle, gracefully, naming the last request taken), a
request past that is refused with REFUSED_STREAM, and the connection then closes (at once when
the client closes it; here, by the idle timer, short in these tests). Over HTTP/1.1: the last
answer says `connection: close`. A raw h2 client and httpx over TLS to the real listener."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx

from certs import DevCertificates
from transport.asgi import ASGIApp, Receive, Scope, Send
from transport.tcp import TcpListener, TcpOptions
from transport.tls import TlsMaterial

GOAWAY = 0x7
"""The GOAWAY frame's type (RFC 9113 §6.8)."""


@dataclass
class _Answers:
    """The app's side: `/hold` answers once `release` is set, `/slow` after 0.1 s, `/read`
    once it has the whole request body (none if the client is gone first), any other path at
    once; each body names its path."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a `/hold` request is waiting for `release`."""
    reading: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a `/read` request has a first piece of its body."""
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a `/read` request heard that its client is gone."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/hold":
            self.holding.set()
            await self.release.wait()
        elif path == "/slow":
            await asyncio.sleep(0.1)
        elif path == "/read":
            message = await receive()
            while message.get("more_body"):
                self.reading.set()
                message = await receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": path.encode() * 1000})


@dataclass
class _Client:
    """A raw h2 client that takes GOAWAY frames out of what it hands python-h2, which would
    refuse every later frame of the connection (python-hyper/h2#1181), and records them."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    conn: h2.connection.H2Connection
    paths: dict[int, str] = field(default_factory=dict)
    bodies: dict[int, bytearray] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)
    refused: dict[int, int] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    goaways: list[tuple[int, int]] = field(default_factory=list)
    """(last stream id, error code) of each GOAWAY, in order."""
    closed: bool = False
    _pending: bytearray = field(default_factory=bytearray)

    @classmethod
    async def open(cls, port: int, ca: Path, *, lenient: bool = False) -> _Client:
        """Connected and greeted; `lenient`: sends headers as given, malformed or not."""
        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.set_alpn_protocols(["h2"])
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=ctx, server_hostname="localhost"
        )
        config = h2.config.H2Configuration(
            client_side=True,
            validate_outbound_headers=not lenient,
            normalize_outbound_headers=not lenient,
        )
        conn = h2.connection.H2Connection(config)
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        return cls(reader, writer, conn)

    def get(
        self, path: str, headers: list[tuple[str, str]] | None = None, body: bytes | None = None
    ) -> int:
        """GET `path`; `headers` in place of the usual pseudo-headers, and a `body`, when
        given."""
        stream_id = self.conn.get_next_available_stream_id()
        if headers is None:
            headers = [(":method", "GET"), (":path", path), (":scheme", "https")]
            headers.append((":authority", "x"))
        self.conn.send_headers(stream_id, headers, end_stream=body is None)
        if body is not None:
            self.conn.send_data(stream_id, body, end_stream=True)
        self.writer.write(self.conn.data_to_send())
        self.paths[stream_id] = path
        self.bodies[stream_id] = bytearray()
        return stream_id

    def whole(self, stream_id: int) -> bool:
        """Whether the stream ended with its whole body."""
        path = self.paths[stream_id]
        return stream_id in self.ended and bytes(self.bodies[stream_id]) == path.encode() * 1000

    async def until_done(self, *stream_ids: int) -> None:
        """Reads until every one of `stream_ids` ended or was refused."""
        while not all(s in self.ended or s in self.refused for s in stream_ids):
            assert not self.closed, "the server closed the connection"
            await self._read()

    async def until_closed(self) -> None:
        while not self.closed:
            await self._read()

    async def _read(self) -> None:
        data = await asyncio.wait_for(self.reader.read(65536), 10)
        if not data:
            self.closed = True
            return
        self._pending += data
        kept = bytearray()
        while len(self._pending) >= 9:
            size = int.from_bytes(self._pending[:3], "big")
            if len(self._pending) < 9 + size:
                break
            frame = bytes(self._pending[: 9 + size])
            del self._pending[: 9 + size]
            if frame[3] == GOAWAY:
                last = int.from_bytes(frame[9:13], "big") & 0x7FFF_FFFF
                self.goaways.append((last, int.from_bytes(frame[13:17], "big")))
            else:
                kept += frame
        for event in self.conn.receive_data(bytes(kept)):
            if isinstance(event, h2.events.DataReceived):
                assert event.stream_id is not None
                self.bodies[event.stream_id] += event.data
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.ResponseReceived):
                assert event.stream_id is not None and event.headers is not None
                self.statuses[event.stream_id] = int(dict(event.headers)[b":status"])
            elif isinstance(event, h2.events.StreamEnded):
                assert event.stream_id is not None
                self.ended.add(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                assert event.stream_id is not None
                self.refused[event.stream_id] = event.error_code
        self.writer.write(self.conn.data_to_send())


async def _serving(tls: TlsMaterial, app: ASGIApp, max_requests: int) -> TcpListener:
    options = TcpOptions(max_requests=max_requests, head_timeout=0.5)  # the idle timer too
    listener = TcpListener(app, host="127.0.0.1", port=0, tls=tls, options=options)
    await listener.start()
    return listener


async def test_requests_in_flight_past_the_cap_are_answered_whole_then_the_connection_goes_away(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """hypercorn alone closes the connection at the fourth request under a cap of three,
    cutting all six answers."""
    listener = await _serving(tls, _Answers(), max_requests=3)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        streams = [client.get("/slow") for _ in range(6)]
        await client.until_done(*streams)
        assert all(client.whole(s) for s in streams)
        assert client.refused == {}
        await client.until_closed()
        assert client.goaways == [(streams[-1], h2.errors.ErrorCodes.NO_ERROR)]
    finally:
        await listener.stop()


async def test_a_client_asking_one_request_at_a_time_is_answered_up_to_the_cap_then_sent_away(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    listener = await _serving(tls, _Answers(), max_requests=2)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        first = client.get("/one")
        await client.until_done(first)
        second = client.get("/two")
        await client.until_done(second)
        await client.until_closed()
        assert client.whole(first) and client.whole(second)
        assert client.goaways == [(second, h2.errors.ErrorCodes.NO_ERROR)]
    finally:
        await listener.stop()


async def test_a_connection_never_left_idle_gets_a_graceful_goaway_and_refuses_what_follows(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """A request held open keeps the connection busy while others come one at a time: a
    `h2_max_concurrent_streams` (100) past the cap of two, GOAWAY names the last request
    taken, the next one is refused (safe to retry elsewhere), the held one is still answered,
    and then the connection closes."""
    app = _Answers()
    listener = await _serving(tls, app, max_requests=2)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        held = client.get("/hold")
        taken: list[int] = []
        while not client.goaways:
            assert len(taken) < 200, "no GOAWAY"
            taken.append(client.get(f"/short{len(taken)}"))
            await client.until_done(taken[-1])
        assert len(taken) + 1 == 2 + 100
        assert all(client.whole(s) for s in taken)
        assert client.goaways == [(taken[-1], h2.errors.ErrorCodes.NO_ERROR)]
        late = client.get("/late")
        await client.until_done(late)
        assert client.refused == {late: h2.errors.ErrorCodes.REFUSED_STREAM}
        app.release.set()
        await client.until_done(held)
        assert client.whole(held)
        await client.until_closed()
        assert client.goaways[-1] == (taken[-1], h2.errors.ErrorCodes.NO_ERROR)
    finally:
        app.release.set()
        await listener.stop()


async def test_an_http11_connection_over_tls_says_close_on_its_last_answer(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    listener = await _serving(tls, _Answers(), max_requests=2)
    try:
        ctx = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
        async with httpx.AsyncClient(verify=ctx) as client:
            answers = [await client.get(f"https://localhost:{listener.port}/a") for _ in range(3)]
        assert [a.http_version for a in answers] == ["HTTP/1.1"] * 3
        assert [a.headers.get("connection") for a in answers] == [None, "close", None]
        assert all(a.content == b"/a" * 1000 for a in answers)
    finally:
        await listener.stop()


async def test_a_request_that_arrives_while_the_listener_drains_is_refused_as_unprocessed(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """REFUSED_STREAM, so that the client may send it to another edge; the answer in flight
    on the same connection is finished, and then the connection closes."""
    app = _Answers()
    listener = await _serving(tls, app, max_requests=0)
    stopping: asyncio.Task[None] | None = None
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        held = client.get("/hold")
        await asyncio.wait_for(app.holding.wait(), 5)
        stopping = asyncio.create_task(listener.stop())
        for _ in range(100):  # answered until hypercorn marks the server as shutting down
            late = client.get("/late")
            await client.until_done(late)
            if late in client.refused:
                break
            await asyncio.sleep(0.02)
        assert client.refused == {late: h2.errors.ErrorCodes.REFUSED_STREAM}
        app.release.set()
        await client.until_done(held)
        assert client.whole(held)
        await client.until_closed()
        await asyncio.wait_for(stopping, 5)
    finally:
        app.release.set()
        if stopping is None:
            await listener.stop()
