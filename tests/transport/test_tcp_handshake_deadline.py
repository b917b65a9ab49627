"""A TCP connection to the TLS listener that never starts its TLS handshake is closed within
the head deadline (`head_timeout`), as one that never sends its request head is: hypercorn's
own handshake timeout, 60 s, let idle connections hold ~220 KB each before any cap counted
them."""

from __future__ import annotations

import asyncio

from certs.dev import DevCertificates
from transport.tcp import TcpListener, TcpOptions
from transport.tls import CertificateFiles, TlsMaterial


async def app(scope: object, receive: object, send: object) -> None:  # never reached
    raise AssertionError("no request")


async def test_a_connection_that_never_starts_its_handshake_is_closed_at_the_head_deadline(
    dev_certs: DevCertificates,
) -> None:
    tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))
    listener = TcpListener(app, host="127.0.0.1", port=0, tls=tls,
                           options=TcpOptions(head_timeout=0.5))  # fmt: skip
    await listener.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        try:
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, said nothing
        finally:
            writer.close()
    finally:
        await listener.stop()
