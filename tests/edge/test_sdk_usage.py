"""The edge asks every OpenAI stream's backend for its usage chunk and keeps it from a client
that did not ask (`forward.ask_usage`): through the official SDK, over HTTP/1.1 and HTTP/2 on
the TLS listener, each stream has a usage chunk exactly when the client asked for one, after
every choice's chunks, and whole answers have their usage always."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from backends.sim import SimServer
from certs.dev import DevCertificates
from tests.edge.conftest import fast_config
from tests.edge.test_app_sim import sim_config
from tests.edge.tls_edge import tls_edge, with_client_keys

ASKED: list[Any] = [None, {"include_usage": False}, {"include_usage": True}, {}]


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
async def test_the_sdk_gets_a_usage_chunk_exactly_when_it_asks(
    dev_certs: DevCertificates, http2: bool
) -> None:
    async with (
        SimServer(sim_config("b1")) as sim,
        tls_edge(with_client_keys(fast_config([sim.url]), "sk-client"), dev_certs) as edge,
    ):
        http = httpx.AsyncClient(http2=http2, verify=edge.ssl_context)
        sdk = AsyncOpenAI(
            base_url=edge.url + "/v1", api_key="sk-client", max_retries=0, http_client=http
        )
        async with http:
            for options in ASKED:
                wanted = bool(options and options.get("include_usage"))
                extra: dict[str, Any] = {} if options is None else {"stream_options": options}
                for n in (1, 2):
                    chat = await sdk.chat.completions.create(
                        model="default", messages=[{"role": "user", "content": "hi"}],
                        max_tokens=3, n=n, stream=True, **extra,
                    )  # fmt: skip
                    chunks = [c async for c in chat]
                    assert chat.response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
                    text = await sdk.completions.create(
                        model="default", prompt="Once", max_tokens=3, n=n, stream=True, **extra
                    )
                    pieces = [c async for c in text]
                    for parts in (chunks, pieces):
                        usage = [p.usage for p in parts if p.usage is not None]
                        assert [bool(p.choices) for p in parts[:-1]] == [True] * (len(parts) - 1)
                        if wanted:  # one, last, with no choice
                            assert len(usage) == 1 and parts[-1].usage is not None
                            assert not parts[-1].choices
                            assert usage[0].completion_tokens == 3 * n
                        else:
                            assert usage == [] and parts[-1].choices
                    assert {c.choices[0].index for c in chunks if c.choices} == set(range(n))
            whole = await sdk.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert whole.usage is not None and whole.usage.completion_tokens == 3
