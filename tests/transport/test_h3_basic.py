"""HTTP/3 listener basics over real sockets: scope, body, streaming, limits, malformed requests."""

from __future__ import annotations

import json

from tests.transport.apps import RecordingApp
from tests.transport.conftest import H3Factory
from tests.transport.h3client import h3_connect


async def test_request_scope_and_body(h3_server: H3Factory, dev_certs) -> None:
    app = RecordingApp()
    async with h3_server(app=app) as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        r = await c.fetch("POST", "/echo?x=1", body=b"hello" * 1000)
    assert r.status == 200
    data = json.loads(r.body)
    assert data == {
        "path": "/echo",
        "early_data": False,
        "transport": "h3",
        "handshake_wait_s": 0.0,
        "body_bytes": 5000,
        "http_version": "3",
    }
    assert (b"host", b"localhost") in app.seen[0].headers
