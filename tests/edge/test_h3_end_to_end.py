"""The whole path over HTTP/3: an aioquic client resumes with a ticket and sends in 0-RTT; the
edge forwards that request upstream with `Early-Data: 1` (RFC 8470) and the first one without."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry

from backends.sim import SimConfig, SimServer
from bench.clients.base import ClientOptions, Target
from bench.clients.h3 import H3Client
from edge.wiring import build
from tests.edge.conftest import Recorded, TinyUpstream, fast_config, health_ok, sse_reply
from tests.helpers import wait_until
from tests.transport.h3client import h3_connect
from transport.h3_server import H3Server
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial


async def test_zero_rtt_request_reaches_the_backend_marked_early_data(dev_certs: Any) -> None:
    def answer(recorded: Recorded) -> Any:
        return health_ok(recorded) or sse_reply(["hello", " there"])

    async with TinyUpstream(answer) as up:
        registry = CollectorRegistry()
        wiring = await build(fast_config([up.url], expose_backend_names=True), registry=registry)
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
    labels = {"transport": "h3", "cache": "unknown", "backend": f"127.0.0.1:{up.port}",
              "model": "default"}  # fmt: skip
    for early, count in (("1rtt", 1.0), ("0rtt", 1.0)):
        value = registry.get_sample_value(
            "quicedge_ttft_seconds_count", {**labels, "early_data": early}
        )
        assert value == count


@contextlib.asynccontextmanager
async def h3_edge(dev_certs: Any, sim: SimServer) -> AsyncIterator[tuple[Any, H3Server]]:
    """The proxy on the HTTP/3 listener in front of one stand-in; yields (wiring, server)."""
    wiring = await build(
        fast_config([sim.url], expose_backend_names=True), registry=CollectorRegistry()
    )
    await wiring.start()
    tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))
    server = H3Server(wiring.app, tls=tls, tickets=MemoryTicketStore())
    await server.start("127.0.0.1", 0)
    try:
        yield wiring, server
    finally:
        await server.aclose()
        await wiring.aclose()


CHAT_STREAM = {
    "model": "default", "stream": True, "max_tokens": 16, "ignore_eos": True,
    "messages": [{"role": "user", "content": "Say hello"}],
}  # fmt: skip
# Tokens ~15 ms apart: a loaded machine's stalls merge a few of them, not most.
PACED = SimConfig(name="s", port=0, profile="h100-llama3-8b", time_scale=2.0)


async def test_a_stream_is_relayed_token_by_token_over_http3(dev_certs: Any) -> None:
    """Paced tokens reach the edge one read at a time and the client as they come (the relay
    writes them through the H3 listener's body writer); the stream ends whole."""
    async with SimServer(PACED) as sim, h3_edge(dev_certs, sim) as (wiring, server):
        async with h3_connect(server.port, dev_certs.ca_cert) as client:
            r = await client.fetch(
                "POST", "/v1/chat/completions", body=json.dumps(CHAT_STREAM).encode(),
                headers=[(b"content-type", b"application/json")],
            )  # fmt: skip
        assert r.status == 200 and r.header(b"x-quicedge-backend") is not None
        events = [e for e in r.body.split(b"\n\n") if e.startswith(b"data: {")]
        texts = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events]
        assert len([t for t in texts if t]) == 16 and r.body.endswith(b"data: [DONE]\n\n")
        assert len(r.chunks) >= 4  # paced: the tokens did not come as one block
        assert wiring.registry.backends[0].in_flight == 0


async def test_a_client_that_resets_its_stream_aborts_the_upstream_request(
    dev_certs: Any,
) -> None:
    slow = SimConfig(name="s", port=0, profile="h100-llama3-8b", time_scale=1.0)
    body = {**CHAT_STREAM, "max_tokens": 5000}
    async with SimServer(slow) as sim, h3_edge(dev_certs, sim) as (wiring, server):
        async with h3_connect(server.port, dev_certs.ca_cert) as client:
            stream_id = client.request(
                "POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                headers=[(b"content-type", b"application/json")],
            )  # fmt: skip
            client.send_now()
            await asyncio.wait_for(client.responses[stream_id].first_data.wait(), 10)
            assert sim.scheduler.num_running == 1
            client.reset(stream_id)
            await wait_until(lambda: sim.scheduler.num_running == 0)
            await wait_until(lambda: wiring.registry.backends[0].in_flight == 0)
        assert sim.scheduler.stats.num_aborted_requests_total >= 1
        assert wiring.metrics.disconnects.labels().value == 1
