"""The upstream pool over real sockets, against a small scripted HTTP/1.1 server (h11 based)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h11
import pytest

from backends.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolBusy,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from backends.pool import UpstreamPool
from backends.sim import SimConfig, SimServer
from tests.helpers import free_port, wait_until


@dataclass
class ScriptedServer:
    """An HTTP/1.1 server whose behaviour is chosen by the request path."""

    port: int = 0
    connections: int = 0
    open_connections: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    requests: list[tuple[str, bytes, dict[bytes, bytes]]] = field(default_factory=list)
    server: asyncio.Server | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    vanish: bool = True
    """`/vanish` closes its connection unanswered the first time, and is answered after."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_connections += 1
        self.writers.add(writer)
        conn = h11.Connection(our_role=h11.SERVER)
        try:
            while True:
                target, body, headers = await self._read_request(conn, reader)
                if target is None:
                    return
                self.requests.append((target, body, headers))
                keep = await self._respond(target, body, conn, reader, writer)
                if not keep or conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (ConnectionError, h11.RemoteProtocolError):
            return
        finally:
            self.open_connections -= 1
            self.writers.discard(writer)
            self.closed.set()
            writer.close()

    async def _read_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader
    ) -> tuple[str | None, bytes, dict[bytes, bytes]]:
        target: str | None = None
        headers: dict[bytes, bytes] = {}
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Request):
                target = event.target.decode()
                headers = dict(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return target, body, headers
            else:  # ConnectionClosed
                return None, b"", {}

    async def _respond(
        self,
        target: str,
        body: bytes,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        def send(event: object) -> None:
            writer.write(conn.send(event))  # type: ignore[arg-type]

        async def wait_release() -> None:
            # Wait for the test's signal, but notice a client that goes away meanwhile.
            eof = asyncio.ensure_future(reader.read(1))
            release = asyncio.ensure_future(self.release.wait())
            await asyncio.wait([eof, release], return_when=asyncio.FIRST_COMPLETED)
            released = release.done()
            for task in (release, eof):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if not released:
                raise ConnectionError("client went away")

        if target == "/ok":
            send(h11.Response(status_code=200, headers=[("content-length", str(len(body) + 3))]))
            send(h11.Data(data=b"ok:" + body))
            send(h11.EndOfMessage())
        elif target == "/close":
            send(
                h11.Response(
                    status_code=200, headers=[("content-length", "2"), ("connection", "close")]
                )
            )
            send(h11.Data(data=b"ok"))
            send(h11.EndOfMessage())
            await writer.drain()
            return False
        elif target == "/stream":
            # Chunked SSE: one event, then wait for the test, then the rest.
            send(h11.Response(status_code=200, headers=[("content-type", "text/event-stream")]))
            send(h11.Data(data=b"data: 1\n\n"))
            await writer.drain()
            await wait_release()
            send(h11.Data(data=b"data: 2\n\n"))
            send(h11.Data(data=b"data: [DONE]\n\n"))
            send(h11.EndOfMessage())
        elif target == "/burst":
            # Three chunks and the end of the body in one write, then a pause before the
            # connection is reused: they reach the pool together.
            data = conn.send(h11.Response(status_code=200, headers=[]))
            for i in range(3):
                data += conn.send(h11.Data(data=b"data: %d\n\n" % i))
            writer.write(data + conn.send(h11.EndOfMessage()))
        elif target == "/burst-die":
            data = conn.send(
                h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")])
            )
            data += conn.send(h11.Data(data=b"data: 1\n\n")) + conn.send(
                h11.Data(data=b"data: 2\n\n")
            )
            writer.write(data + b"zz\r\n")  # a broken chunk header right behind the good ones
            await writer.drain()
            writer.transport.abort()
            return False
        elif target == "/trailers":
            # Chunk extensions and a trailer section, as a chunked body may carry them.
            writer.write(
                conn.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
                + b"5;ext=1\r\nhello\r\n6;a=b\r\n world\r\n0\r\nx-checksum: 1\r\n\r\n"
            )
            conn.send(h11.Data(data=b"hello world"))
            conn.send(h11.EndOfMessage(headers=[("x-checksum", "1")]))  # keep h11 in step
        elif target == "/chunked-close":
            send(h11.Response(status_code=200, headers=[("connection", "close")]))
            send(h11.Data(data=b"bye"))
            send(h11.EndOfMessage())
            await writer.drain()
            return False
        elif target == "/die":
            send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
            send(h11.Data(data=b"data: 1\n\n"))
            await writer.drain()
            writer.transport.abort()
            return False
        elif target == "/hang":
            await wait_release()
            send(h11.Response(status_code=200, headers=[("content-length", "0")]))
            send(h11.EndOfMessage())
        elif target in ("/trickle-head", "/continues"):
            # A head a byte every 20 ms, or a `100 Continue` every 20 ms: each read comes
            # well within the timeout, the whole head not.
            head = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
            pieces = [head[i : i + 1] for i in range(len(head))]
            if target == "/continues":
                pieces = [b"HTTP/1.1 100 Continue\r\n\r\n"] * len(pieces) + [head]
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.02)
            return False
        elif target == "/vanish":
            if self.vanish:  # as a backend whose keep-alive timeout fires as the request comes
                self.vanish = False
                return False
            send(h11.Response(status_code=200, headers=[("content-length", "2")]))
            send(h11.Data(data=b"ok"))
            send(h11.EndOfMessage())
        elif target == "/garbage":
            writer.write(b"this is not HTTP\r\n\r\n")
            await writer.drain()
            return False
        elif target == "/status503":
            send(h11.Response(status_code=503, headers=[("content-length", "4")]))
            send(h11.Data(data=b"busy"))
            send(h11.EndOfMessage())
        await writer.drain()
        return True


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    srv = ScriptedServer()
    srv.server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    srv.port = srv.server.sockets[0].getsockname()[1]
    try:
        yield srv
    finally:
        srv.release.set()
        srv.server.close()
        await srv.server.wait_closed()


async def get(pool: UpstreamPool, url: str, path: str, body: bytes = b"", **kw: float) -> bytes:
    response = await pool.request(url, "POST", path, headers=[], body=body, **kw)
    try:
        return await response.read()
    finally:
        await response.aclose()


async def test_sequential_requests_reuse_one_connection(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        for i in range(5):
            assert await get(pool, server.url, "/ok", b"%d" % i) == b"ok:%d" % i
        stats = pool.stats()
        assert (stats.requests, stats.connects, stats.reused) == (5, 1, 4)
        assert stats.reuse_ratio == pytest.approx(0.8)
        assert stats.backends[server.url].idle == 1
        assert server.connections == 1
        host, body, headers = server.requests[0]
        assert headers[b"host"] == f"127.0.0.1:{server.port}".encode()
        assert headers[b"content-length"] == b"1"
    finally:
        await pool.aclose()


async def test_socket_has_tcp_nodelay(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        response = await pool.request(server.url, "GET", "/ok", headers=[], body=b"")
        await response.read()
        conn = next(iter(pool._hosts[server.url].all))
        sock = conn.transport.get_extra_info("socket")  # type: ignore[union-attr]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        await pool.aclose()


async def test_stream_chunks_arrive_before_the_body_ends(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        response = await pool.request(server.url, "POST", "/stream", headers=[], body=b"{}")
        assert response.status == 200
        assert (b"content-type", b"text/event-stream") in response.headers
        chunks = aiter(response)
        assert await anext(chunks) == b"data: 1\n\n"  # before the server sends the rest
        server.release.set()
        rest = [c async for c in chunks]
        assert b"".join(rest) == b"data: 2\n\ndata: [DONE]\n\n"
        assert response.complete
        assert pool.stats().backends[server.url].idle == 1  # back in the pool
    finally:
        await pool.aclose()


async def test_cap_bounds_connections_and_waits_for_a_slot(server: ScriptedServer) -> None:
    pool = UpstreamPool(max_connections_per_backend=2)
    try:
        tasks = [asyncio.create_task(get(pool, server.url, "/hang")) for _ in range(3)]
        await wait_until(
            lambda: (
                pool.stats().backends.get(server.url) is not None
                and pool.stats().backends[server.url].waiting == 1
            )
        )
        await wait_until(lambda: len(server.requests) == 2)
        assert server.connections == 2
        server.release.set()
        assert await asyncio.gather(*tasks) == [b"", b"", b""]
        stats = pool.stats()
        assert stats.connects == 2 and stats.reused == 1
        assert stats.backends[server.url].active == 0
    finally:
        await pool.aclose()


async def test_waiters_over_the_limit_are_refused_at_once(server: ScriptedServer) -> None:
    pool = UpstreamPool(max_connections_per_backend=1, max_waiters_per_backend=1)
    try:
        holder = asyncio.create_task(get(pool, server.url, "/hang"))
        await wait_until(lambda: len(server.requests) == 1)
        waiter = asyncio.create_task(get(pool, server.url, "/ok"))
        await wait_until(lambda: pool.stats().backends[server.url].waiting == 1)
        with pytest.raises(UpstreamPoolBusy, match="already wait") as refused:
            await get(pool, server.url, "/ok")
        assert refused.value.kind == "pool_busy" and refused.value.base_url == server.url
        server.release.set()
        assert await holder == b"" and await waiter == b"ok:"
        stats = pool.stats()
        assert stats.connects == 1 and stats.backends[server.url].waiting == 0
    finally:
        await pool.aclose()


async def test_a_waiter_gives_up_after_the_acquire_timeout(server: ScriptedServer) -> None:
    pool = UpstreamPool(max_connections_per_backend=1, acquire_timeout=0.2)
    try:
        holder = asyncio.create_task(get(pool, server.url, "/hang"))
        await wait_until(lambda: len(server.requests) == 1)
        with pytest.raises(UpstreamPoolBusy, match="within 0.2s"):
            await asyncio.wait_for(get(pool, server.url, "/ok"), 10)
        # the one that gave up no longer counts, and the slot still goes to the next request
        assert pool.stats().backends[server.url].waiting == 0
        later = asyncio.create_task(get(pool, server.url, "/ok"))
        await wait_until(lambda: pool.stats().backends[server.url].waiting == 1)
        server.release.set()
        assert await holder == b"" and await later == b"ok:"
    finally:
        await pool.aclose()


async def test_adopted_transport_serves_requests(server: ScriptedServer) -> None:
    pool = UpstreamPool(max_connections_per_backend=1)
    loop = asyncio.get_running_loop()
    try:
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", server.port)
        conn = pool.adopt(server.url, transport)
        transport.set_protocol(conn)
        assert await get(pool, server.url, "/ok", b"x") == b"ok:x"
        assert pool.stats().connects == 0 and pool.stats().reused == 1
        with pytest.raises(UpstreamPoolBusy):
            pool.adopt(server.url, transport)  # the cap counts adopted connections too
    finally:
        await pool.aclose()


async def test_idle_connections_expire(server: ScriptedServer) -> None:
    pool = UpstreamPool(idle_timeout=0.1)
    try:
        await get(pool, server.url, "/ok")
        await asyncio.wait_for(server.closed.wait(), 5)
        assert pool.stats().backends[server.url].idle == 0
        await get(pool, server.url, "/ok")
        assert pool.stats().connects == 2
    finally:
        await pool.aclose()


async def test_server_dying_mid_body_raises_protocol_error(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        response = await pool.request(server.url, "POST", "/die", headers=[], body=b"")
        chunks = aiter(response)
        assert await anext(chunks) == b"data: 1\n\n"
        with pytest.raises(UpstreamProtocolError):
            await anext(chunks)
        assert pool.stats().backends[server.url].active == 0
        assert pool.stats().backends[server.url].idle == 0
        await response.aclose()  # idempotent after the failure
    finally:
        await pool.aclose()


async def test_connect_refused() -> None:
    pool = UpstreamPool()
    url = f"http://127.0.0.1:{free_port()}"
    try:
        with pytest.raises(UpstreamConnectError) as info:
            await pool.request(url, "GET", "/", headers=[], body=b"")
        assert info.value.kind == "connect" and info.value.base_url == url
        assert pool.stats().backends[url].active == 0
    finally:
        await pool.aclose()


async def test_first_byte_timeout_closes_the_connection(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        with pytest.raises(UpstreamTimeout):
            await pool.request(
                server.url, "POST", "/hang", headers=[], body=b"", first_byte_timeout=0.05
            )
        await asyncio.wait_for(server.closed.wait(), 5)  # the backend saw the abort
        assert pool.stats().backends[server.url].active == 0
    finally:
        await pool.aclose()


@pytest.mark.parametrize("path", ["/trickle-head", "/continues"])
async def test_first_byte_timeout_bounds_the_whole_head(server: ScriptedServer, path: str) -> None:
    """Each byte of the head, or each `100 Continue`, within the timeout: the head as a whole
    (about 0.8 s) is not, and the wait ends at the timeout."""
    pool = UpstreamPool()
    try:
        began = time.monotonic()
        with pytest.raises(UpstreamTimeout, match=r"within 0\.2s"):
            await pool.request(
                server.url, "POST", path, headers=[], body=b"", first_byte_timeout=0.2
            )
        assert time.monotonic() - began < 0.6
        assert pool.stats().backends[server.url].active == 0
    finally:
        await pool.aclose()


async def test_chunk_timeout(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        response = await pool.request(
            server.url, "POST", "/stream", headers=[], body=b"", chunk_timeout=0.05
        )
        chunks = aiter(response)
        await anext(chunks)
        with pytest.raises(UpstreamTimeout) as info:
            await anext(chunks)
        assert info.value.kind == "timeout"
        await asyncio.wait_for(server.closed.wait(), 5)
        assert pool.stats().backends[server.url].active == 0
    finally:
        await pool.aclose()


async def test_early_close_aborts_the_upstream_request(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        response = await pool.request(server.url, "POST", "/stream", headers=[], body=b"")
        await anext(aiter(response))
        await response.aclose()
        await response.aclose()
        await asyncio.wait_for(server.closed.wait(), 5)
        assert server.open_connections == 0
        stats = pool.stats().backends[server.url]
        assert (stats.active, stats.idle) == (0, 0)
        assert [c async for c in response] == []
    finally:
        await pool.aclose()


async def test_warm_opens_idle_connections_that_requests_reuse(server: ScriptedServer) -> None:
    pool = UpstreamPool(max_connections_per_backend=4)
    try:
        await pool.warm(server.url, 3)
        await pool.warm(server.url, 3)  # already warm: opens nothing more
        await wait_until(lambda: server.connections == 3)
        assert pool.stats().backends[server.url].idle == 3
        response = await pool.request(server.url, "POST", "/ok", headers=[], body=b"")
        assert response.reused
        await response.read()
        assert pool.stats().connects == 3 and pool.stats().reuse_ratio == 1.0
        await pool.warm(f"http://127.0.0.1:{free_port()}", 2)  # a dead backend only logs
    finally:
        await pool.aclose()


async def test_connection_close_response_is_not_reused(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        assert await get(pool, server.url, "/close") == b"ok"
        assert pool.stats().backends[server.url].idle == 0
        assert await get(pool, server.url, "/ok") == b"ok:"
        assert pool.stats().connects == 2
    finally:
        await pool.aclose()


async def test_backend_closing_an_idle_connection_is_survived(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        await get(pool, server.url, "/ok")
        for writer in list(server.writers):
            writer.close()  # as the backend's keep-alive timeout does
        await wait_until(lambda: pool.stats().backends[server.url].idle == 0)
        assert await get(pool, server.url, "/ok") == b"ok:"
        assert pool.stats().connects == 2
    finally:
        await pool.aclose()


async def test_a_request_the_backend_closed_its_reused_connection_on_is_sent_again_once(
    server: ScriptedServer,
) -> None:
    pool = UpstreamPool()
    try:
        await get(pool, server.url, "/ok")
        assert await get(pool, server.url, "/vanish") == b"ok"
        stats = pool.stats()
        assert stats.stale_resends == 1 and stats.connects == 2
        assert [target for target, _, _ in server.requests] == ["/ok", "/vanish", "/vanish"]
    finally:
        await pool.aclose()


async def test_error_status_is_a_response_not_an_exception(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        response = await pool.request(server.url, "POST", "/status503", headers=[], body=b"")
        assert response.status == 503 and await response.read() == b"busy"
        assert response.header(b"content-length") == b"4"
    finally:
        await pool.aclose()


async def test_garbage_response_is_a_protocol_error(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        with pytest.raises(UpstreamProtocolError):
            await pool.request(server.url, "POST", "/garbage", headers=[], body=b"")
        assert pool.stats().backends[server.url].active == 0
    finally:
        await pool.aclose()


async def test_hop_by_hop_headers_are_replaced(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        headers = [(b"Connection", b"close"), (b"content-length", b"99"), (b"x-request-id", b"r1")]
        response = await pool.request(server.url, "POST", "/ok", headers=headers, body=b"ab")
        assert await response.read() == b"ok:ab"
        _, _, seen = server.requests[0]
        assert seen[b"content-length"] == b"2" and seen[b"x-request-id"] == b"r1"
        assert b"connection" not in seen
    finally:
        await pool.aclose()


async def test_bad_input_is_rejected(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        with pytest.raises(ValueError, match="http://host"):
            await pool.request("https://example.invalid", "GET", "/", headers=[], body=b"")
        with pytest.raises(ValueError, match="path"):
            await pool.request(server.url + "/v1", "GET", "/", headers=[], body=b"")
        with pytest.raises(ValueError, match="invalid upstream request"):
            await pool.request(server.url, "GET", "/", headers=[(b"x-bad", b"a\r\nb")], body=b"")
        assert pool.stats().backends[server.url].active == 0
        with pytest.raises(ValueError):
            UpstreamPool(max_connections_per_backend=0)
    finally:
        await pool.aclose()


async def test_closed_pool_refuses_requests(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    await get(pool, server.url, "/ok")
    await pool.aclose()
    with pytest.raises(UpstreamError):
        await pool.request(server.url, "GET", "/ok", headers=[], body=b"")


# -- against the SGLang stand-in ------------------------------------------------------------


def generate_body(tokens: int) -> bytes:
    return json.dumps(
        {
            "text": "The capital of France is",
            "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
        }
    ).encode()


async def test_streams_generate_from_the_stand_in_on_one_connection() -> None:
    async with SimServer(SimConfig(name="p1", port=0, profile="instant")) as sim:
        pool = UpstreamPool()
        try:
            for _ in range(3):
                response = await pool.request(
                    sim.url,
                    "POST",
                    "/generate",
                    body=generate_body(8),
                    headers=[(b"content-type", b"application/json")],
                )
                assert response.status == 200
                events = (await response.read()).split(b"\n\n")
                assert events[-2] == b"data: [DONE]"
                last = json.loads(events[-3][len(b"data: ") :])
                assert last["meta_info"]["completion_tokens"] == 8
            assert pool.stats().connects == 1 and pool.stats().reused == 2
        finally:
            await pool.aclose()


async def test_early_close_aborts_the_request_in_the_stand_in() -> None:
    config = SimConfig(name="p2", port=0, profile="h100-llama3-8b", time_scale=0.2)
    async with SimServer(config) as sim:
        pool = UpstreamPool()
        try:
            response = await pool.request(
                sim.url,
                "POST",
                "/generate",
                body=generate_body(100000),
                headers=[(b"content-type", b"application/json")],
            )
            await anext(aiter(response))
            assert sim.scheduler is not None and not sim.scheduler.idle
            await response.aclose()
            await wait_until(lambda: sim.scheduler is not None and sim.scheduler.idle)
        finally:
            await pool.aclose()


async def test_stand_in_keep_alive_timeout_is_survived() -> None:
    # Long enough that a fresh connection is not timed out before its request is read, on a
    # busy machine too (a full collection in the test process can take tens of ms).
    async with SimServer(SimConfig(name="p3", port=0, timeout_keep_alive=0.5)) as sim:
        pool = UpstreamPool()
        try:
            response = await pool.request(sim.url, "GET", "/health", headers=[], body=b"")
            await response.read()
            await wait_until(lambda: pool.stats().backends[sim.url].idle == 0)
            response = await pool.request(sim.url, "GET", "/health", headers=[], body=b"")
            assert response.status == 200 and not response.reused
            await response.read()
        finally:
            await pool.aclose()


async def test_chunks_that_arrived_together_come_back_as_one(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        response = await pool.request(server.url, "POST", "/burst", headers=[], body=b"")
        chunks = [c async for c in response]
        # one read for all of it, and the connection is back in the pool
        assert chunks == [b"data: 0\n\ndata: 1\n\ndata: 2\n\n"]
        assert response.complete
        assert pool.stats().backends[server.url].idle == 1
        assert await get(pool, server.url, "/ok") == b"ok:"
        assert pool.stats().reused == 1
    finally:
        await pool.aclose()


async def test_data_before_a_framing_error_is_delivered_first(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        response = await pool.request(server.url, "POST", "/burst-die", headers=[], body=b"")
        chunks = aiter(response)
        assert await anext(chunks) == b"data: 1\n\ndata: 2\n\n"
        with pytest.raises(UpstreamProtocolError):
            await anext(chunks)
        assert not response.complete
        assert pool.stats().backends[server.url].active == 0
        assert pool.stats().backends[server.url].idle == 0
    finally:
        await pool.aclose()


def test_pool_and_stand_in_on_uvloop() -> None:
    """uvloop's transports are not asyncio.Transport subclasses; both ends must still work."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        async with SimServer(SimConfig(name="uv", port=0)) as sim:
            pool = UpstreamPool()
            try:
                await pool.warm(sim.url, 2)
                for _ in range(2):
                    response = await pool.request(
                        sim.url, "POST", "/generate", body=generate_body(8),
                        headers=[(b"content-type", b"application/json")],
                    )  # fmt: skip
                    assert response.status == 200
                    assert b"[DONE]" in await response.read()
                stats = pool.stats()
                assert stats.connects == 2 and stats.reused == 2
            finally:
                await pool.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


async def test_chunk_extensions_and_trailers_keep_the_connection(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        assert await get(pool, server.url, "/trailers") == b"hello world"
        assert await get(pool, server.url, "/ok") == b"ok:"
        assert pool.stats().reused == 1 and server.connections == 1
    finally:
        await pool.aclose()


async def test_chunked_answer_with_connection_close_is_not_reused(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        assert await get(pool, server.url, "/chunked-close") == b"bye"
        assert pool.stats().backends[server.url].idle == 0
        assert await get(pool, server.url, "/ok") == b"ok:"
        assert pool.stats().connects == 2
    finally:
        await pool.aclose()


async def test_requests_that_cannot_be_framed_are_refused(server: ScriptedServer) -> None:
    pool = UpstreamPool()
    try:
        for method, path in (("HEAD", "/ok"), ("POST", "/a b"), ("POST", "no-slash")):
            with pytest.raises(ValueError, match="invalid upstream request"):
                await pool.request(server.url, method, path, headers=[], body=b"")
        with pytest.raises(ValueError, match="invalid upstream request"):
            await pool.request(server.url, "POST", "/ok", headers=[(b"x y", b"1")], body=b"")
        assert server.connections == 0 and pool.stats().requests == 0
    finally:
        await pool.aclose()


async def test_a_shorter_chunk_timeout_after_a_long_first_byte_timeout(
    server: ScriptedServer,
) -> None:
    """The timeouts share one timer per connection: a nearer deadline must re-arm it."""
    pool = UpstreamPool()
    try:
        response = await pool.request(
            server.url, "POST", "/stream", headers=[], body=b"",
            first_byte_timeout=30, chunk_timeout=0.05,
        )  # fmt: skip
        chunks = aiter(response)
        await anext(chunks)
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamTimeout):
            await asyncio.wait_for(anext(chunks), 5)
        assert asyncio.get_running_loop().time() - started < 2
        # the connection is gone, and a fresh one still honours the long first-byte timeout
        assert pool.stats().backends[server.url].active == 0
        server.release.set()
        assert await get(pool, server.url, "/ok", first_byte_timeout=30, chunk_timeout=30) == b"ok:"
    finally:
        await pool.aclose()


async def test_a_sink_that_takes_the_end_returns_the_connection_at_once(
    server: ScriptedServer,
) -> None:
    pool = UpstreamPool()
    try:
        response = await pool.request(server.url, "POST", "/stream", headers=[], body=b"")
        chunks = aiter(response)
        assert await anext(chunks) == b"data: 1\n\n"
        taken: list[bytes] = []
        idle_at_end: list[int] = []

        def sink() -> bool:
            taken.append(response.take_ready())
            if response.take_end():
                idle_at_end.append(pool.stats().backends[server.url].idle)
            return not response.settled

        response.set_sink(sink)
        server.release.set()
        assert [c async for c in chunks] == []  # the sink took all of it, and the end
        assert b"".join(taken) == b"data: 2\n\ndata: [DONE]\n\n"
        assert idle_at_end == [1] and response.complete
    finally:
        await pool.aclose()


async def test_the_next_request_on_a_connection_a_sink_released_is_not_lost(
    server: ScriptedServer,
) -> None:
    """The sink ends the response from the read callback; the next request takes the connection
    and waits for its head before the first consumer has resumed from its own wait."""
    pool = UpstreamPool()
    loop = asyncio.get_running_loop()
    try:
        response = await pool.request(server.url, "POST", "/stream", headers=[], body=b"")
        chunks = aiter(response)
        assert await anext(chunks) == b"data: 1\n\n"
        follow_up: list[asyncio.Task[bytes]] = []

        def sink() -> bool:
            response.take_ready()
            if response.take_end():  # scheduled before the consumer's wake-up below
                follow_up.append(loop.create_task(get(pool, server.url, "/ok", b"next")))
            return not response.settled

        response.set_sink(sink)
        server.release.set()
        assert [c async for c in chunks] == []
        assert await asyncio.wait_for(follow_up[0], 5) == b"ok:next"
        assert pool.stats().reused == 1  # on the connection the sink gave back
    finally:
        await pool.aclose()
