"""Malformed requests, limits, concurrency, resets and flushing on the HTTP/3 listener."""

from __future__ import annotations

import asyncio

import pytest
from aioquic.h3.connection import ErrorCode

from tests.helpers import settled, wait_until
from tests.transport.apps import RecordingApp
from tests.transport.conftest import H3Factory
from tests.transport.h3client import H3Client, h3_connect
from tests.transport.udp_holdback import UdpHoldback
from transport.asgi import Receive, Scope, Send
from transport.h3_server import SEND_HIGH_WATER
from transport.h3_session import H3Limits


async def _connection_still_serves(client: H3Client) -> None:
    r = await client.fetch("GET", "/echo")
    assert r.status == 200


BASE = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"localhost")]


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param(BASE, id="missing-path"),
        pytest.param([(b":method", b"GET"), (b":path", b"/echo")], id="missing-scheme"),
        pytest.param([*BASE, (b":path", b"/echo"), (b":bogus", b"1")], id="unknown-pseudo"),
        pytest.param([*BASE, (b":path", b"/echo"), (b":path", b"/x")], id="duplicate-pseudo"),
        pytest.param([*BASE, (b":path", b"/echo"), (b"Upper", b"x")], id="uppercase-name"),
        pytest.param([*BASE, (b":path", b"/echo"), (b"connection", b"close")], id="conn-header"),
    ],
)
async def test_malformed_request_is_a_stream_error(
    h3_server: H3Factory, dev_certs, fields: list[tuple[bytes, bytes]]
) -> None:
    app = RecordingApp()
    async with h3_server(app=app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        held = c.request("GET", "/hold")
        c.send_now()
        await asyncio.wait_for(c.responses[held].first_data.wait(), 10)
        bad = await c.fetch("GET", "", raw_headers=fields)
        assert bad.reset_code == ErrorCode.H3_MESSAGE_ERROR
        assert bad.status is None
        # The other request on the connection is unharmed and the connection serves on.
        assert not c.responses[held].done.is_set()
        assert c.terminated is None
        await _connection_still_serves(c)
    assert [s.path for s in app.seen] == ["/hold", "/echo"]


@pytest.mark.parametrize("length", [b"5", b"20", b"ten"], ids=["short", "long", "not-a-number"])
async def test_a_content_length_the_body_does_not_match_is_a_stream_error(
    h3_server: H3Factory, dev_certs, length: bytes
) -> None:
    """As over HTTP/2 it is not (h2 ends the connection: docs/transport.md, "Listeners")."""
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        bad = await c.fetch("POST", "/echo", body=b"x" * 10, headers=[(b"content-length", length)])
        assert bad.reset_code == ErrorCode.H3_MESSAGE_ERROR and bad.status is None
        assert c.terminated is None
        await _connection_still_serves(c)


async def test_a_body_past_its_content_length_is_a_stream_error_at_once(
    h3_server: H3Factory, dev_certs
) -> None:
    """aioquic compares the two only when the stream ends: the app read up to `max_body_bytes`
    of a body that declared 10 bytes, for as long as the client kept the stream open."""
    app = RecordingApp()
    async with h3_server(app=app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        bad = c.request(
            "POST", "/echo", body=b"x" * 3000, headers=[(b"content-length", b"10")], end=False
        )
        c.send_now()
        response = await c.wait(bad)
        assert response.reset_code == ErrorCode.H3_MESSAGE_ERROR and response.status is None
        assert await asyncio.wait_for(app.disconnects.get(), 5) == "/echo"
        assert len(app.seen[0].body) <= 10
        await _connection_still_serves(c)


@pytest.mark.parametrize("limit", [2, 4])
async def test_connection_ids_are_bounded_both_ways(
    h3_server: H3Factory, dev_certs, limit: int
) -> None:
    """The listener advertises its active_connection_id_limit and issues no more connection IDs
    than it, though the aioquic client would accept 8."""
    async with h3_server(limits=H3Limits(active_connection_ids=limit)) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            await _connection_still_serves(c)
            quic = c.quic
            assert quic._remote_active_connection_id_limit == limit
            # the handshake's connection ID plus the spares the server sent
            await wait_until(lambda: len(quic._peer_cid_available) == limit - 1)
            await _connection_still_serves(c)
            assert len(quic._peer_cid_available) == limit - 1
            assert c.terminated is None


@pytest.mark.parametrize("value", [1, 9])
def test_connection_id_limit_out_of_range_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match="active_connection_ids must be from 2 to 8"):
        H3Limits(active_connection_ids=value)


async def test_non_origin_form_target_is_400(h3_server: H3Factory, dev_certs) -> None:
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        r = await c.fetch("GET", "", raw_headers=[*BASE, (b":path", b"*")])
        assert r.status == 400
        await _connection_still_serves(c)


async def test_oversize_header_block_is_431(h3_server: H3Factory, dev_certs) -> None:
    limits = H3Limits(max_header_bytes=2048)
    app = RecordingApp()
    async with h3_server(app=app, limits=limits) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            # One huge field: refused from the encoded frame size, before buffering it.
            big = await c.fetch("GET", "/echo", headers=[(b"x-big", b"a" * 8000)])
            assert big.status == 431
            # Many small fields: compressed under the limit, over it once counted (§4.2.2).
            many = [(b"x-h%d" % i, b"v") for i in range(80)]
            r = await c.fetch("GET", "/echo", headers=many)
            assert r.status == 431
            await _connection_still_serves(c)
    assert [s.path for s in app.seen] == ["/echo"]


async def test_a_field_section_over_the_limit_is_refused_before_its_fields_are_checked(
    h3_server: H3Factory, dev_certs
) -> None:
    """aioquic checks every byte of every field in Python (~30 ns a byte), and QPACK lets a
    16 KiB block decode to megabytes (a dynamic-table entry of 4 KB referenced by each byte:
    1.7 s of CPU a block); the size is counted first, so a malformed field past the limit is
    never looked at and the answer is 431, not a reset for the malformed field."""
    async with h3_server(limits=H3Limits(max_header_bytes=2048)) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            fields = [(b"x-h%d" % i, b"v") for i in range(80)] + [(b"Upper", b"x")]
            r = await c.fetch("GET", "/echo", headers=fields)
            assert (r.status, r.reset_code) == (431, None)
            await _connection_still_serves(c)


async def test_oversize_trailers_after_the_answer_began_reset_the_stream(
    h3_server: H3Factory, dev_certs
) -> None:
    """A status cannot follow an answer that began: the listener tried to send a 431 anyway,
    which raised at every later datagram of the connection; it served nothing more, and the
    app never heard the request was gone."""
    app = RecordingApp()
    async with h3_server(app=app, limits=H3Limits(max_header_bytes=2048)) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            held = c.request("POST", "/hold", body=b"abc", end=False)
            c.send_now()
            await asyncio.wait_for(c.responses[held].first_data.wait(), 10)
            c.h3.send_headers(held, [(b"x-big", b"a" * 8000)], end_stream=True)  # trailers
            c.send_now()
            response = await c.wait(held)
            assert response.reset_code == ErrorCode.H3_REQUEST_CANCELLED
            assert await asyncio.wait_for(app.disconnects.get(), 5) == "/hold"
            await _connection_still_serves(c)


async def test_body_over_limit_is_413(h3_server: H3Factory, dev_certs) -> None:
    limits = H3Limits(max_body_bytes=1000)
    app = RecordingApp()
    async with h3_server(app=app, limits=limits) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            declared = await c.fetch(
                "POST", "/echo", body=b"x" * 2000, headers=[(b"content-length", b"2000")]
            )
            assert declared.status == 413
            # No content-length: refused once the bytes pass the limit; the app is told.
            streamed = await c.fetch("POST", "/echo", body=b"x" * 3000)
            assert streamed.status == 413
            ok = await c.fetch("POST", "/echo", body=b"x" * 1000)
            assert ok.status == 200
    assert await asyncio.wait_for(app.disconnects.get(), 5) == "/echo"


async def test_hundred_concurrent_streams_on_one_connection(
    h3_server: H3Factory, dev_certs
) -> None:
    n = 100
    inside = 0
    all_in = asyncio.Event()

    async def barrier_app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal inside
        inside += 1
        if inside == n:
            all_in.set()
        await all_in.wait()  # every request is in the app at the same time
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["path"].encode()})

    async with h3_server(app=barrier_app) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            ids = [c.request("GET", f"/r{i}") for i in range(n)]
            c.send_now()
            responses = await asyncio.gather(*(c.wait(i, 30) for i in ids))
    assert [r.status for r in responses] == [200] * n
    assert [r.body for r in responses] == [b"/r%d" % i for i in range(n)]


async def test_concurrent_stream_limit_queues_extra_requests(
    h3_server: H3Factory, dev_certs
) -> None:
    app = RecordingApp()
    async with h3_server(app=app, limits=H3Limits(max_concurrent_streams=2)) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            holds = [c.request("GET", "/hold") for _ in range(2)]
            c.send_now()
            for h in holds:
                await asyncio.wait_for(c.responses[h].first_data.wait(), 10)
            third = c.request("GET", "/echo")
            c.send_now()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(c.responses[third].done.wait()), 0.3)
            assert [s.path for s in app.seen] == ["/hold", "/hold"]
            c.reset(holds[0])
            r = await c.wait(third)
            assert r.status == 200


async def test_client_reset_reaches_app_as_disconnect(h3_server: H3Factory, dev_certs) -> None:
    app = RecordingApp()
    async with h3_server(app=app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        sid = c.request("GET", "/hold")
        c.send_now()
        await asyncio.wait_for(c.responses[sid].first_data.wait(), 10)
        c.reset(sid)
        assert await asyncio.wait_for(app.disconnects.get(), 10) == "/hold"
        await _connection_still_serves(c)
    assert app.seen[0].disconnected


async def test_connection_close_reaches_app_as_disconnect(h3_server: H3Factory, dev_certs) -> None:
    app = RecordingApp()
    async with h3_server(app=app) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            sid = c.request("GET", "/hold")
            c.send_now()
            await asyncio.wait_for(c.responses[sid].first_data.wait(), 10)
        # leaving the block closed the connection (CONNECTION_CLOSE)
        assert await asyncio.wait_for(app.disconnects.get(), 10) == "/hold"


async def test_each_send_is_flushed(h3_server: H3Factory, dev_certs) -> None:
    app = RecordingApp()
    async with h3_server(app=app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        sid = c.request("GET", "/stream?n=3")
        c.send_now()
        r = c.responses[sid]
        for i in range(3):
            await app.release.put(None)
            # chunk i arrives while the app is blocked before producing chunk i+1
            assert await asyncio.wait_for(r.arrivals.get(), 10) == b"%d;" % i
        await c.wait(sid)
    assert r.body == b"0;1;2;"


async def test_sends_are_back_pressured_by_unacknowledged_bytes(
    h3_server: H3Factory, dev_certs
) -> None:
    chunk, total = 128 * 1024, 12
    sent = 0

    async def flood(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal sent
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/flood":
            for _ in range(total):
                await send({"type": "http.response.body", "body": b"x" * chunk, "more_body": True})
                sent += 1
        await send({"type": "http.response.body", "body": b""})

    async with h3_server(app=flood) as server:
        relay = UdpHoldback(server.port)
        port = await relay.start()
        try:
            async with h3_connect(port, dev_certs.ca_cert) as c:
                assert (await c.fetch("GET", "/warm")).status == 200
                relay.hold_down = True  # nothing reaches the client, so nothing is acked
                sid = c.request("GET", "/flood")
                c.send_now()
                # The app is held once ~SEND_HIGH_WATER bytes wait for acknowledgement.
                held_at = await settled(lambda: sent)
                assert 0 < held_at <= SEND_HIGH_WATER // chunk + 1
                relay.release_down()
                r = await c.wait(sid, timeout=60)
        finally:
            relay.close()
    assert sent == total
    assert len(r.body) == chunk * total


async def test_app_errors_become_500_or_reset(h3_server: H3Factory, dev_certs) -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/late":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        raise RuntimeError("boom")

    async with h3_server(app=broken) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        early = await c.fetch("GET", "/early")
        assert early.status == 500
        late = await c.fetch("GET", "/late")
        assert late.status == 200 and late.reset_code == ErrorCode.H3_INTERNAL_ERROR


async def test_limits_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="max_body_bytes"):
        H3Limits(max_body_bytes=0)
    with pytest.raises(ValueError, match="idle_timeout"):
        H3Limits(idle_timeout=0)
