"""A malformed HTTP/2 request is a stream error (RFC 9113 §8.1.1): it is reset with
PROTOCOL_ERROR, and the client's other requests on the connection, one in flight and the next
one, are served. Malformed headers, and a `content-length` its body does not match. A raw h2
client over TLS to the real listener."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import h2.config
import h2.connection
import h2.errors
import hpack
import pytest

from certs import DevCertificates
from tests.transport.test_request_cap import _Answers, _Client, _serving
from transport.h2_stream_errors import adopt
from transport.tls import TlsMaterial

PSEUDO = [(":method", "GET"), (":path", "/bad"), (":scheme", "https"), (":authority", "x")]
POST = [(":method", "POST"), (":path", "/read"), (":scheme", "https"), (":authority", "x")]
"""A request whose answer waits for its whole body."""


class Sent(NamedTuple):
    """What became of a request sent beside another in flight."""

    reset: int | None
    """The code it was reset with (None: answered)."""
    status: int | None
    """The status it was answered with (None: reset)."""


async def sent_beside_a_request_in_flight(
    tls: TlsMaterial,
    dev_certs: DevCertificates,
    headers: Sequence[tuple[Any, Any]],
    body: bytes | None = None,
) -> Sent:
    """Send a request with `headers` (and `body`) on a connection with another one in flight;
    check that the one in flight and a next one are answered whole and that the connection
    was not sent away."""
    app = _Answers()
    listener = await _serving(tls, app, max_requests=0)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert, lenient=True)
        _without_huffman(client)
        held = client.get("/hold")
        await asyncio.wait_for(app.holding.wait(), 5)
        sent = client.get("/sent", list(headers), body)
        await client.until_done(sent)
        app.release.set()
        after = client.get("/after")
        await client.until_done(held, after)
        assert client.whole(held) and client.whole(after)
        assert client.goaways == []
        return Sent(client.refused.get(sent), client.statuses.get(sent))
    finally:
        app.release.set()
        await listener.stop()


def _without_huffman(client: _Client) -> None:
    """The client's HPACK encoder sends string literals as they are: hpack's Huffman encoder
    takes 5 s for a 200 kB value (96 s for 900 kB)."""
    encoder = client.conn.encoder
    setattr(encoder, "encode", partial(encoder.encode, huffman=False))  # noqa: B010


@pytest.mark.parametrize(
    "headers",
    [
        [*PSEUDO, ("X-Upper", "1")],
        [*PSEUDO, ("connection", "keep-alive")],
        [*PSEUDO, ("te", "gzip")],
        [*PSEUDO, ("x-nul", "a\0b")],
        [("x-first", "1"), *PSEUDO],
        [h for h in PSEUDO if h[0] != ":path"],
        [*PSEUDO, (":path", "/again")],
    ],
    ids=["uppercase", "connection", "te", "nul", "pseudo-late", "no-path", "path-twice"],
)
async def test_a_malformed_request_is_reset_and_the_connection_goes_on(
    tls: TlsMaterial, dev_certs: DevCertificates, headers: list[tuple[str, str]]
) -> None:
    sent = await sent_beside_a_request_in_flight(tls, dev_certs, headers)
    assert sent.reset == h2.errors.ErrorCodes.PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("content_length", "body"),
    [
        (["abc"], b"abc"),
        (["3", "4"], b"abc"),
        (["3"], b"abcdef"),
        (["6"], b"abc"),
        (["6"], None),
    ],
    ids=["not-a-number", "two-values", "body-longer", "body-shorter", "no-body"],
)
async def test_a_body_its_content_length_does_not_match_is_reset_and_the_connection_goes_on(
    tls: TlsMaterial, dev_certs: DevCertificates, content_length: list[str], body: bytes | None
) -> None:
    """h2 alone raises these as errors of the whole connection (GOAWAY PROTOCOL_ERROR)."""
    headers = POST + [("content-length", value) for value in content_length]
    sent = await sent_beside_a_request_in_flight(tls, dev_certs, headers, body)
    assert sent.reset == h2.errors.ErrorCodes.PROTOCOL_ERROR


@pytest.mark.parametrize(("content_length", "body"), [(["3"], b"abc"), (["0"], None)])
async def test_a_body_its_content_length_matches_is_answered(
    tls: TlsMaterial, dev_certs: DevCertificates, content_length: list[str], body: bytes | None
) -> None:
    headers = POST + [("content-length", value) for value in content_length]
    assert (await sent_beside_a_request_in_flight(tls, dev_certs, headers, body)).reset is None


async def test_a_body_overrunning_its_content_length_is_reset_and_its_app_hears_the_client_is_gone(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    app = _Answers()
    listener = await _serving(tls, app, max_requests=0)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        sent = client.conn.get_next_available_stream_id()
        client.conn.send_headers(sent, [*POST, ("content-length", "3")])
        client.conn.send_data(sent, b"ab")
        client.writer.write(client.conn.data_to_send())
        await asyncio.wait_for(app.reading.wait(), 5)
        client.conn.send_data(sent, b"cdef", end_stream=True)
        client.writer.write(client.conn.data_to_send())
        await client.until_done(sent)
        assert client.refused == {sent: h2.errors.ErrorCodes.PROTOCOL_ERROR}
        await asyncio.wait_for(app.gone.wait(), 5)
        after = client.get("/after")
        await client.until_done(after)
        assert client.whole(after) and client.goaways == []
    finally:
        await listener.stop()


async def test_streams_past_the_limit_in_a_first_flight_are_refused_not_the_connection(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """101 requests before the client has read the server's SETTINGS (the limit is unlimited
    until then): 100 are answered and the 101st is refused, to be sent again."""
    listener = await _serving(tls, _Answers(), max_requests=0)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        streams = [client.get(f"/{i}") for i in range(101)]  # one write, nothing read yet
        await client.until_done(*streams)
        assert client.refused == {streams[-1]: h2.errors.ErrorCodes.REFUSED_STREAM}
        assert all(client.whole(s) for s in streams[:-1])
        again = client.get("/again")
        await client.until_done(again)
        assert client.whole(again) and client.goaways == []
    finally:
        await listener.stop()


@pytest.mark.parametrize("size", [70_000, 120_000, 200_000, 900_000])
async def test_a_header_list_over_the_advertised_size_is_answered_431_on_its_own_stream(
    tls: TlsMaterial, dev_certs: DevCertificates, size: int
) -> None:
    """Over the advertised 64 KiB: h2 alone ended the connection (GOAWAY ENHANCE_YOUR_CALM),
    and the answers of every request on it were lost; then, past twice that size, so did the
    listener."""
    headers = [*PSEUDO, ("x-big", "a" * size)]
    assert await sent_beside_a_request_in_flight(tls, dev_certs, headers) == (None, 431)


async def test_the_fields_dropped_from_an_oversized_header_list_still_enter_the_hpack_table(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    """A field past the size, dropped, still goes into the dynamic table (RFC 7541 §2.3.2), as
    it did into the client's: the next request refers to it by index, and is served."""
    listener = await _serving(tls, _Answers(), max_requests=0)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert)
        _without_huffman(client)
        over = client.get("/over", [*PSEUDO, ("x-big", "a" * 200_000), ("x-late", "1")])
        await client.until_done(over)
        assert client.statuses[over] == 431
        after_headers = [(":method", "GET"), (":path", "/after"), (":scheme", "https")]
        after = client.get("/after", [*after_headers, (":authority", "x"), ("x-late", "1")])
        await client.until_done(after)
        assert client.whole(after) and client.goaways == []
    finally:
        await listener.stop()


def test_each_literal_field_is_decoded_from_its_own_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """hpack copied the rest of the block for each literal field: a 1 MiB block of small
    fields took 4 s of the listener's loop before the size check stopped it."""
    seen: list[int] = []
    decode_literal = hpack.Decoder._decode_literal

    def recorded(decoder: hpack.Decoder, data: bytes, should_index: bool) -> Any:
        seen.append(len(data))
        return decode_literal(decoder, data, should_index)

    monkeypatch.setattr(hpack.Decoder, "_decode_literal", recorded)
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    adopt(connection)
    fields = [(b"x-%d" % i, b"v") for i in range(1000)]
    block = hpack.Encoder().encode(fields, huffman=False)
    assert connection.decoder.decode(block, raw=True) == fields
    assert max(seen) <= len(b"\x00\x05x-999\x01v")
