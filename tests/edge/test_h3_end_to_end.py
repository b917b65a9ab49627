"""The whole path over HTTP/3: an aioquic client resumes with a ticket and sends in 0-RTT; the
edge forwards that request upstream with `Early-Data: 1` (RFC 8470) and the first one without."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from bench.clients.base import ClientOptions, Target
from bench.clients.h3 import H3Client
from edge.wiring import build
from tests.edge.conftest import Recorded, TinyUpstream, fast_config, health_ok, sse_reply
from transport.h3_server import H3Server
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial


async def test_zero_rtt_request_reaches_the_backend_marked_early_data(dev_certs: Any) -> None:
    def answer(recorded: Recorded) -> Any:
        return health_ok(recorded) or sse_reply(["hello", " there"])

    async with TinyUpstream(answer) as up:
        registry = CollectorRegistry()
        wiring = await build(fast_config([up.url]), registry=registry)
        await wiring.start()
        tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))
        server = H3Server(wiring.app, tls=tls, tickets=MemoryTicketStore())
        await server.start("127.0.0.1", 0)
        client = H3Client(ClientOptions(cacert=str(dev_certs.ca_cert), zero_rtt=True, timeout=10))
        try:
            target = Target.parse(f"https://localhost:{server.port}/v1/completions")
            results = []
            for _ in range(2):
                results.append(
                    await client.request(
                        target,
                        method="POST",
                        headers=[("content-type", "application/json")],
                        body=b'{"prompt": "hi", "stream": true}',
                    )
                )
        finally:
            await client.aclose()
            await server.aclose()
            await wiring.aclose()
    first, second = results
    assert (first.error, second.error) == (None, None)
    assert first.status == second.status == 200
    assert not first.early_data and second.early_data and second.early_data_accepted
    assert first.header("x-quicedge-backend") == second.header("x-quicedge-backend")
    forwarded = [r for r in up.requests if r.path == "/v1/completions"]
    assert [r.headers.get("early-data") for r in forwarded] == [None, "1"]
    assert [r.headers["x-request-id"] for r in forwarded] == [
        first.header("x-request-id"),
        second.header("x-request-id"),
    ]
    labels = {"transport": "h3", "cache": "unknown", "backend": f"127.0.0.1:{up.port}"}
    for early, count in (("1rtt", 1.0), ("0rtt", 1.0)):
        value = registry.get_sample_value(
            "quicedge_ttft_seconds_count", {**labels, "early_data": early}
        )
        assert value == count
