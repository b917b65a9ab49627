"""What a client can make the HTTP/3 listener hold is bounded by what it sent: a gap in its
stream data earns no larger window, handshake data far ahead of what was read, a handshake
message that never ends and a control frame too large to hold end the connection, there is no
QPACK table to fill or wait on, and a head that never comes is timed out on any stream. Real
aioquic clients (some writing what no well-behaved client would) against the real listener."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import ErrorCode, FrameType, Setting
from aioquic.quic.connection import QuicConnection, QuicErrorCode
from aioquic.tls import Epoch

from tests.transport.conftest import H3Factory
from tests.transport.h3client import H3Client, Response, client_config, h3_connect
from transport.aioquic_private import local_control_stream_id
from transport.asgi import Receive, Scope, Send
from transport.h3_session import H3Limits

MIB = 1 << 20


def _send_at(client: H3Client, stream_id: int, offset: int, data: bytes) -> None:
    """Write `data` at `offset` of a stream whose bytes below it are never sent: a gap."""
    sender = client.quic._get_or_create_stream_for_send(stream_id).sender
    sender._buffer = bytearray()
    sender._pending.subtract(0, 1 << 62)
    sender._buffer_start = sender._buffer_stop = offset
    sender.write(data)
    client.transmit()
    assert sender.highest_offset == offset + len(data), "not sent"


async def _closed_for(client: H3Client, stream_id: int, data: bytes) -> int:
    """Send `data` on a stream; the error code the server then closed the connection with."""
    client.quic.send_stream_data(stream_id, data)
    client.transmit()
    async with asyncio.timeout(10):
        while client.terminated is None:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return client.terminated.error_code


async def test_data_beyond_a_gap_earns_no_larger_receive_window(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """aioquic alone doubles both windows each time a byte lands just under them (8 MiB after
    these three), and fills the gap below with zeros: ten such bytes held half a gigabyte."""
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        stream_id = c.quic.get_next_available_stream_id()
        stream = c.quic._get_or_create_stream_for_send(stream_id)
        window, connection_window = stream.max_stream_data_remote, c.quic._remote_max_data
        assert window == connection_window == MIB
        for _ in range(3):
            credit = c.quic._remote_max_data - c.quic._remote_max_data_used
            edge = min(stream.max_stream_data_remote, stream.sender.highest_offset + credit)
            _send_at(c, stream_id, edge - 1, b"x")
            # a round trip: the server's acknowledgement follows any MAX_*DATA it sends
            await asyncio.wait_for(c.ping(), 5)
        assert stream.max_stream_data_remote == window
        assert c.quic._remote_max_data == connection_window
        # The client spent its connection's credit on the gap: it has locked itself out.
        assert c.terminated is None


async def test_data_delivered_in_order_still_earns_larger_windows(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        body = b"y" * (MIB * 3 // 4)
        r = await c.fetch("POST", "/echo", body=body)
        assert r.status == 200 and b'"body_bytes": 786432' in r.body
        assert c.quic._remote_max_data == 2 * MIB


async def test_handshake_data_far_ahead_of_what_was_read_ends_the_connection(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """A first datagram whose ClientHello claims an offset of 100 kB: aioquic alone holds the
    gap (up to 512 KiB) until the idle timeout, for an address nobody checked."""
    async with h3_server() as server:
        quic = QuicConnection(configuration=client_config(dev_certs.ca_cert))
        initialize = quic._initialize

        def _far_ahead(peer_cid: bytes) -> None:
            initialize(peer_cid)
            sender = quic._crypto_streams[Epoch.INITIAL].sender
            sender._buffer_start = sender._buffer_stop = 100_000

        quic._initialize = _far_ahead  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.connect(("127.0.0.1", server.port))
            quic.connect(("127.0.0.1", server.port), now=time.time())
            for datagram, _ in quic.datagrams_to_send(now=time.time()):
                sock.send(datagram)
            async with asyncio.timeout(10):
                # the CONNECTION_CLOSE received (aioquic reports it only after draining)
                while quic._close_event is None:
                    data = await loop.sock_recv(sock, 65536)
                    quic.receive_datagram(data, ("127.0.0.1", server.port), now=time.time())
        assert quic._close_event.error_code == QuicErrorCode.CRYPTO_BUFFER_EXCEEDED


async def test_a_handshake_message_that_never_ends_ends_the_connection(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """An Initial whose ClientHello claims 16 MiB, then 24 KiB of it in order: aioquic alone
    holds it all for the message to be whole, copying everything it holds at each frame (8 MiB
    took 20 s of CPU), for an address nobody checked."""
    async with h3_server() as server:
        quic = QuicConnection(configuration=client_config(dev_certs.ca_cert))
        loop = asyncio.get_running_loop()
        address = ("127.0.0.1", server.port)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.connect(address)
            quic.connect(address, now=time.time())
            sender = quic._crypto_streams[Epoch.INITIAL].sender
            sender._buffer = bytearray()  # instead of the real ClientHello
            sender._pending.subtract(0, 1 << 62)
            sender._buffer_start = sender._buffer_stop = 0
            sender.write(b"\x01\xff\xff\xf0" + bytes(24 * 1024))
            async with asyncio.timeout(10):
                while quic._close_event is None:
                    for datagram, _ in quic.datagrams_to_send(now=time.time()):
                        sock.send(datagram)
                    timer = quic.get_timer()
                    wait = 0.5 if timer is None else max(0.0, min(0.5, timer - time.time()))
                    try:
                        async with asyncio.timeout(wait):
                            data = await loop.sock_recv(sock, 65536)
                    except TimeoutError:
                        quic.handle_timer(now=time.time())
                        continue
                    quic.receive_datagram(data, address, now=time.time())
        assert quic._close_event.error_code == QuicErrorCode.CRYPTO_BUFFER_EXCEEDED


async def test_a_control_frame_too_large_to_hold_ends_the_connection(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """aioquic alone waits for the whole frame, copying all it holds at each packet: a core
    at 100 % for as long as the client sends."""
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        control = local_control_stream_id(c.h3)
        assert control is not None
        frame_head = encode_uint_var(FrameType.MAX_PUSH_ID) + encode_uint_var(1 << 40)
        code = await _closed_for(c, control, frame_head + b"\0" * 1000)
        assert code == ErrorCode.H3_EXCESSIVE_LOAD


async def test_a_request_waiting_on_a_qpack_entry_never_sent_ends_the_connection(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """The listener allows no blocked stream: aioquic alone would hold such a request, and
    everything sent on it, until its head deadline."""
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        # A field section that needs one inserted entry (RFC 9204 §4.5.1: encoded Required
        # Insert Count 2, base 0) and refers to it (§4.5.2: dynamic, relative index 0).
        block = b"\x02\x00\x80"
        frame = encode_uint_var(FrameType.HEADERS) + encode_uint_var(len(block)) + block
        code = await _closed_for(c, c.quic.get_next_available_stream_id(), frame)
        assert code == ErrorCode.QPACK_DECOMPRESSION_FAILED


async def test_a_qpack_table_entry_ends_the_connection_the_listener_keeps_none(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """With a dynamic table of 4 KB, each byte of a header block could stand for 4 KB: a 16 KiB
    block decoded to 64 MB. The listener offers none, and a client's requests need none."""
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        assert (await c.fetch("GET", "/echo", headers=[(b"x-a", b"v" * 100)])).status == 200
        settings = c.h3.received_settings
        assert settings is not None and settings[Setting.QPACK_MAX_TABLE_CAPACITY] == 0
        encoder = c.h3._local_encoder_stream_id
        assert encoder is not None
        # RFC 9204 §4.3.1, §4.3.3: Set Dynamic Table Capacity 64, then insert "x-a: v".
        instructions = b"\x3f\x21" + b"\x43x-a\x01v"
        code = await _closed_for(c, encoder, instructions)
        assert code == ErrorCode.QPACK_ENCODER_STREAM_ERROR


async def test_a_head_that_never_comes_on_an_older_stream_gets_408(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """HEADERS started on stream 0 after stream 4's request was answered: the listener timed
    only streams newer than the newest head it had read."""
    async with h3_server(limits=H3Limits(request_head_timeout=0.5)) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            older = c.quic.get_next_available_stream_id()
            c.quic._get_or_create_stream_for_send(older)
            assert (await c.fetch("GET", "/echo")).status == 200
            response = c.responses[older] = Response()
            c.quic.send_stream_data(older, encode_uint_var(FrameType.HEADERS) + bytes([100, 0]))
            c.transmit()
            await asyncio.wait_for(response.done.wait(), 5)
            assert response.status == 408
            assert (await c.fetch("GET", "/echo")).status == 200


async def test_an_app_that_reads_late_holds_no_more_than_the_windows(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """Bodies were queued for the app as they came and the windows grew with them: an app that
    never read held every byte each stream may carry (16 streams of 8 MiB: +157 MB). The
    windows now grow as the app reads, and the uploads finish once it does."""
    reading = asyncio.Event()

    async def late_reader(scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.wait_for(reading.wait(), 10)
        size, more = 0, True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})

    async with h3_server(app=late_reader) as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            streams = [c.request("POST", "/", body=b"z" * (3 * MIB)) for _ in range(4)]
            c.transmit()
            # Round trips enough for windows granted on what was delivered to grow past 4 MiB.
            for _ in range(8):
                await asyncio.wait_for(c.ping(), 5)
            assert c.quic._remote_max_data == MIB
            (protocol,) = server.connections()
            assert protocol.quic._local_max_data.used <= MIB
            reading.set()
            for stream_id in streams:
                response = await c.wait(stream_id)
                assert (response.status, response.body) == (200, str(3 * MIB).encode())
            assert c.quic._remote_max_data > 4 * MIB
