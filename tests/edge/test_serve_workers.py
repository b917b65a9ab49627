"""`quicedge serve --workers 2` in front of a stand-in: each spawned worker builds the proxy from
the settings the parent read (environment included) and serves it."""

from __future__ import annotations

import ssl

import httpx

from certs import ensure_dev_certificates
from tests.edge.test_many_streams import stand_in  # noqa: F401  (the fixture)
from tests.transport.conftest import ServeProcess

BODY = {"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


async def test_spawned_workers_serve_the_proxy(
    stand_in: str,  # noqa: F811
    redis_url: str,
    monkeypatch,
) -> None:
    monkeypatch.setenv("QUICEDGE_BACKEND", stand_in)  # read by the parent, sent to the workers
    serve = ServeProcess("--workers", "2", "--redis", redis_url)
    try:
        assert any(line.startswith("quicedge serve: workers 2") for line in serve.lines)
        assert f"quicedge serve: app    proxy, routing ttft, backends {stand_in}" in serve.lines
        ctx = ssl.create_default_context(cafile=str(ensure_dev_certificates().ca_cert))
        async with httpx.AsyncClient(verify=ctx, timeout=30) as client:
            for _ in range(4):
                r = await client.post(
                    f"https://localhost:{serve.tcp_port}/v1/chat/completions", json=BODY
                )
                assert r.status_code == 200, r.text
                assert r.json()["object"] == "chat.completion"
    finally:
        assert serve.stop() == 0, serve.errors()
