"""HTTP/2 responses through the TLS listener keep their bytes whole and in order, however the
chunks meet the flow-control windows: small and large chunks, a client's 100-byte window, a
stream its client resets beside others. A raw h2 client over TLS to the real listener."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings

from certs import DevCertificates
from transport.asgi import Receive, Scope, Send
from transport.tcp import TcpListener
from transport.tls import TlsMaterial

CHUNKS = [b"a" * 10, b"b" * 40_000, b"c" * 7, b"d" * 70_000, b"e" * 3, b"f" * 20]


async def _chunked(scope: Scope, receive: Receive, send: Send) -> None:
    """Streams `CHUNKS`, then after a moment more of them: small and large, in one order."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for chunk in CHUNKS:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await asyncio.sleep(0.05)
    for chunk in CHUNKS:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _fetch(
    port: int, ca: Any, *, window: int, streams: int = 1, reset: Sequence[int] = ()
) -> dict[int, bytes]:
    """GET / on `streams` streams of one connection whose receive window is `window` bytes
    (replenished as data is read); the streams in `reset` are reset after their first DATA.
    The bodies of the streams not reset, by stream id."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(["h2"])
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="localhost"
    )
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window}
    )
    conn.initiate_connection()
    headers = [(":method", "GET"), (":path", "/"), (":scheme", "https"), (":authority", "x")]
    ids = []
    for _ in range(streams):
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, headers, end_stream=True)
        ids.append(stream_id)
    to_reset = {ids[i] for i in reset}
    writer.write(conn.data_to_send())
    bodies: dict[int, bytearray] = {i: bytearray() for i in ids}
    open_streams = set(ids)
    try:
        while open_streams:
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, "the server closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    sid = event.stream_id
                    conn.acknowledge_received_data(event.flow_controlled_length, sid)
                    if sid in to_reset:
                        conn.reset_stream(sid)
                        open_streams.discard(sid)
                        bodies.pop(sid, None)
                        to_reset.discard(sid)
                    elif sid in bodies:
                        bodies[sid] += event.data
                elif isinstance(event, h2.events.StreamEnded):
                    open_streams.discard(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    raise AssertionError(f"stream {event.stream_id} was reset by the server")
            writer.write(conn.data_to_send())
    finally:
        writer.close()
    return {sid: bytes(body) for sid, body in bodies.items()}


async def _with_listener(tls: TlsMaterial, coro: Any) -> Any:
    listener = TcpListener(_chunked, host="127.0.0.1", port=0, tls=tls, alt_svc_port=None)
    await listener.start()
    try:
        return await coro(listener.port)
    finally:
        await listener.stop()


async def test_every_byte_arrives_in_order_through_a_wide_window(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    bodies = await _with_listener(
        tls, lambda port: _fetch(port, dev_certs.ca_cert, window=1 << 24, streams=3)
    )
    assert list(bodies.values()) == [b"".join(CHUNKS) * 2] * 3


async def test_a_small_window_holds_chunks_in_order_until_the_client_reads(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """A 100-byte window takes the first small chunk at once and leaves the rest, small ones
    too, behind the large one that waits for credit."""
    bodies = await _with_listener(
        tls, lambda port: _fetch(port, dev_certs.ca_cert, window=100, streams=2)
    )
    assert list(bodies.values()) == [b"".join(CHUNKS) * 2] * 2


async def test_a_stream_reset_by_the_client_leaves_the_others_whole(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    bodies = await _with_listener(
        tls, lambda port: _fetch(port, dev_certs.ca_cert, window=1 << 24, streams=3, reset=[1])
    )
    assert len(bodies) == 2
    assert list(bodies.values()) == [b"".join(CHUNKS) * 2] * 2
