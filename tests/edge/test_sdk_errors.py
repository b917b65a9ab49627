"""The official OpenAI SDK, retries on (its default, two), against the edge's errors: the
exception class each raises, and which of them the SDK tries again (it retries every 5xx
unless `x-should-retry: false` says a retry cannot change the answer)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, health_ok, run_edge
from tests.edge.tls_edge import with_client_keys

MiB = 1024 * 1024


async def test_an_answer_too_large_to_hold_is_not_tried_again_by_the_sdk() -> None:
    """A non-streamed answer over the 64 MiB the edge holds (a large embeddings batch, which
    is the same each time) is a 502 that a retry only computes again: the SDK asks once."""
    piece = b" " * MiB

    def script(recorded: Recorded) -> Reply:
        return health_ok(recorded) or Reply(
            headers=[("content-type", "application/json")], chunks=[piece] * 65
        )

    async with TinyUpstream(script) as up:
        config = with_client_keys(fast_config([up.url]), "sk-client")
        async with run_edge(config) as edge:
            seen: list[httpx.Response] = []

            async def on_response(response: httpx.Response) -> None:
                seen.append(response)

            http = httpx.AsyncClient(event_hooks={"response": [on_response]})
            sdk = AsyncOpenAI(
                base_url=edge.url + "/v1", api_key="sk-client", max_retries=2, http_client=http
            )
            inputs: Any = ["a"] * 4
            async with http:
                with pytest.raises(openai.InternalServerError) as failed:
                    await sdk.embeddings.create(model="tiny-model", input=inputs)
            embeddings = [r for r in up.requests if r.path == "/v1/embeddings"]
    assert failed.value.status_code == 502 and failed.value.code == "bad_gateway"
    assert "64" in failed.value.message or "holds no larger" in failed.value.message
    assert [r.status_code for r in seen] == [502]
    assert seen[0].headers["x-should-retry"] == "false"
    assert len(embeddings) == 1


async def test_the_responses_routes_the_edge_does_not_serve_are_not_found() -> None:
    """OpenAI's `POST /v1/responses/input_tokens` and `/v1/responses/compact` (SDK methods of
    their own) are routes the edge does not serve: 404 `not_found`, which the SDK raises as
    `NotFoundError`, not a 405 saying the path takes GET and DELETE (as if a response of
    that id were there)."""
    from backends.sim import SimServer
    from tests.edge.state.helpers import sdk_of, state, tenants
    from tests.edge.test_app_sim import sim_config

    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=state(None), admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                with pytest.raises(openai.NotFoundError) as counted:
                    await sdk.responses.input_tokens.count(model="default", input="hi")
                with pytest.raises(openai.NotFoundError) as compacted:
                    await sdk.responses.compact(model="default", input="hi")
                with pytest.raises(openai.NotFoundError) as read:  # a response's id still is
                    await sdk.responses.retrieve("resp_0123")
    assert counted.value.code == compacted.value.code == "not_found"
    assert read.value.code == "response_not_found"


async def test_a_key_the_edge_does_not_know_is_refused_on_the_model_list() -> None:
    """`client.models.list()` is how SDK users and the tools built on it check a key: an
    unknown key is a 401 (`AuthenticationError`) there as on every other route, not a list
    that says the key works until the first chat."""
    from backends.sim import SimServer
    from tests.edge.state.helpers import tenants
    from tests.edge.test_app_sim import sim_config

    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge, httpx.AsyncClient(base_url=edge.url) as http:
            known = AsyncOpenAI(base_url=edge.url + "/v1", api_key="sk-alpha", max_retries=0)
            unknown = known.with_options(api_key="sk-nobody")
            assert [m.id async for m in known.models.list()] == ["quicedge/sim-instant"]
            with pytest.raises(openai.AuthenticationError) as listed:
                await unknown.models.list()
            with pytest.raises(openai.AuthenticationError) as read:
                await unknown.models.retrieve("default")
            head = await http.head("/v1/models", headers={"authorization": "Bearer sk-nobody"})
            anonymous = await http.get("/v1/models")  # no key: the anonymous tenant's
            await known.close()
    assert listed.value.code == read.value.code == "invalid_api_key"
    assert listed.value.response.headers["www-authenticate"] == "Bearer"
    assert head.status_code == 401 and anonymous.status_code == 200


async def test_a_policy_refusal_is_the_sdks_permission_denied_error() -> None:
    """A prompt a policy rule refuses: `PermissionDeniedError` (403 `policy_violation`) with
    the request's id, on chat and on the Responses API, and not retried; a refused stream is,
    by default, a well-formed one that ends with `content_filter`."""
    from backends.sim import SimServer
    from edge.policy.config import PolicyConfig
    from tests.edge.state.helpers import state, tenants
    from tests.edge.test_app_sim import sim_config

    policy = PolicyConfig.from_mapping(
        {"rules": [{"id": "no-secrets", "action": "deny", "patterns": ["password"]}]}
    )
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=state(None), admission=tenants("alpha"))
        async with run_edge(config, policies=policy) as edge:
            seen: list[int] = []

            async def on_response(response: httpx.Response) -> None:
                seen.append(response.status_code)

            http = httpx.AsyncClient(event_hooks={"response": [on_response]})
            sdk = AsyncOpenAI(
                base_url=edge.url + "/v1", api_key="sk-alpha", max_retries=2, http_client=http
            )
            messages: Any = [{"role": "user", "content": "my password is hunter2"}]
            async with http:
                with pytest.raises(openai.PermissionDeniedError) as chat:
                    await sdk.chat.completions.create(model="default", messages=messages)
                with pytest.raises(openai.PermissionDeniedError) as response:
                    await sdk.responses.create(model="default", input=messages)
                stream = await sdk.chat.completions.create(
                    model="default", messages=messages, stream=True
                )
                parts = [c async for c in stream]
    for refused in (chat.value, response.value):
        assert refused.code == "policy_violation" and refused.request_id
    assert [p.choices[0].finish_reason for p in parts] == ["content_filter"]
    assert seen == [403, 403, 200]
