"""The TLS listener's settings as a client on the internet meets them, over real sockets:
TLS 1.2 at least, AEAD cipher suites only (RFC 9113 §9.2.2 and its Appendix A: the CBC
suites of TLS 1.2 are on HTTP/2's blocklist, and a strict HTTP/2 client ends a connection that
negotiated one with INADEQUATE_SECURITY), no compression, ALPN h2 and http/1.1."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from certs import DevCertificates
from tests.transport.apps import RecordingApp
from transport.tcp import TcpListener
from transport.tls import TlsMaterial


def _client(dev_certs: DevCertificates, *, version: ssl.TLSVersion | None = None,
            ciphers: str | None = None) -> ssl.SSLContext:  # fmt: skip
    ctx = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
    if version is not None:
        ctx.minimum_version = ctx.maximum_version = version
    if ciphers is not None:
        ctx.set_ciphers(ciphers)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx


async def _handshake(port: int, ctx: ssl.SSLContext) -> tuple[str | None, str | None, str | None]:
    """(protocol version, cipher, ALPN) of a handshake with the listener, or raise."""
    _, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost"), 5
    )
    try:
        tls = writer.get_extra_info("ssl_object")
        cipher = tls.cipher()
        return tls.version(), cipher[0] if cipher else None, tls.selected_alpn_protocol()
    finally:
        writer.close()


@pytest.mark.parametrize("cipher", ["ECDHE-ECDSA-AES128-SHA256", "ECDHE-ECDSA-AES256-SHA384"])
async def test_tls12_cbc_suites_are_refused(tls: TlsMaterial, dev_certs: DevCertificates,
                                            cipher: str) -> None:  # fmt: skip
    listener = TcpListener(RecordingApp(), host="127.0.0.1", port=0, tls=tls)
    await listener.start()
    try:
        ctx = _client(dev_certs, version=ssl.TLSVersion.TLSv1_2, ciphers=cipher)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await _handshake(listener.port, ctx)
    finally:
        await listener.stop()


async def test_tls12_aead_and_tls13_are_served_with_alpn(
    tls: TlsMaterial, dev_certs: DevCertificates
) -> None:
    listener = TcpListener(RecordingApp(), host="127.0.0.1", port=0, tls=tls)
    await listener.start()
    try:
        for cipher in ("ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-ECDSA-CHACHA20-POLY1305"):
            ctx = _client(dev_certs, version=ssl.TLSVersion.TLSv1_2, ciphers=cipher)
            assert await _handshake(listener.port, ctx) == ("TLSv1.2", cipher, "h2")
        version, _, alpn = await _handshake(listener.port, _client(dev_certs))
        assert (version, alpn) == ("TLSv1.3", "h2")
    finally:
        await listener.stop()
    ctx = tls.ssl_context()
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.options & ssl.OP_NO_COMPRESSION
    for suite in ctx.get_ciphers():
        assert suite["aead"], suite["name"]
