"""A request the stop cuts short: the HTTP/3 listener's drain runs out and cancels the requests
still in flight. The request's span ends (status ERROR), as its upstream CLIENT span does,
rather than being left open and never exported, its children orphaned in the trace."""

from __future__ import annotations

import asyncio
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

from edge.wiring import build
from tests.edge.conftest import TinyUpstream, fast_config, held_sse
from tests.helpers import wait_until
from tests.transport.h3client import h3_connect
from transport.h3_server import H3Server
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial


async def test_a_request_the_stop_cancels_ends_its_span(dev_certs: Any) -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    release = asyncio.Event()
    async with TinyUpstream(held_sse(release)) as up:
        wiring = await build(
            fast_config([up.url]), registry=CollectorRegistry(), tracer=provider.get_tracer("t")
        )
        await wiring.start()
        tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))
        server = H3Server(wiring.app, tls=tls, tickets=MemoryTicketStore())
        await server.start("127.0.0.1", 0)
        try:
            async with h3_connect(server.port, dev_certs.ca_cert) as client:
                fetch = asyncio.create_task(
                    client.fetch(
                        "POST",
                        "/v1/completions",
                        body=b'{"prompt": "x", "stream": true}',
                        headers=[(b"content-type", b"application/json")],
                    )  # fmt: skip
                )
                await wait_until(lambda: any(r.path == "/v1/completions" for r in up.requests))
                await server.drain(0.05)  # the request is still held: cancelled
                await wait_until(
                    lambda: any(s.kind.name == "CLIENT" for s in spans.get_finished_spans())
                )
                fetch.cancel()
                await asyncio.gather(fetch, return_exceptions=True)
        finally:
            release.set()
            await server.aclose()
            await wiring.aclose()
    finished = spans.get_finished_spans()
    roots = [s for s in finished if s.name == "quicedge.request"]
    assert len(roots) == 1
    (root,) = roots
    assert root.status.status_code is StatusCode.ERROR
    assert root.status.description == "request cancelled (the edge stopping)"
    (upstream,) = [s for s in finished if s.kind.name == "CLIENT"]
    assert upstream.parent is not None and upstream.parent.span_id == root.context.span_id
