"""An HTTP/2 request answered before its body was read ends cleanly and the connection goes
on: hypercorn's queue into the app holds 10 messages, and a body in more pieces than that left
the stream's end waiting for room for ever, with the connection's sending behind it (a 401 to a
large upload hung the connection and held its slot). A raw h2 client over TLS."""

from __future__ import annotations

import pytest

from certs import DevCertificates
from tests.transport.test_request_cap import _Answers, _Client, _serving
from transport.tls import TlsMaterial


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
