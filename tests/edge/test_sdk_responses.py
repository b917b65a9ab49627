"""The Responses API (`/v1/responses`, the edge's translation over a chat backend) as the
official OpenAI SDK reads it."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from backends.sim import SimServer
from edge.state.responses import parse_request
from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, health_ok, run_edge
from tests.edge.state.helpers import sdk_of, state, tenants
from tests.edge.test_app_sim import sim_config


@pytest.mark.parametrize(
    "body",
    [b"<html>upstream says hi</html>", b'{"object": "chat.completion", "choices": []}'],
    ids=["not-json", "no-choice"],
)
async def test_a_backend_answer_that_is_no_chat_completion_is_a_failed_response(
    body: bytes,
) -> None:
    """A backend's 200 that is no chat completion is not handed on as the answer of a
    `/v1/responses` request (a body the SDK cannot read as a response, or a JSON error it
    raises outside its own family): the client gets a `failed` response, and the turn is
    not kept, so `previous_response_id` cannot name it."""

    def script(recorded: Recorded) -> Reply:
        return health_ok(recorded) or Reply(
            headers=[("content-type", "application/json")], chunks=[body], chunked=False
        )

    async with TinyUpstream(script) as up:
        config = fast_config([up.url], state=state(None), admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                answer = await sdk.responses.create(model="tiny-model", input="hi")
                assert answer.status == "failed"
                assert answer.error is not None and answer.error.code == "server_error"
                assert answer.output == [] and answer.id.startswith("resp_")
                assert answer._request_id
                with pytest.raises(openai.NotFoundError):
                    await sdk.responses.create(
                        model="tiny-model", input="again", previous_response_id=answer.id
                    )


async def test_the_thinking_of_a_reasoning_model_is_counted_in_the_usage() -> None:
    """SGLang with `--reasoning-parser` counts the thinking in `usage.reasoning_tokens`: the
    response's `output_tokens_details.reasoning_tokens` says how many of its output tokens
    were thinking, whole and streamed (and read back stored)."""
    async with SimServer(sim_config("b1", reasoning_tokens=4)) as sim:
        config = fast_config([sim.url], state=state(None), admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                whole = await sdk.responses.create(
                    model="default", input="Name a moon.", max_output_tokens=12
                )
                async with sdk.responses.stream(
                    model="default", input="Name a moon.", max_output_tokens=500
                ) as stream:
                    streamed = await stream.get_final_response()
                stored = await sdk.responses.retrieve(whole.id)
    for answer in (whole, streamed, stored):
        assert answer.usage is not None
        assert answer.usage.output_tokens_details.reasoning_tokens == 4


async def test_a_reasoning_models_output_goes_back_as_the_next_input() -> None:
    """The SDK's way of keeping a conversation on the client (`input += response.output`)
    with a reasoning model: the output's `reasoning` item goes back with its message, and the
    thinking is left out of what the model is given, as in a stored conversation."""
    async with SimServer(sim_config("b1", reasoning_tokens=4)) as sim:
        config = fast_config([sim.url], state=state(None), admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                context: list[Any] = [{"role": "user", "content": "Name a moon."}]
                first = await sdk.responses.create(
                    model="default", input=context, store=False, max_output_tokens=12
                )
                assert [o.type for o in first.output] == ["reasoning", "message"]
                context += first.output
                context.append({"role": "user", "content": "And another?"})
                again = await sdk.responses.create(
                    model="default", input=context, store=False, max_output_tokens=12
                )
                assert again.output_text
                sent = parse_request({"input": [o.model_dump() for o in first.output]}).new
                assert sent == [{"role": "assistant", "content": first.output_text}]
                with pytest.raises(openai.BadRequestError) as alone:
                    await sdk.responses.create(model="default", input=first.output[:1])
    assert alone.value.param == "input"
