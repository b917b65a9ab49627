"""An HTTP/2 request body goes back to the client's flow-control windows as its app reads it.
hypercorn queued DATA for the app 10 messages deep and returned the credit at once: an app that
read late made the connection's read loop wait, and every other request on the connection
with it, and a body in more pieces than that left a stream answered before reading it waiting
at its end for ever (a 401 to a large upload hung the connection and held its slot). A raw h2
client over TLS."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from certs import DevCertificates
from tests.transport.test_request_cap import _Answers, _Client, _serving
from transport.asgi import Receive, Scope, Send
from transport.tls import TlsMaterial

STREAM_WINDOW = 65_535
"""h2's initial stream window, which the listener keeps."""


@pytest.mark.parametrize("pieces", [30, 200])
async def test_an_answer_before_the_body_was_read_leaves_the_connection_serving(
    tls: TlsMaterial, dev_certs: DevCertificates, pieces: int
) -> None:
    listener = await _serving(tls, _Answers(), max_requests=0)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        sent = client.conn.get_next_available_stream_id()
        client.paths[sent], client.bodies[sent] = "/now", bytearray()
        fields = [(":method", "POST"), (":path", "/now"), (":scheme", "https")]
        client.conn.send_headers(sent, [*fields, (":authority", "x")])
        for _ in range(pieces):  # the app answers at once and reads none of it
            client.conn.send_data(sent, b"x" * 256)
            client.writer.write(client.conn.data_to_send())
        client.conn.end_stream(sent)
        client.writer.write(client.conn.data_to_send())
        await client.until_done(sent)
        assert client.whole(sent)
        after = client.get("/after")
        await client.until_done(after)
        assert client.whole(after) and client.goaways == []
    finally:
        await listener.stop()


@dataclass
class _LateReader:
    """`/late` reads its body once `release` is set and answers its size and the number of
    messages it came in; any other path answers as `_Answers` does, at once."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    others: _Answers = field(default_factory=_Answers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/late":
            await self.others(scope, receive, send)
            return
        await asyncio.wait_for(self.release.wait(), 10)
        size = messages = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            messages += 1
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": f"{size} {messages}".encode()})


def _upload(client: _Client, path: str) -> int:
    stream_id = client.conn.get_next_available_stream_id()
    client.paths[stream_id], client.bodies[stream_id] = path, bytearray()
    fields = [(":method", "POST"), (":path", path), (":scheme", "https"), (":authority", "x")]
    client.conn.send_headers(stream_id, fields)
    return stream_id


async def _send_all(client: _Client, stream_id: int, size: int, piece: int) -> None:
    """Send `size` bytes in DATA frames of `piece` as the windows allow, then end the stream."""
    while size:
        room = min(client.conn.local_flow_control_window(stream_id), size, piece)
        if room == 0:
            await client._read()  # window updates
            continue
        client.conn.send_data(stream_id, b"u" * room)
        client.writer.write(client.conn.data_to_send())
        size -= room
    client.conn.end_stream(stream_id)
    client.writer.write(client.conn.data_to_send())


async def test_an_app_that_reads_late_holds_up_no_other_request_and_only_its_window(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """A GET behind 64 unread DATA frames waited for the app before; the unread stream now
    holds its window (h2's 65,535 bytes) and no more, and the upload ends once it is read."""
    app = _LateReader()
    listener = await _serving(tls, app, max_requests=0)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        first = client.get("/first")  # and the server's settings and window
        await client.until_done(first)
        upload = _upload(client, "/late")
        for _ in range(STREAM_WINDOW // 1024):
            client.conn.send_data(upload, b"u" * 1024)
        client.conn.send_data(upload, b"u" * (STREAM_WINDOW % 1024))
        client.writer.write(client.conn.data_to_send())
        other = client.get("/other")
        await client.until_done(other)  # timed out before: the read loop waited
        assert client.whole(other)
        assert client.conn.local_flow_control_window(upload) == 0  # not credited while unread
        assert client.conn.outbound_flow_control_window > STREAM_WINDOW
        app.release.set()
        await _send_all(client, upload, 200_000, 1024)
        await client.until_done(upload)
        size, messages = map(int, client.bodies[upload].split())
        assert size == STREAM_WINDOW + 200_000
        assert messages < 100  # pieces waiting for the app are joined, not one message a frame
    finally:
        await listener.stop()


async def test_what_an_app_never_read_goes_back_to_the_connection(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """Streams answered without reading their bodies would otherwise keep their share of the
    connection's credit for ever: after a window's worth of them, the connection took no more
    request bodies at all."""
    listener = await _serving(tls, _Answers(), max_requests=0)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        first = client.get("/first")
        await client.until_done(first)
        window = client.conn.outbound_flow_control_window
        for _ in range(4):  # each round half the connection's window, left unread
            uploads = [_upload(client, "/slow") for _ in range(window // STREAM_WINDOW // 2)]
            for upload in uploads:
                await _send_all(client, upload, STREAM_WINDOW, 16_384)
            await client.until_done(*uploads)
            assert all(client.whole(upload) for upload in uploads)
        last = client.get("/last")
        await client.until_done(last)
        assert client.whole(last) and client.goaways == []
    finally:
        await listener.stop()
