"""`--tls-keylog FILE`: both stacks append every connection's TLS secrets in the key log format
Wireshark reads; checked against the secrets the client itself logged for the same connection,
over real sockets (an aioquic client over HTTP/3, httpx over HTTP/2 on TLS)."""

from __future__ import annotations

import asyncio
import io
import ssl
import stat
from pathlib import Path
from typing import Any

import httpx
from aioquic.asyncio.client import connect

from certs import DevCertificates, ensure_dev_certificates
from tests.transport.apps import RecordingApp
from tests.transport.h3client import H3Client, client_config
from transport.h3_server import H3Server
from transport.tcp import TcpListener
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial


def _lines(text: str) -> set[str]:
    return {line for line in text.splitlines() if line and not line.startswith("#")}


def _labels(lines: set[str]) -> set[str]:
    return {line.split()[0] for line in lines}


async def test_http3_secrets_are_the_ones_the_client_used(
    dev_certs: DevCertificates, tmp_path: Path
) -> None:
    keylog = tmp_path / "keys.log"
    tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key), keylog=keylog)
    server = H3Server(RecordingApp(), tls=tls, tickets=MemoryTicketStore())
    await server.start("127.0.0.1", 0)
    client_log = io.StringIO()
    try:
        config = client_config(dev_certs.ca_cert)
        config.secrets_log_file = client_log
        async with connect(
            "127.0.0.1", server.port, configuration=config, create_protocol=H3Client
        ) as client:
            assert isinstance(client, H3Client)
            assert (await client.fetch("GET", "/echo")).status == 200
    finally:
        await server.aclose()
    theirs, ours = _lines(client_log.getvalue()), _lines(keylog.read_text())
    assert {"SERVER_TRAFFIC_SECRET_0", "CLIENT_TRAFFIC_SECRET_0"} <= _labels(theirs)
    assert theirs <= ours  # the same connection's secrets, as the client saw them
    assert stat.S_IMODE(keylog.stat().st_mode) == 0o600


async def test_tls_over_tcp_secrets_are_the_ones_the_client_used(
    dev_certs: DevCertificates, tmp_path: Path
) -> None:
    keylog, client_keylog = tmp_path / "keys.log", tmp_path / "client.log"
    tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key), keylog=keylog)
    listener = TcpListener(RecordingApp(), host="127.0.0.1", port=0, tls=tls, alt_svc_port=None)
    await listener.start()
    try:
        ctx = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
        ctx.keylog_filename = str(client_keylog)
        async with httpx.AsyncClient(http2=True, verify=ctx) as client:
            response = await client.get(f"https://localhost:{listener.port}/echo")
            assert response.status_code == 200 and response.http_version == "HTTP/2"
    finally:
        await listener.stop()
    theirs, ours = _lines(client_keylog.read_text()), _lines(keylog.read_text())
    assert {"SERVER_TRAFFIC_SECRET_0", "CLIENT_TRAFFIC_SECRET_0"} <= _labels(theirs)
    assert theirs <= ours


async def test_serve_warns_that_the_key_log_is_on(serve_process: Any, tmp_path: Path) -> None:
    keylog = tmp_path / "keys.log"
    server = await asyncio.to_thread(serve_process, "--demo", "--tls-keylog", str(keylog))
    assert any("TLS keylog" in line and "decrypt" in line for line in server.lines)
    ctx = ssl.create_default_context(cafile=str(ensure_dev_certificates().ca_cert))
    async with httpx.AsyncClient(http2=True, verify=ctx) as client:
        response = await client.get(f"https://localhost:{server.tcp_port}/x")
        assert response.status_code == 200
    assert "CLIENT_TRAFFIC_SECRET_0" in keylog.read_text()
