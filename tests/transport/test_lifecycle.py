"""Retry, TLS reload without dropping connections, and draining, over real sockets."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from pathlib import Path

import httpx
import pytest
from aioquic.h3.connection import ErrorCode

from certs import DevCertificates, ensure_dev_certificates
from tests.transport.apps import RecordingApp
from tests.transport.conftest import H3Factory
from tests.transport.h3client import h3_connect
from transport.aioquic_private import retry_count
from transport.h3_server import H3Server
from transport.tcp import TcpListener
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsError, TlsMaterial


async def test_retry_round_trip_then_served(h3_server: H3Factory, dev_certs) -> None:
    async with h3_server(retry_secret=b"a shared retry secret") as server:
        async with h3_connect(server.port, dev_certs.ca_cert) as c:
            r = await c.fetch("GET", "/echo")
            assert r.status == 200
            # The client had to echo a Retry token (RFC 9000 §8.1.2).
            assert retry_count(c.quic) == 1


def _copy_pki(src: DevCertificates, dst: Path) -> CertificateFiles:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src.cert, dst / "cert.pem")
    shutil.copy(src.key, dst / "key.pem")
    return CertificateFiles(dst / "cert.pem", dst / "key.pem")


async def test_tls_reload_keeps_connections_and_serves_the_new_cert(tmp_path: Path) -> None:
    old = ensure_dev_certificates(tmp_path / "old")
    new = ensure_dev_certificates(tmp_path / "new")
    files = _copy_pki(old, tmp_path / "live")
    tls = TlsMaterial(files)
    app = RecordingApp()
    server = H3Server(app, tls=tls, tickets=MemoryTicketStore())
    await server.start("127.0.0.1", 0)
    tcp = TcpListener(app, host="127.0.0.1", port=0, tls=tls, alt_svc_port=server.port)
    await tcp.start()
    try:
        async with h3_connect(server.port, old.ca_cert) as before:
            assert (await before.fetch("GET", "/echo")).status == 200
            _copy_pki(new, tmp_path / "live")
            assert tls.reload()
            # The connection made before the reload still works...
            assert (await before.fetch("GET", "/echo")).status == 200
            # ...and new handshakes present the new certificate, over QUIC and TCP.
            async with h3_connect(server.port, new.ca_cert) as after:
                assert (await after.fetch("GET", "/echo")).status == 200
            ctx = ssl.create_default_context(cafile=str(new.ca_cert))
            async with httpx.AsyncClient(verify=ctx) as client:
                r = await client.get(f"https://localhost:{tcp.port}/echo")
                assert r.status_code == 200
            # A broken file is refused and the current certificate stays.
            (tmp_path / "live" / "key.pem").write_text("garbage")
            assert not tls.reload()
            async with h3_connect(server.port, new.ca_cert) as again:
                assert (await again.fetch("GET", "/echo")).status == 200
    finally:
        await tcp.stop()
        await server.aclose()


def test_tls_material_refuses_mismatched_files(tmp_path: Path) -> None:
    a = ensure_dev_certificates(tmp_path / "a")
    b = ensure_dev_certificates(tmp_path / "b")
    with pytest.raises(TlsError, match="does not match"):
        TlsMaterial(CertificateFiles(a.cert, b.key))
    (tmp_path / "junk.pem").write_text("junk")
    with pytest.raises(TlsError, match="not PEM"):
        TlsMaterial(CertificateFiles(tmp_path / "junk.pem", a.key))


async def test_drain_finishes_open_requests_and_refuses_new_ones(
    h3_server: H3Factory, dev_certs
) -> None:
    app = RecordingApp()
    async with h3_server(app=app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        sid = c.request("GET", "/stream?n=2")
        c.send_now()
        await app.release.put(None)
        await asyncio.wait_for(c.responses[sid].arrivals.get(), 10)
        drain = asyncio.create_task(server.drain(timeout=10))
        await asyncio.sleep(0)  # the drain task's first step, which sends the GOAWAYs, runs first
        late = await c.fetch("GET", "/echo")  # a request after GOAWAY's stream id
        assert late.reset_code == ErrorCode.H3_REQUEST_REJECTED
        assert not drain.done()  # still waiting for the open stream
        await app.release.put(None)
        r = await c.wait(sid)
        await asyncio.wait_for(drain, 10)
    assert r.body == b"0;1;" and r.reset_code is None
    assert [s.path for s in app.seen] == ["/stream"]


async def test_drain_timeout_cancels_what_is_left(h3_server: H3Factory, dev_certs) -> None:
    app = RecordingApp()
    async with h3_server(app=app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        sid = c.request("GET", "/hold")
        c.send_now()
        await asyncio.wait_for(c.responses[sid].first_data.wait(), 10)
        await asyncio.wait_for(server.drain(timeout=0.2), 10)
        r = await c.wait(sid)
    assert r.reset_code == ErrorCode.H3_REQUEST_CANCELLED
