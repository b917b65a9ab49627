"""HTTP/2 over the TLS listener survives responses sent before the request body was read.

The edge answers 404 (unknown route), 415 (wrong content type) and 413 (declared too large)
without reading the body; the client is still sending it. A real HTTP/2 client (httpx + h2)
keeps one connection for all of it, with a long stream running beside the early errors."""

from __future__ import annotations

import asyncio
import json

import httpx

from backends.sim import SimConfig, SimServer
from certs.dev import DevCertificates
from tests.edge.conftest import fast_config
from tests.edge.tls_edge import tls_edge

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Tell me a long story"}]}
BIG = b" " * 300_000  # more than one flow-control window (64 KiB): the upload outlives the answer


def _chat(**extra: object) -> bytes:
    return json.dumps({**CHAT, **extra}).encode() + BIG


async def test_early_errors_beside_a_long_stream_keep_the_connection(
    dev_certs: DevCertificates,
) -> None:
    paced = SimConfig(name="s", port=0, profile="h100-llama3-8b", time_scale=0.2)
    async with SimServer(paced) as sim, tls_edge(fast_config([sim.url]), dev_certs) as edge:
        async with httpx.AsyncClient(
            http2=True, verify=edge.ssl_context, timeout=30.0, base_url=edge.url
        ) as http:
            json_type = {"content-type": "application/json"}

            async def long_stream() -> list[bytes]:
                body = _chat(stream=True, max_tokens=400, ignore_eos=True)
                async with http.stream(
                    "POST", "/v1/chat/completions", content=body, headers=json_type
                ) as r:
                    assert r.status_code == 200
                    assert r.http_version == "HTTP/2"
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]

            stream = asyncio.ensure_future(long_stream())
            early: list[httpx.Response] = []
            for _ in range(3):
                early.append(await http.post("/v1/embeddingz", content=_chat(), headers=json_type))
                early.append(
                    await http.post(
                        "/v1/chat/completions",
                        content=_chat(),
                        headers={"content-type": "text/plain"},
                    )
                )
                whole = await http.post("/v1/chat/completions", content=_chat(max_tokens=4),
                                        headers=json_type)  # fmt: skip
                assert whole.status_code == 200, whole.text
                assert whole.json()["object"] == "chat.completion"
            events = await stream
    assert [r.status_code for r in early] == [404, 415] * 3
    assert all(r.http_version == "HTTP/2" for r in early)
    assert all(r.json()["error"]["type"] for r in early)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(text) > 0
    # the stream ran to its natural end: every token the request asked for
    finish = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
    assert finish[-1] == "length"
