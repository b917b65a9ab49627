"""A backend's 4xx refusal of a `/v1/responses` request comes back as OpenAI's error object about
the Responses fields the client sent (`max_output_tokens`, not the `max_tokens` of the chat
request the edge made), whole or streamed, and a background response's failure says the same;
on the chat route it is passed on unchanged. The official OpenAI SDK and httpx against the
stand-in."""

from __future__ import annotations

import json

import openai
import pytest

from backends.sim import SimServer
from edge.state.responses import refusal
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.edge.state.helpers import CHAT, as_tenant, sdk_of, state, tenants
from tests.edge.state.test_background import settled
from tests.edge.test_app_sim import sim_config


async def test_a_backend_refusal_names_the_responses_field() -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=state(), admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk = sdk_of(edge)
            async with sdk:
                for stream in (False, True):
                    with pytest.raises(openai.BadRequestError) as refused:
                        await sdk.responses.create(model="default", input="hi",
                                                   max_output_tokens=-5, stream=stream)  # fmt: skip
                    err = refused.value
                    assert err.param == "max_output_tokens" and err.code == "invalid_value"
                    assert err.type == "invalid_request_error"
                    assert err.body["message"] == "'max_output_tokens' must be at least 0"  # type: ignore[index]
                    assert err.response.headers["content-type"] == "application/json"
                    assert int(err.response.headers["content-length"]) == len(err.response.content)

                # a background one reads failed, with the same words
                queued = await sdk.responses.create(
                    model="default", input="hi", max_output_tokens=-5, background=True
                )
                failed = await settled(sdk, queued.id)
                assert failed.status == "failed" and failed.error is not None
                assert "'max_output_tokens' must be at least 0" in failed.error.message

            me = as_tenant("alpha")
            hot = await http.post("/v1/responses", headers=me,
                                  json={"input": "hi", "temperature": "hot"})  # fmt: skip
            assert hot.status_code == 400
            assert hot.json() == {"error": {
                "message": "'temperature' must be a number", "type": "invalid_request_error",
                "param": "temperature", "code": "invalid_value"}}  # fmt: skip

            # the chat route relays the backend's own answer, as docs/errors.md says
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}
            relayed = await http.post(CHAT, headers=me, json=chat)
            assert relayed.status_code == 400
            assert relayed.json()["object"] == "error"
            assert relayed.json()["message"] == "'max_tokens' must be at least 0"


@pytest.mark.parametrize(
    ("body", "message", "param", "code"),
    [
        (
            b'{"object": "error", "message": "\'max_tokens\' must be at least 0", "param": null, '
            b'"code": 400}',
            "'max_output_tokens' must be at least 0",
            "max_output_tokens",
            "invalid_value",
        ),  # fmt: skip
        (
            b'{"error": {"message": "bad response_format schema", "param": "response_format", '
            b'"code": "bad_schema"}}',
            "bad text.format schema",
            "text.format",
            "bad_schema",
        ),
        (
            b'{"detail": [{"loc": ["body", "reasoning_effort"], "msg": "Input should be low"}]}',
            "reasoning.effort: Input should be low",
            "reasoning.effort",
            "invalid_value",
        ),
        (
            b'{"object": "error", "message": "messages[3].role must be user", "code": 400}',
            "messages[3].role must be user",
            "input",
            "invalid_value",
        ),  # no place in `input`
        (
            b'{"object": "error", "message": "the user sent too many messages", "code": 400}',
            "the user sent too many messages",
            None,
            "invalid_request",
        ),  # prose, not fields
        (b"upstream said no", "upstream said no", None, "invalid_request"),
        (b"", "the backend refused the request (400)", None, "invalid_request"),
        (b"[1, 2]", "the backend refused the request (400)", None, "invalid_request"),
    ],
)
def test_refusals_of_every_shape_read_as_openais_error(
    body: bytes, message: str, param: str | None, code: str
) -> None:
    assert refusal(400, body) == {"error": {"message": message, "type": "invalid_request_error",
                                            "param": param, "code": code}}  # fmt: skip
    json.dumps(refusal(400, body * 100_000))  # a huge body is read only in part


async def test_a_backend_failure_reads_as_openais_server_error() -> None:
    """A backend's 500 (SGLang's error object, about the chat request the edge made) reaches a
    `/v1/responses` client as OpenAI's `server_error`, whole or streamed; the chat route relays
    it as it came."""
    failure = {"object": "error", "message": "CUDA out of memory", "type": "InternalServerError",
               "param": None, "code": 500}  # fmt: skip

    async def failing(recorded: Recorded) -> Reply:
        return health_ok(recorded) or Reply(
            status=500, chunks=[json.dumps(failure).encode()], chunked=False,
            headers=[("content-type", "application/json")],
        )  # fmt: skip

    async with TinyUpstream(failing) as upstream:
        config = fast_config([upstream.url], state=state(), admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            me = as_tenant("alpha")
            for stream in (False, True):
                answer = await http.post("/v1/responses", headers=me,
                                         json={"input": "hi", "stream": stream})  # fmt: skip
                assert answer.status_code == 500
                assert answer.json() == {"error": {"message": "CUDA out of memory",
                    "type": "server_error", "param": None, "code": "backend_error"}}  # fmt: skip
                assert int(answer.headers["content-length"]) == len(answer.content)
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            relayed = await http.post(CHAT, headers=me, json=chat)
            assert relayed.status_code == 500 and relayed.json() == failure


def test_a_failure_without_words_says_the_backend_failed() -> None:
    assert refusal(503, b"") == {"error": {"message": "the backend failed (503)",
        "type": "server_error", "param": None, "code": "backend_error"}}  # fmt: skip
