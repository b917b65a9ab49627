"""TCP listeners over real sockets: HTTP/2 and HTTP/1.1 over TLS with Alt-Svc, plain HTTP."""

from __future__ import annotations

import json
import ssl

import httpx
import pytest

from tests.transport.apps import RecordingApp
from transport.tcp import TcpListener, alt_svc_value
from transport.tls import TlsMaterial


@pytest.mark.parametrize(("http2", "name"), [(True, "h2"), (False, "h1")])
async def test_tls_listener_serves_h2_and_h1_with_alt_svc(
    tls: TlsMaterial, dev_certs, http2: bool, name: str
) -> None:
    app = RecordingApp()
    listener = TcpListener(app, host="127.0.0.1", port=0, tls=tls, alt_svc_port=4433)
    await listener.start()
    try:
        ctx = ssl.create_default_context(cafile=str(dev_certs.ca_cert))
        async with httpx.AsyncClient(http2=http2, http1=not http2, verify=ctx) as client:
            r = await client.post(f"https://localhost:{listener.port}/echo", content=b"abc")
            r2 = await client.get(f"https://localhost:{listener.port}/missing-is-fine")
    finally:
        await listener.stop()
    assert r.status_code == 200
    assert r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    assert r.headers["alt-svc"] == 'h3=":4433"; ma=86400'
    assert r2.headers["alt-svc"] == alt_svc_value(4433)
    view = json.loads(r.content)
    assert view["transport"] == name
    assert view["early_data"] is False
    assert view["body_bytes"] == 3


async def test_plain_http_listener(tls: TlsMaterial) -> None:
    app = RecordingApp()
    listener = TcpListener(app, host="127.0.0.1", port=0, alt_svc_port=None)
    await listener.start()
    try:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://127.0.0.1:{listener.port}/echo")
    finally:
        await listener.stop()
    assert r.status_code == 200
    assert "alt-svc" not in r.headers
    assert json.loads(r.content)["transport"] == "h1"


async def test_listener_never_started_releases_its_port() -> None:
    listener = TcpListener(RecordingApp(), host="127.0.0.1", port=0)
    port = listener.port
    await listener.stop()
    again = TcpListener(RecordingApp(), host="127.0.0.1", port=port)
    await again.stop()
