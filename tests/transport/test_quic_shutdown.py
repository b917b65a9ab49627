"""Graceful shutdown of the HTTP/3 listener over real sockets: what a drain lets finish reaches
the client whole before the connection is closed."""

from __future__ import annotations

import asyncio

from aioquic.h3.connection import ErrorCode

from certs import DevCertificates
from tests.helpers import settled, wait_until
from tests.transport.apps import RecordingApp
from tests.transport.conftest import H3Factory
from tests.transport.h3client import fresh_ticket, h3_connect
from tests.transport.udp_holdback import UdpHoldback
from transport.asgi import Receive, Scope, Send
from transport.early_data import EarlyDataPolicy, Mode

BODY = 2 * 1024 * 1024
"""Over the 1 MiB a stream may hold unacknowledged: the app returns with up to that unsent."""


async def _big(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    chunk = b"x" * 65536
    for _ in range(BODY // len(chunk)):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def test_a_response_the_app_finished_before_the_close_reaches_the_client_whole(
    h3_server: H3Factory, dev_certs: DevCertificates
) -> None:
    """The app wrote its whole answer during the drain: the close that follows the drain waits
    until the client has it (within the drain's deadline), not only until the app returned."""
    async with h3_server(app=_big) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        sid = c.request("GET", "/big")
        c.send_now()
        await asyncio.wait_for(c.responses[sid].first_data.wait(), 10)
        await asyncio.wait_for(server.drain(timeout=10), 15)
        await server.aclose()
        r = await c.wait(sid)
    assert r.reset_code is None and c.terminated is not None
    assert len(r.body) == BODY


async def test_a_request_deferred_for_the_handshake_is_served_by_a_drain(
    h3_server: H3Factory, dev_certs: DevCertificates
) -> None:
    """A 0-RTT request held for the handshake (`defer`) was received before the GOAWAY: the
    drain waits for it, within its deadline, rather than ending with no app running and
    closing the connection under it."""
    app = RecordingApp()
    policy = EarlyDataPolicy({"/echo": Mode.DEFER}, Mode.DEFER)
    async with h3_server(app=app, policy=policy) as server:
        ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        relay = UdpHoldback(server.port, hold_after_reply=True)
        port = await relay.start()
        try:
            async with h3_connect(
                port, dev_certs.ca_cert, ticket=ticket, wait_connected=False
            ) as client:
                sid = client.request("POST", "/echo", body=b"{}")
                client.send_now()
                await asyncio.wait_for(client.handshake_done.wait(), 10)
                await asyncio.wait_for(relay.holding.wait(), 10)  # its Finished is held
                drain = asyncio.create_task(server.drain(timeout=10))
                await settled(lambda: relay.bytes_down)
                assert not drain.done()
                relay.release()
                r = await client.wait(sid)
                await asyncio.wait_for(drain, 10)
        finally:
            relay.close()
    assert r.status == 200 and r.reset_code is None


async def test_a_drain_does_not_wait_for_a_client_gone_quiet_with_nothing_open(
    h3_server: H3Factory, dev_certs: DevCertificates
) -> None:
    """A connection with no request open whose client acknowledges nothing (it went away, as
    a phone does, within the idle timeout) does not hold the drain to its deadline."""
    async with h3_server() as server:
        relay = UdpHoldback(server.port)
        port = await relay.start()
        try:
            async with h3_connect(port, dev_certs.ca_cert) as client:
                assert (await client.fetch("GET", "/echo")).status == 200
                relay.hold_down = True  # from now on the client hears nothing, so acks nothing
                await asyncio.wait_for(server.drain(timeout=60), 5)
        finally:
            relay.close()


async def test_the_close_after_a_drain_says_h3_no_error(
    h3_server: H3Factory, dev_certs: DevCertificates
) -> None:
    """RFC 9114 §5.2: a graceful shutdown closes with H3_NO_ERROR (0x100); aioquic's default,
    0, is no HTTP/3 error code."""
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        assert (await c.fetch("GET", "/echo")).status == 200
        await asyncio.wait_for(server.drain(timeout=10), 5)
        await server.aclose()
        await wait_until(lambda: c.terminated is not None, timeout=5)
    assert c.terminated is not None
    assert c.terminated.error_code == ErrorCode.H3_NO_ERROR and c.terminated.frame_type is None
