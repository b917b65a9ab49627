"""Acceptance: the official OpenAI Python SDK, retries off, over HTTP/2 through the edge's TLS
listener, against stand-ins: chat (streamed and not), completions, embeddings and models, with
a 404 in the middle; every call answers on the same connection, none fails to connect."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from backends.sim import SimConfig, SimServer
from certs.dev import DevCertificates
from tests.edge.conftest import fast_config
from tests.edge.tls_edge import tls_edge, with_client_keys


async def test_the_openai_sdk_over_http2_with_retries_off(dev_certs: DevCertificates) -> None:
    config = SimConfig(name="o", port=0, profile="instant", served_model_name="llama-8b")
    async with (
        SimServer(config) as sim,
        tls_edge(with_client_keys(fast_config([sim.url]), "sk-client"), dev_certs) as edge,
    ):
        opened: list[str] = []

        async def on_request(request: httpx.Request) -> None:
            opened.append(request.url.path)

        http = httpx.AsyncClient(
            http2=True, verify=edge.ssl_context, event_hooks={"request": [on_request]}
        )
        sdk = AsyncOpenAI(
            base_url=edge.url + "/v1", api_key="sk-client", max_retries=0, http_client=http
        )
        async with http:
            chat = await sdk.chat.completions.create(
                model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert chat.choices[0].message.content
            assert chat.usage is not None and chat.usage.completion_tokens == 4
            with pytest.raises(openai.NotFoundError) as missing:
                await sdk.images.generate(prompt="a cat", model="llama-8b")
            assert missing.value.status_code == 404
            stream = await sdk.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "tell me more"}],
                max_tokens=32,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            assert text and parts[-1].usage is not None
            completion = await sdk.completions.create(
                model="llama-8b", prompt="Once upon a time", max_tokens=4
            )
            assert completion.choices[0].text
            embedding = await sdk.embeddings.create(model="llama-8b", input=["a", "b c"])
            assert [len(e.embedding) for e in embedding.data] == [64, 64]
            models = [m.id async for m in sdk.models.list()]
            assert models == ["llama-8b"]
            assert (await sdk.models.retrieve("llama-8b")).id == "llama-8b"
            assert (await sdk.models.retrieve("default")).id == "default"
            with pytest.raises(openai.NotFoundError):
                await sdk.models.retrieve("gpt-4o")
            again = await sdk.chat.completions.create(
                model="llama-8b", messages=[{"role": "user", "content": "still there?"}],
                max_tokens=2,
            )  # fmt: skip
            assert again.choices[0].message.content
            pool = http._transport._pool  # type: ignore[attr-defined]
            connections = list(pool.connections)
    assert len(opened) == 10
    # one HTTP/2 connection carried all of it, the 404s included
    assert len(connections) == 1


async def test_the_sdk_reads_the_rate_limit_headers_and_retries_after_retry_after_ms(
    dev_certs: DevCertificates,
) -> None:
    """A tenant allowed one request at a time, refilled in 0.2 s: the SDK's second call is
    refused once and retried after `retry-after-ms` (under a second), not `retry-after` (1 s)."""
    sim_config = SimConfig(name="o", port=0, profile="instant", served_model_name="llama-8b")
    async with SimServer(sim_config) as sim:
        config = with_client_keys(fast_config([sim.url]), "sk-client")
        config.admission.tenants[0].requests_per_second = 5.0
        config.admission.tenants[0].burst = 1
        async with tls_edge(config, dev_certs) as edge:
            seen: list[httpx.Response] = []

            async def on_response(response: httpx.Response) -> None:
                seen.append(response)

            http = httpx.AsyncClient(
                http2=True, verify=edge.ssl_context, event_hooks={"response": [on_response]}
            )
            sdk = AsyncOpenAI(
                base_url=edge.url + "/v1", api_key="sk-client", max_retries=2, http_client=http
            )
            messages: list[Any] = [{"role": "user", "content": "hi"}]
            async with http:
                raw = await sdk.chat.completions.with_raw_response.create(
                    model="llama-8b", messages=messages, max_tokens=2
                )
                assert raw.headers["x-ratelimit-limit-requests"] == "1"
                assert raw.headers["x-ratelimit-remaining-requests"] == "0"
                assert raw.headers["x-ratelimit-reset-requests"].endswith("ms")  # under 0.2 s
                again = await sdk.chat.completions.create(
                    model="llama-8b", messages=messages, max_tokens=2
                )
                assert again.choices[0].message.content
            assert [r.status_code for r in seen] == [200, 429, 200]
            assert int(seen[1].headers["retry-after-ms"]) <= 200
            assert seen[1].headers["retry-after"] == "1"


async def test_the_sdk_does_not_retry_what_a_retry_cannot_change() -> None:
    """The SDK retries every 5xx unless `x-should-retry: false` says otherwise: a request that
    loops back through the edges (508) or whose tier no backend serves (503 `tier_not_served`)
    fails the same way each time, so it is answered once, not three times."""
    from edge.routing.breakers import BreakerConfig
    from tests.edge.conftest import run_edge

    config = SimConfig(name="o", port=0, profile="instant", served_model_name="llama-8b")
    async with SimServer(config) as sim:
        edge_config = with_client_keys(fast_config([sim.url + "#tiers=gold"]), "sk-client")
        async with run_edge(edge_config, breakers=BreakerConfig()) as edge:
            seen: list[httpx.Response] = []

            async def on_response(response: httpx.Response) -> None:
                seen.append(response)

            http = httpx.AsyncClient(event_hooks={"response": [on_response]})
            sdk = AsyncOpenAI(
                base_url=edge.url + "/v1", api_key="sk-client", max_retries=2, http_client=http
            )
            messages: list[Any] = [{"role": "user", "content": "hi"}]
            via = ", ".join(f"1.1 quicedge-{i}" for i in range(8))
            async with http:
                with pytest.raises(openai.InternalServerError) as looped:
                    await sdk.chat.completions.create(
                        model="llama-8b", messages=messages, extra_headers={"via": via}
                    )
                loop_tries = len(seen)
                with pytest.raises(openai.InternalServerError) as untiered:
                    await sdk.chat.completions.create(model="llama-8b", messages=messages)
    assert looped.value.status_code == 508 and looped.value.code == "loop_detected"
    assert untiered.value.status_code == 503 and untiered.value.code == "tier_not_served"
    assert [r.status_code for r in seen] == [508, 503]
    assert loop_tries == 1
    assert all(r.headers["x-should-retry"] == "false" for r in seen)


async def test_a_stream_the_backend_breaks_off_raises_in_the_sdk() -> None:
    """A backend that dies mid-stream: the SDK yields the deltas that came whole, then raises
    `APIError` with the edge's error event (`bad_gateway`), rather than ending quietly as if
    the answer were complete."""
    import json

    from tests.edge.conftest import Recorded, Reply, TinyUpstream, health_ok, run_edge

    def chunk(delta: dict[str, str]) -> bytes:
        event = {"id": "c", "object": "chat.completion.chunk", "created": 1,
                 "model": "tiny-model", "choices": [{"index": 0, "delta": delta,
                                                     "finish_reason": None}]}  # fmt: skip
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    broken = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"})]
    broken += [chunk({"content": "lo"})[:25], b"never sent"]

    def script(recorded: Recorded) -> Reply:
        return health_ok(recorded) or Reply(
            headers=[("content-type", "text/event-stream")], chunks=broken, die_after=3
        )

    async with TinyUpstream(script) as up:
        config = with_client_keys(fast_config([up.url]), "sk-client")
        async with run_edge(config) as edge:
            sdk = AsyncOpenAI(base_url=edge.url + "/v1", api_key="sk-client", max_retries=0)
            stream = await sdk.chat.completions.create(
                model="tiny-model", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            texts: list[str] = []
            with pytest.raises(openai.APIError) as failed:
                async for part in stream:
                    texts.append(part.choices[0].delta.content or "")
            await sdk.close()
    assert texts == ["", "Hel"]
    assert not isinstance(failed.value, openai.APIStatusError)
    assert failed.value.code == "bad_gateway" and failed.value.type == "server_error"
