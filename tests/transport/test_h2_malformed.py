"""A malformed HTTP/2 request is a stream error (RFC 9113 §8.1.1): it is reset with
PROTOCOL_ERROR, and the client's other requests on the connection, one in flight and the next
one, are served. A raw h2 client over TLS to the real listener."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import h2.errors
import pytest

from certs import DevCertificates
from tests.transport.test_request_cap import _Answers, _Client, _serving
from transport.tls import TlsMaterial

PSEUDO = [(":method", "GET"), (":path", "/bad"), (":scheme", "https"), (":authority", "x")]


async def sent_beside_a_request_in_flight(
    tls: TlsMaterial, dev_certs: DevCertificates, headers: Sequence[tuple[Any, Any]]
) -> int | None:
    """Send a request with `headers` on a connection with another one in flight; check that
    the one in flight and a next one are answered whole and that the connection was not sent
    away. The code it was reset with (None: answered)."""
    app = _Answers()
    listener = await _serving(tls, app, max_requests=0)
    try:
        client = await _Client.open(listener.port, dev_certs.ca_cert, lenient=True)
        held = client.get("/hold")
        await asyncio.wait_for(app.holding.wait(), 5)
        sent = client.get("/sent", list(headers))
        await client.until_done(sent)
        app.release.set()
        after = client.get("/after")
        await client.until_done(held, after)
        assert client.whole(held) and client.whole(after)
        assert client.goaways == []
        return client.refused.get(sent)
    finally:
        app.release.set()
        await listener.stop()


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
    assert await sent_beside_a_request_in_flight(tls, dev_certs, headers) == (
        h2.errors.ErrorCodes.PROTOCOL_ERROR
    )
