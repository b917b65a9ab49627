"""Deadlines and caps at the door, over real sockets: a slowloris (a byte every so often) on each
listener is cut off by its head or body deadline while a normal client on the same listener is
served; a connection flood from one address is capped while another address is served."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import ErrorCode, FrameType
from aioquic.quic.packet import QuicErrorCode
from prometheus_client import CollectorRegistry

from certs import ensure_dev_certificates
from tests.helpers import free_port, wait_until
from tests.transport.apps import RecordingApp
from tests.transport.conftest import H3Factory
from tests.transport.h3client import Response, h3_connect, h3_connect_from
from transport import caps
from transport.caps import CLIENT_CAP, CLIENT_RATE, LISTENER_CAP, ConnectionGate
from transport.caps import RAPID_RESETS as RAPID
from transport.h1_server import H1Listener
from transport.h3_caps import REASON
from transport.h3_session import H3Limits
from transport.metrics import TransportMetrics
from transport.tcp import TcpListener, TcpOptions
from transport.tls import TlsMaterial

HEAD = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 50\r\n"
SHORT = {"head_timeout": 0.6, "body_timeout": 0.6}


class Counts:
    def __init__(self) -> None:
        self.refused: list[str] = []
        self.timeouts: list[str] = []


@contextlib.asynccontextmanager
async def listener(kind: str, counts: Counts, **options: Any) -> AsyncIterator[str]:
    """Our HTTP/1.1 listener or hypercorn's (plain TCP), serving `RecordingApp`."""
    opts = TcpOptions(**options)
    served: H1Listener | TcpListener
    if kind == "h1":
        served = H1Listener(RecordingApp(), host="127.0.0.1", port=0, options=opts)
        served.gate.on_refused = counts.refused.append
        served.on_timeout = counts.timeouts.append
    else:
        served = TcpListener(
            RecordingApp(), host="127.0.0.1", port=0, options=opts,
            on_refused=counts.refused.append, on_timeout=counts.timeouts.append,
        )  # fmt: skip
    await served.start()
    try:
        yield f"127.0.0.1:{served.port}"
    finally:
        await served.stop()


async def trickle(
    address: str,
    first: bytes,
    *,
    every: float = 0.1,
    limit: float = 15.0,
    ssl_context: ssl.SSLContext | None = None,
) -> bytes:
    """Send `first`, then one byte every `every` seconds until the server closes; what it
    answered (within `limit` seconds, else the test fails)."""
    host, port = address.split(":")
    if ssl_context is not None:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", int(port), ssl=ssl_context, server_hostname=host
        )
    else:
        reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(first)
    answer = b""
    try:
        async with asyncio.timeout(limit):
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(every):
                        data = await reader.read(65536)
                        if not data:
                            return answer
                        answer += data
                        continue
                try:
                    writer.write(b"x")
                    await writer.drain()
                except (ConnectionError, ssl.SSLError):
                    return answer
    except (ConnectionError, ssl.SSLError):
        return answer
    finally:
        writer.close()


async def normal_request(address: str) -> int:
    async with httpx.AsyncClient() as client:
        return (await client.post(f"http://{address}/echo", content=b"hello")).status_code


@pytest.mark.parametrize("kind", ["h1", "hypercorn"])
@pytest.mark.parametrize("phase", ["head", "body"])
async def test_a_slowloris_is_cut_off_while_a_normal_client_is_served(
    kind: str, phase: str
) -> None:
    counts = Counts()
    first = b"POST /echo HTTP/1.1\r\nhost: x\r\n" if phase == "head" else HEAD + b"\r\n"
    async with listener(kind, counts, **SHORT) as address:
        slow = asyncio.ensure_future(trickle(address, first))
        for _ in range(3):
            assert await normal_request(address) == 200
        answer = await slow
    if phase == "body" or kind == "h1":
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert counts.timeouts == [phase]
    else:
        # hypercorn's idle timer (the head deadline there) closes without an answer
        assert answer == b""


async def test_the_tls_listener_cuts_off_a_slow_body_and_a_flood(
    tls: TlsMaterial, dev_certs: Any
) -> None:
    """The same over TLS (h2 and HTTP/1.1 by ALPN; this raw client speaks HTTP/1.1)."""
    counts = Counts()
    context = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
    served = TcpListener(
        RecordingApp(), host="127.0.0.1", port=0, tls=tls,
        options=TcpOptions(max_connections_per_client=2, **SHORT),
        on_refused=counts.refused.append, on_timeout=counts.timeouts.append,
    )  # fmt: skip
    await served.start()
    try:
        address = f"localhost:{served.port}"
        slow = asyncio.ensure_future(trickle(address, HEAD + b"\r\n", ssl_context=context))
        # httpx sets ALPN on the context it is given: its own, so the raw sockets speak HTTP/1.1
        h2_context = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
        async with httpx.AsyncClient(verify=h2_context, http2=True) as client:
            response = await client.post(f"https://{address}/echo", content=b"hello")
            assert response.status_code == 200 and response.http_version == "HTTP/2"
        assert (await slow).startswith(b"HTTP/1.1 408")
        assert counts.timeouts == ["body"]
        await wait_until(lambda: served.gate.open == 0)  # both closed connections released
        held = [
            await asyncio.open_connection("127.0.0.1", served.port, ssl=context,
                                          server_hostname="localhost")
            for _ in range(2)
        ]  # fmt: skip
        for reader, writer in held:
            writer.write(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", served.port, ssl=context, server_hostname="localhost"
        )
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert counts.refused == [CLIENT_CAP]
        for _, w in held:
            w.close()
    finally:
        await served.stop()


async def test_a_connection_its_client_closed_leaves_the_caps_at_once(
    tls: TlsMaterial, dev_certs: Any
) -> None:
    """hypercorn kept a connection whose client had closed until its idle timer ran out (here
    10 s), and it counted against the caps all that while."""
    served = TcpListener(
        RecordingApp(), host="127.0.0.1", port=0, tls=tls,
        options=TcpOptions(max_connections_per_client=1),
    )  # fmt: skip
    await served.start()
    try:
        h2_context = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
        for _ in range(3):  # each closes before the next opens: all three are served
            async with httpx.AsyncClient(verify=h2_context, http2=True) as client:
                response = await client.get(f"https://localhost:{served.port}/echo")
                assert response.status_code == 200 and response.http_version == "HTTP/2"
            await wait_until(lambda: served.gate.open == 0, timeout=3)
    finally:
        await served.stop()


@pytest.mark.parametrize("kind", ["h1", "hypercorn"])
async def test_a_connection_flood_from_one_address_is_capped(kind: str) -> None:
    counts = Counts()
    async with listener(kind, counts, max_connections_per_client=3) as address:
        host, port = address.split(":")
        held = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
        # the three are counted once the listener has seen them: one request on each
        for reader, writer in held:
            writer.write(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(
                b"HTTP/1.1 200"
            )
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, not answered
        writer.close()
        assert counts.refused == [CLIENT_CAP]
        # another address (127.0.0.2 is loopback too) is served
        other = await asyncio.get_running_loop().run_in_executor(None, get_from, "127.0.0.2", port)
        assert other.startswith(b"HTTP/1.1 200")
        for _, w in held:
            w.close()


def get_from(source: str, port: str) -> bytes:
    with socket.create_connection(
        ("127.0.0.1", int(port)), timeout=5, source_address=(source, 0)
    ) as s:
        s.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        return s.recv(65536)


async def test_the_listener_cap_closes_one_more_connection_at_once() -> None:
    counts = Counts()
    async with listener("h1", counts, max_connections=2) as address:
        host, port = address.split(":")
        held = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        for reader, writer in held:
            writer.write(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        reader, writer = await asyncio.open_connection(host, int(port))
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert counts.refused == [LISTENER_CAP]
        for _, w in held:
            w.close()
        await asyncio.gather(*(w.wait_closed() for _, w in held), return_exceptions=True)

        async def served() -> bool:
            try:
                return await normal_request(address) == 200
            except httpx.HTTPError:
                return False

        async with asyncio.timeout(10):
            while not await served():  # the server sees the closes a moment later  # noqa: ASYNC110
                await asyncio.sleep(0.05)


def test_the_gate_counts_and_forgets_per_address() -> None:
    gate = ConnectionGate(max_connections=3, max_per_client=2)
    assert gate.admit("a") is None and gate.admit("a") is None
    assert gate.admit("a") == CLIENT_CAP
    assert gate.admit("b") is None
    assert gate.admit("c") == LISTENER_CAP
    gate.release("a")
    assert gate.admit("a") is None
    for host in ("a", "a", "b"):
        gate.release(host)
    assert gate.open == 0 and gate.per_client == {}


def test_the_gate_lets_each_address_open_new_connections_at_its_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [0.0]
    gate = ConnectionGate(rate=2.0, burst=3, clock=lambda: now[0])
    assert gate.active
    assert [gate.admit("a") for _ in range(4)] == [None, None, None, CLIENT_RATE]
    assert gate.admit("b") is None  # each address its own bucket
    for _ in range(5):  # a client knocking while refused costs itself nothing more
        assert gate.admit("a") == CLIENT_RATE
    now[0] = 0.5  # one token back
    assert gate.admit("a") is None and gate.admit("a") == CLIENT_RATE
    now[0] = 100.0  # refilled, never past the burst
    assert [gate.admit("a") for _ in range(4)] == [None, None, None, CLIENT_RATE]
    assert gate.open == 8  # admitted ones are counted as any others; refused ones are not
    monkeypatch.setattr(caps, "RATE_TABLE_MAX", 2)
    for host in ("c", "d"):
        gate.admit(host)
    assert list(gate._buckets) == ["c", "d"]  # the address seen longest ago forgotten first


@pytest.mark.parametrize("kind", ["h1", "hypercorn"])
async def test_new_connections_from_one_address_past_its_rate_are_closed(kind: str) -> None:
    counts = Counts()
    async with listener(kind, counts, new_connections_per_client=0.01,
                        new_connection_burst=2) as address:  # fmt: skip
        for _ in range(2):  # a connection each, within the burst
            assert await normal_request(address) == 200
        with pytest.raises(httpx.TransportError):
            await normal_request(address)
        assert counts.refused == [CLIENT_RATE]
        host, port = address.split(":")
        other = await asyncio.get_running_loop().run_in_executor(None, get_from, "127.0.0.2", port)
        assert other.startswith(b"HTTP/1.1 200")


async def test_http3_connections_past_one_address_rate_are_refused(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """Refused at the first Initial, as the caps are: before any TLS work."""
    async with h3_server(new_connections_per_client=0.01, new_connection_burst=2) as server:
        refused: list[str] = []
        server.gate.on_refused = refused.append
        for body in (b"a", b"b"):
            async with h3_connect(server.port, dev_certs.ca_cert) as client:
                assert (await client.fetch("POST", "/echo", body=body)).status == 200
        code = await refused_h3(server.port, dev_certs.ca_cert)
        assert code == QuicErrorCode.CONNECTION_REFUSED
        assert refused == [CLIENT_RATE]
        async with h3_connect_from("127.0.0.2", server.port, dev_certs.ca_cert) as other:
            assert (await other.fetch("POST", "/echo", body=b"c")).status == 200


async def test_an_http3_body_that_trickles_in_gets_408(h3_server: H3Factory, dev_certs) -> None:
    app = RecordingApp()
    limits = H3Limits(request_body_timeout=0.6)
    async with h3_server(app=app, limits=limits) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            stream_id = c.request("POST", "/echo", body=b"x", end=False)
            c.transmit()
            response = c.responses[stream_id]
            async with asyncio.timeout(15):
                while not response.done.is_set():
                    c.h3.send_data(stream_id, b"x", end_stream=False)
                    c.transmit()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(response.done.wait(), 0.1)
            assert response.status == 408
            # the same connection still serves a normal request
            ok = await c.fetch("POST", "/echo", body=b"hello")
            assert ok.status == 200
    assert await asyncio.wait_for(app.disconnects.get(), 5) == "/echo"


async def test_quicedge_serve_counts_refused_connections_and_cut_off_requests(
    serve_process: Any,
) -> None:
    """The real `quicedge serve` with `[serve]` caps and deadlines from flags: what it refuses
    and cuts off shows in the admin listener's `/metrics`."""
    http_port = free_port()
    server = serve_process(
        "--demo", "--http", f"127.0.0.1:{http_port}", "--max-connections-per-client", "2",
        "--request-head-timeout", "0.5",
    )  # fmt: skip
    address = f"127.0.0.1:{http_port}"
    assert (await trickle(address, b"GET /v1/models HTTP/1.1\r\n")).startswith(b"HTTP/1.1 408")
    held = [await asyncio.open_connection("127.0.0.1", http_port) for _ in range(2)]
    for reader, writer in held:
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    reader, writer = await asyncio.open_connection("127.0.0.1", http_port)
    with contextlib.suppress(ConnectionError):
        assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    ca = ensure_dev_certificates().ca_cert  # what `--demo` serves
    async with h3_connect(server.h3_port, ca) as one, h3_connect(server.h3_port, ca) as two:
        for client in (one, two):
            assert (await client.fetch("GET", "/v1/models")).status == 200
        assert await refused_h3(server.h3_port, ca) == QuicErrorCode.CONNECTION_REFUSED
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"http://127.0.0.1:{server.admin_port}/metrics")).text
    assert 'quicedge_connections_refused_total{listener="http",reason="client_cap"} 1.0' in metrics
    assert 'quicedge_connections_refused_total{listener="h3",reason="client_cap"} 1.0' in metrics
    assert 'quicedge_request_timeouts_total{listener="http",phase="head"} 1.0' in metrics
    for _, w in held:
        w.close()
    smuggled = (
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    tls = ssl.create_default_context(cafile=str(ca))
    for port, context in ((http_port, None), (server.tcp_port, tls)):
        for request in (smuggled, b"GET / HTTP/2.0\r\nhost: x\r\n\r\n"):
            answer = b""
            async with asyncio.timeout(10):
                while not answer:  # closed unanswered: over the cap until the held ones go
                    reader, writer = await asyncio.open_connection(
                        "127.0.0.1", port, ssl=context,
                        server_hostname="localhost" if context else None,
                    )  # fmt: skip
                    writer.write(request)
                    with contextlib.suppress(ConnectionError):
                        answer = await reader.read()
                    writer.close()
            assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 505")), answer
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"http://127.0.0.1:{server.admin_port}/metrics")).text
    for listener in ("http", "tcp"):  # the plain listener's and hypercorn's, over TLS
        for status in ("400", "505"):
            sample = f'quicedge_requests_refused_total{{listener="{listener}",status="{status}"}}'
            assert f"{sample} 1.0" in metrics, metrics
    assert 'quicedge_requests_refused_total{listener="http",status="408"}' not in metrics
    assert server.stop() == 0


async def test_an_http3_head_that_trickles_in_gets_408(h3_server: H3Factory, dev_certs) -> None:
    """A HEADERS frame that announces 100 bytes and sends one at a time."""
    limits = H3Limits(request_head_timeout=0.6)
    async with h3_server(app=RecordingApp(), limits=limits) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            stream_id = c.quic.get_next_available_stream_id()
            response = c.responses[stream_id] = Response()
            c.quic.send_stream_data(stream_id, encode_uint_var(FrameType.HEADERS) + bytes([100]))
            c.transmit()
            async with asyncio.timeout(15):
                while not response.done.is_set():
                    c.quic.send_stream_data(stream_id, b"\x00")
                    c.transmit()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(response.done.wait(), 0.1)
            assert response.status == 408
            ok = await c.fetch("POST", "/echo", body=b"hello")
            assert ok.status == 200


async def refused_h3(port: int, ca_cert: Any, host: str = "127.0.0.1") -> int | None:
    """Open an HTTP/3 connection expecting a refusal: the error code it was closed with, within
    10 s (None if its handshake completed instead)."""
    async with h3_connect(port, ca_cert, wait_connected=False, host=host) as client:
        client.transmit()  # the first flight (`wait_connected=False` leaves it unsent)
        async with asyncio.timeout(10):  # aioquic's own handshake timeout would be 60 s
            while client.terminated is None and client.handshake is None:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        if client.terminated is None:
            return None
        assert client.terminated.reason_phrase == REASON.decode()
        return client.terminated.error_code


@pytest.mark.parametrize("retry", [False, True], ids=["plain", "retry"])
async def test_http3_connections_past_the_listener_cap_are_refused(
    h3_server: H3Factory, dev_certs: Any, retry: bool
) -> None:
    """Over real QUIC: two connections under a cap of two are served; a third is refused with
    CONNECTION_REFUSED before its handshake while the two keep working; once one of them has
    closed, a new one is served. With Retry, the refusal answers the Initial that carries the
    token."""
    secret = b"r" * 32 if retry else None
    async with h3_server(max_connections=2, retry_secret=secret) as server:
        refused: list[str] = []
        server.gate.on_refused = refused.append
        async with h3_connect(server.port, dev_certs.ca_cert) as first:
            async with h3_connect(server.port, dev_certs.ca_cert) as second:
                for client in (first, second):
                    assert (await client.fetch("POST", "/echo", body=b"a")).status == 200
                code = await refused_h3(server.port, dev_certs.ca_cert)
                assert code == QuicErrorCode.CONNECTION_REFUSED
                assert refused == [LISTENER_CAP]
                assert server.gate.open == 2  # the refusal made no connection
                for client in (first, second):
                    assert (await client.fetch("POST", "/echo", body=b"b")).status == 200
            # `second` sent CONNECTION_CLOSE; the server forgets it after its draining period
            await wait_until(lambda: server.gate.open == 1, timeout=10)
            async with h3_connect(server.port, dev_certs.ca_cert) as third:
                assert (await third.fetch("POST", "/echo", body=b"c")).status == 200
                assert (await first.fetch("POST", "/echo", body=b"d")).status == 200
    assert refused == [LISTENER_CAP]


async def test_http3_connections_past_one_address_cap_are_refused(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """The per-address cap: a second connection from 127.0.0.1 is refused, one from 127.0.0.2
    (loopback too) is served; connections that end are forgotten."""
    async with h3_server(max_connections_per_client=1) as server:
        refused: list[str] = []
        server.gate.on_refused = refused.append
        async with h3_connect(server.port, dev_certs.ca_cert) as held:
            assert (await held.fetch("POST", "/echo", body=b"a")).status == 200
            code = await refused_h3(server.port, dev_certs.ca_cert)
            assert code == QuicErrorCode.CONNECTION_REFUSED
            assert refused == [CLIENT_CAP]
            async with h3_connect_from("127.0.0.2", server.port, dev_certs.ca_cert) as other:
                assert (await other.fetch("POST", "/echo", body=b"b")).status == 200
            assert (await held.fetch("POST", "/echo", body=b"c")).status == 200
        await wait_until(lambda: server.gate.open == 0, timeout=10)
        assert server.gate.per_client == {}


class Firehose:
    """Answers 16 MiB in 64 KiB chunks, more than the socket buffers of a client that does not
    read can take; sets `gone` on `http.disconnect`."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(256):
                if self.gone.is_set():
                    return
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            # hypercorn's HTTP/2 takes every chunk into its own buffer: its wait is at the end
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            await self.gone.wait()  # the client never has the whole answer
        finally:
            await asyncio.sleep(0)  # the watcher sees a disconnect that ended the last send
            watcher.cancel()


SEND = {"send_timeout": 0.5}


async def firehose_listener(kind: str, app: Firehose, counts: Counts) -> H1Listener | TcpListener:
    """Our HTTP/1.1 listener or hypercorn's (plain TCP) serving `app`, with a 0.5 s send
    timeout counted in `counts`; started."""
    opts = TcpOptions(**SEND)
    served: H1Listener | TcpListener
    if kind == "h1":
        served = H1Listener(app, host="127.0.0.1", port=0, options=opts)
        served.on_timeout = counts.timeouts.append
    else:
        served = TcpListener(app, host="127.0.0.1", port=0, options=opts,
                             on_timeout=counts.timeouts.append)  # fmt: skip
    await served.start()
    return served


@pytest.mark.parametrize("kind", ["h1", "hypercorn"])
async def test_a_client_that_stops_reading_is_cut_off_after_the_send_timeout(kind: str) -> None:
    counts = Counts()
    app = Firehose()
    served = await firehose_listener(kind, app, counts)
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", served.port))
        sock.sendall(b"GET /firehose HTTP/1.1\r\nhost: x\r\n\r\n")  # and never reads
        await asyncio.wait_for(app.gone.wait(), 10)
        assert counts.timeouts == ["send"]
    finally:
        sock.close()
        await served.stop()


@pytest.mark.parametrize("kind", ["h1", "hypercorn"])
async def test_a_client_that_takes_a_little_now_and_then_is_cut_off_too(kind: str) -> None:
    """512 bytes every 0.1 s: a write that paused resumes only once the client took the
    transport's buffer down to its low-water mark (48 KiB), which it never does within the
    send timeout."""
    counts = Counts()
    app = Firehose()
    served = await firehose_listener(kind, app, counts)
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    taken = 0

    async def trickle() -> None:
        nonlocal taken
        while True:
            data = await loop.sock_recv(sock, 512)
            if not data:
                return
            taken += len(data)
            await asyncio.sleep(0.1)

    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", served.port))
        sock.sendall(b"GET /firehose HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.setblocking(False)
        reader = asyncio.ensure_future(trickle())
        await asyncio.wait_for(app.gone.wait(), 15)
        assert counts.timeouts == ["send"]
        assert taken > 0
        reader.cancel()
    finally:
        sock.close()
        await served.stop()


async def h2_client(port: int, ca_cert: Any) -> tuple[Any, asyncio.StreamReader, Any]:
    """An HTTP/2 connection (the `h2` library over TLS): (connection, reader, writer)."""
    import h2.config
    import h2.connection

    context = ssl.create_default_context(cafile=str(ca_cert))
    context.set_alpn_protocols(["h2"])
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="localhost"
    )
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    return conn, reader, writer


@contextlib.asynccontextmanager
async def h2_connected(
    tls: TlsMaterial, dev_certs: Any, counts: Counts
) -> AsyncIterator[tuple[Any, asyncio.StreamReader, Any]]:
    """An HTTP/2 connection to a TLS listener serving `RecordingApp` that counts the
    connections it refuses or sends away in `counts`."""
    served = TcpListener(RecordingApp(), host="127.0.0.1", port=0, tls=tls,
                         on_refused=counts.refused.append)  # fmt: skip
    await served.start()
    conn, reader, writer = await h2_client(served.port, dev_certs.ca_cert)
    try:
        yield conn, reader, writer
    finally:
        writer.close()
        await served.stop()


def h2_get(conn: Any, path: str) -> int:
    stream_id: int = conn.get_next_available_stream_id()
    conn.send_headers(stream_id, [(":method", "GET"), (":scheme", "https"),
                                  (":authority", "localhost"), (":path", path)],
                      end_stream=True)  # fmt: skip
    return stream_id


async def test_an_http2_client_that_keeps_its_window_shut_is_reset_after_the_send_timeout(
    tls: TlsMaterial, dev_certs: Any
) -> None:
    """Over HTTP/2 the client reads every frame but never opens its flow-control window: the
    stream is reset with CANCEL, and the app hears the client is gone."""
    import h2.errors
    import h2.events

    counts = Counts()
    app = Firehose()
    served = TcpListener(app, host="127.0.0.1", port=0, tls=tls, options=TcpOptions(**SEND),
                         on_timeout=counts.timeouts.append)  # fmt: skip
    await served.start()
    conn, reader, writer = await h2_client(served.port, dev_certs.ca_cert)
    try:
        stream_id = h2_get(conn, "/firehose")
        writer.write(conn.data_to_send())
        reset: h2.events.StreamReset | None = None
        async with asyncio.timeout(10):
            while reset is None:
                data = await reader.read(65536)
                assert data, "the connection closed; only the stream should have"
                for event in conn.receive_data(data):  # no acknowledge_received_data: no credit
                    if isinstance(event, h2.events.StreamReset):
                        reset = event
                writer.write(conn.data_to_send())
        assert reset.stream_id == stream_id and reset.error_code == h2.errors.ErrorCodes.CANCEL
        await asyncio.wait_for(app.gone.wait(), 5)
        assert counts.timeouts == ["send"]
    finally:
        writer.close()
        await served.stop()


async def test_an_http3_client_that_stops_acknowledging_is_reset_after_the_send_timeout(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    app = Firehose()
    registry = CollectorRegistry()
    metrics = TransportMetrics(registry)
    limits = H3Limits(send_timeout=0.5)
    async with h3_server(app=app, limits=limits, metrics=metrics) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            stream_id = c.request("GET", "/firehose")
            c.transmit()
            await asyncio.wait_for(c.responses[stream_id].first_data.wait(), 5)
            c.datagram_received = lambda data, addr: None  # type: ignore[method-assign]
            await asyncio.wait_for(app.gone.wait(), 10)
    sent = registry.get_sample_value(
        "quicedge_request_timeouts_total", {"listener": "h3", "phase": "send"}
    )
    assert sent == 1


@pytest.mark.parametrize("resets", [300, 40], ids=["rapid", "now-and-then"])
async def test_an_http2_client_that_resets_most_of_its_requests_is_sent_away(
    tls: TlsMaterial, dev_certs: Any, resets: int
) -> None:
    """CVE-2023-44487: streams opened and reset at once. Past 100 such resets, when they are
    most of a connection's requests, it gets GOAWAY ENHANCE_YOUR_CALM; a client that resets
    now and then, among requests it lets finish, keeps its connection."""
    import h2.errors
    import h2.events

    counts = Counts()
    async with h2_connected(tls, dev_certs, counts) as (conn, reader, writer):
        ended: h2.events.ConnectionTerminated | None = None
        finished = 0

        async def read_until(done: Any) -> None:
            nonlocal ended, finished
            async with asyncio.timeout(10):
                while not done():
                    data = await reader.read(65536)
                    if not data:
                        return
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.ConnectionTerminated):
                            ended = event
                        elif isinstance(event, h2.events.StreamEnded):
                            finished += 1
                    writer.write(conn.data_to_send())

        for i in range(resets):
            conn.reset_stream(h2_get(conn, "/hold"), h2.errors.ErrorCodes.CANCEL)
            if resets < RAPID and i % 4 == 0:  # and lets most of its other requests finish
                for _ in range(3):
                    h2_get(conn, "/echo")
            if i % 20 == 19:
                writer.write(conn.data_to_send())
                await read_until(lambda: True)  # one read: the server's answers so far
        writer.write(conn.data_to_send())
        if resets >= RAPID:
            await read_until(lambda: ended is not None)
            assert ended is not None and ended.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
            assert counts.refused == ["rapid_reset"]
        else:
            want = 3 * len(range(0, resets, 4))
            await read_until(lambda: finished >= want)
            assert ended is None and counts.refused == []
            assert finished == want
            conn.close_connection()  # and leaves as a client does, so the server idles
            writer.write(conn.data_to_send())
            await read_until(lambda: False)


@pytest.mark.parametrize("per_request", [3000, 8], ids=["flood", "in-proportion"])
async def test_an_http2_client_flooding_control_frames_is_sent_away(
    tls: TlsMaterial, dev_certs: Any, per_request: int
) -> None:
    """PINGs and window updates cost the listener several µs each: past 1,000 and ten per
    request and DATA frame, the connection gets GOAWAY ENHANCE_YOUR_CALM. A client that sends
    a few per request (1,200 over 150 requests) keeps its connection."""
    import h2.errors
    import h2.events

    counts = Counts()
    async with h2_connected(tls, dev_certs, counts) as (conn, reader, writer):
        ended: h2.events.ConnectionTerminated | None = None
        finished = 0
        requests = 1 if per_request > 100 else 150
        for i in range(requests):
            h2_get(conn, "/echo")
            writer.write(conn.data_to_send())
            async with asyncio.timeout(10):
                while finished <= i and ended is None:
                    data = await reader.read(65536)
                    assert data, "the server closed the connection"
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.StreamEnded):
                            finished += 1
                        elif isinstance(event, h2.events.ConnectionTerminated):
                            ended = event
            for n in range(per_request):
                if n % 2:
                    conn.ping(b"%08d" % n)
                else:
                    conn.increment_flow_control_window(1)
            writer.write(conn.data_to_send())
        conn.ping(b"lastping")  # its answer says the server took everything sent before
        writer.write(conn.data_to_send())
        closed = False
        async with asyncio.timeout(10):
            while ended is None and not closed:
                try:
                    data = await reader.read(65536)
                except ConnectionError:  # the server closed with the flood still unread
                    data = b""
                closed = not data
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ConnectionTerminated):
                        ended = event
                    elif isinstance(event, h2.events.PingAckReceived):
                        closed = closed or event.ping_data == b"lastping"
        if per_request > 100:
            assert counts.refused == ["control_flood"]
            # GOAWAY ENHANCE_YOUR_CALM, unless the close with the flood unread reset the socket
            assert ended is None or ended.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
            assert ended is not None or closed
        else:
            assert ended is None and counts.refused == [] and finished == requests


@pytest.mark.parametrize(
    ("resets", "started"),
    [(300, False), (RAPID + 20, True), (40, False)],
    ids=["rapid", "rapid-once-answering", "now-and-then"],
)
async def test_an_http3_client_that_resets_most_of_its_requests_is_sent_away(
    h3_server: H3Factory, dev_certs: Any, resets: int, started: bool
) -> None:
    """The same over HTTP/3: the connection is closed with H3_EXCESSIVE_LOAD, and counted,
    whether the client resets its requests at once (in the packet that opens them) or once
    the app has begun to answer them."""
    registry = CollectorRegistry()
    metrics = TransportMetrics(registry)
    async with h3_server(metrics=metrics) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            finished: list[int] = []
            for i in range(resets):
                stream_id = c.request("GET", "/hold")
                if started:  # the app is answering it: the backend work has begun
                    c.transmit()
                    answer = c.responses[stream_id]  # (done: the connection was closed)
                    waits = [asyncio.ensure_future(answer.first_data.wait()),
                             asyncio.ensure_future(answer.done.wait())]  # fmt: skip
                    await asyncio.wait(waits, timeout=5, return_when=asyncio.FIRST_COMPLETED)
                    for wait in waits:
                        wait.cancel()
                c.reset(stream_id)
                if resets < RAPID and i % 4 == 0:  # and lets most of its other requests finish
                    finished += [c.request("GET", "/echo") for _ in range(3)]
                if i % 20 == 19:
                    c.transmit()
                    await asyncio.sleep(0.01)  # the server's answers, and fresh stream credit
                if c.terminated is not None:
                    break
            c.transmit()
            if resets >= RAPID:
                await wait_until(lambda: c.terminated is not None)
                assert c.terminated is not None
                assert c.terminated.error_code == ErrorCode.H3_EXCESSIVE_LOAD
            else:
                for stream_id in finished:
                    assert (await c.wait(stream_id)).status == 200
                assert c.terminated is None
    refused = registry.get_sample_value(
        "quicedge_connections_refused_total", {"listener": "h3", "reason": "rapid_reset"}
    )
    assert refused == (1 if resets >= RAPID else None)
