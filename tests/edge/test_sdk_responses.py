"""The Responses API (`/v1/responses`, the edge's translation over a chat backend) as the
official OpenAI SDK reads it."""

from __future__ import annotations

import openai
import pytest

from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, health_ok, run_edge
from tests.edge.state.helpers import sdk_of, state, tenants


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
