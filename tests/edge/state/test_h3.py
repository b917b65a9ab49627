"""Stored conversations and the response cache over HTTP/3 (aioquic client, our H3 listener),
where the relay goes through the stage's `send` instead of the listener's body writer."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry

from backends.sim import SimServer
from edge.config import ProxyConfig
from edge.wiring import build
from tests.edge.conftest import fast_config
from tests.edge.state.helpers import sse_events, state
from tests.edge.test_app_sim import sim_config
from tests.transport.h3client import h3_connect
from transport.h3_server import H3Server
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial

JSON = [(b"content-type", b"application/json")]


@contextlib.asynccontextmanager
async def h3_edge(config: ProxyConfig, certs: Any) -> AsyncIterator[int]:
    """An edge on our H3 listener alone; its UDP port."""
    wiring = await build(config, registry=CollectorRegistry())
    await wiring.start()
    tls = TlsMaterial(CertificateFiles(certs.cert, certs.key))
    server = H3Server(wiring.app, tls=tls, tickets=MemoryTicketStore())
    await server.start("127.0.0.1", 0)
    try:
        yield server.port
    finally:
        await server.aclose()
        await wiring.aclose()


async def test_responses_stream_then_continue_and_a_cache_hit_over_http3(dev_certs: Any) -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=state(cache={"allow_tenants": ["*"]}))
        async with h3_edge(config, dev_certs) as port:
            async with h3_connect(port, dev_certs.ca_cert) as client:
                first = await client.fetch("POST", "/v1/responses", headers=JSON, body=json.dumps(
                    {"input": "Hello over QUIC", "stream": True, "max_output_tokens": 6}
                ).encode())  # fmt: skip
                assert first.status == 200
                events = sse_events(first.body)
                assert events[0][0] == "response.created"
                assert events[-1][0] in ("response.completed", "response.incomplete")
                rid = events[-1][1]["response"]["id"]
                second = await client.fetch("POST", "/v1/responses", headers=JSON, body=json.dumps(
                    {"input": "Go on", "previous_response_id": rid, "max_output_tokens": 4}
                ).encode())  # fmt: skip
                assert second.status == 200
                answer = json.loads(second.body)
                assert answer["previous_response_id"] == rid
                assert answer["usage"]["input_tokens_details"]["cached_tokens"] > 0
                chat = json.dumps(
                    {
                        "messages": [{"role": "user", "content": "same"}],
                        "temperature": 0,
                        "max_tokens": 4,
                        "stream": True,
                    }
                ).encode()
                cached = [(b"x-quicedge-cache", b"use"), *JSON]
                miss = await client.fetch("POST", "/v1/chat/completions", headers=cached, body=chat)
                hit = await client.fetch("POST", "/v1/chat/completions", headers=cached, body=chat)
                assert miss.header(b"x-quicedge-cache") == b"miss"
                assert hit.header(b"x-quicedge-cache") == b"hit-l1"
                assert hit.body == miss.body and hit.body.endswith(b"data: [DONE]\n\n")


async def test_a_background_stream_and_its_resumption_over_http3(dev_certs: Any) -> None:
    async with SimServer(sim_config("b1")) as sim:
        async with h3_edge(fast_config([sim.url], state=state()), dev_certs) as port:
            async with h3_connect(port, dev_certs.ca_cert) as client:
                asked = await client.fetch("POST", "/v1/responses", headers=JSON, body=json.dumps(
                    {"input": "Hello", "stream": True, "background": True, "max_output_tokens": 6}
                ).encode())  # fmt: skip
                assert asked.status == 200
                events = sse_events(asked.body)
                assert events[0][0] == "response.created"
                assert events[0][1]["response"]["status"] == "queued"
                assert events[-1][0] == "response.incomplete"  # cut at max_output_tokens
                rid = events[0][1]["response"]["id"]
                again = await client.fetch(
                    "GET", f"/v1/responses/{rid}?stream=true&starting_after=2"
                )
                assert again.status == 200
                assert sse_events(again.body) == events[3:]
