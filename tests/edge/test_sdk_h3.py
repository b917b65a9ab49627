"""The official OpenAI SDK over HTTP/3: its httpx client on a small transport over the aioquic
test client (`tests.transport.h3client`), against the edge's HTTP/3 listener in front of a
stand-in: chat and the Responses API, streamed and whole, and the edge's errors, each raised as
the SDK's exception for its status, with the request's id."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client import CollectorRegistry

from backends.sim import SimServer
from certs.dev import DevCertificates
from edge.wiring import build
from tests.edge.conftest import fast_config
from tests.edge.state.helpers import state, tenants
from tests.edge.test_app_sim import sim_config
from tests.helpers import wait_until
from tests.transport.h3client import H3Client, Response, h3_connect
from transport.h3_server import H3Server
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial

WAIT = 10.0
_CONNECTION_HEADERS = frozenset({b"host", b"connection", b"keep-alive", b"transfer-encoding"})
"""httpx's HTTP/1.1 headers that HTTP/3 forbids (RFC 9114 §4.2), and `host` (`:authority`)."""


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: Response) -> None:
        self.response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        r = self.response
        async with asyncio.timeout(WAIT):
            while not (r.done.is_set() and r.arrivals.empty()):
                if not r.arrivals.empty():
                    yield r.arrivals.get_nowait()
                    continue
                done = asyncio.ensure_future(r.done.wait())
                data = asyncio.ensure_future(r.arrivals.get())
                finished, _ = await asyncio.wait({done, data}, return_when="FIRST_COMPLETED")
                done.cancel()
                if data in finished:
                    yield data.result()
                else:
                    data.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await data


class H3Transport(httpx.AsyncBaseTransport):
    """httpx requests as HTTP/3 requests on one aioquic connection."""

    def __init__(self, client: H3Client) -> None:
        self.client = client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        headers = [(k.lower(), v) for k, v in request.headers.raw
                   if k.lower() not in _CONNECTION_HEADERS]  # fmt: skip
        stream_id = self.client.request(
            request.method, request.url.raw_path.decode(), body=body, headers=headers
        )
        self.client.transmit()
        r = self.client.responses[stream_id]
        await wait_until(lambda: r.status is not None or r.done.is_set(), WAIT)
        if r.status is None:
            raise httpx.RemoteProtocolError(f"the stream ended without a response ({r.reset_code})")
        return httpx.Response(
            r.status, headers=r.headers, stream=_Body(r), extensions={"http_version": b"HTTP/3"}
        )


@contextlib.asynccontextmanager
async def sdk_over_h3(certs: DevCertificates) -> AsyncIterator[AsyncOpenAI]:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=state(None), admission=tenants("alpha"))
        wiring = await build(config, registry=CollectorRegistry())
        await wiring.start()
        tls = TlsMaterial(CertificateFiles(certs.cert, certs.key))
        server = H3Server(wiring.app, tls=tls, tickets=MemoryTicketStore())
        await server.start("127.0.0.1", 0)
        try:
            async with h3_connect(server.port, certs.ca_cert) as client:
                http = httpx.AsyncClient(transport=H3Transport(client))
                sdk = AsyncOpenAI(
                    base_url=f"https://localhost:{server.port}/v1", api_key="sk-alpha",
                    max_retries=0, http_client=http,
                )  # fmt: skip
                async with sdk:
                    yield sdk
        finally:
            await server.aclose()
            await wiring.aclose()


async def test_the_openai_sdk_over_http3(dev_certs: DevCertificates) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    async with sdk_over_h3(dev_certs) as sdk:
        chat = await sdk.chat.completions.create(model="default", messages=messages, max_tokens=4)
        assert chat.choices[0].message.content and chat._request_id
        stream = await sdk.chat.completions.create(
            model="default", messages=messages, max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        parts = [c async for c in stream]
        assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 4
        assert stream.response.http_version == "HTTP/3"
        answer = await sdk.responses.create(model="default", input="hi", max_output_tokens=4)
        assert answer.output_text and answer._request_id
        async with sdk.responses.stream(
            model="default", input="hi", max_output_tokens=400, previous_response_id=answer.id
        ) as events:
            final = await events.get_final_response()
        assert final.status == "completed" and final.previous_response_id == answer.id
        assert (await sdk.responses.retrieve(final.id)).output_text == final.output_text
        assert [m.id async for m in sdk.models.list()] == ["quicedge/sim-instant"]
        with pytest.raises(openai.NotFoundError) as missing:
            await sdk.models.retrieve("gpt-4o")
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.chat.completions.create(model="default", messages=[])
        with pytest.raises(openai.AuthenticationError) as unknown:
            await sdk.with_options(api_key="sk-nobody").models.list()
    assert missing.value.code == "model_not_found" and missing.value.request_id
    assert bad.value.param == "messages" and bad.value.request_id
    assert unknown.value.code == "invalid_api_key"
