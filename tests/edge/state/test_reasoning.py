"""A reasoning model's thinking through `/v1/responses`: SGLang with `--reasoning-parser` streams it
as `reasoning_content` before the answer; the Responses API gives it as a `reasoning` item
(`response.reasoning_text.*` events), read by the official OpenAI SDK, and never stores it in the
conversation (a model is given its earlier answers without their thinking)."""

from __future__ import annotations

import json
from typing import Any

from backends.sim import SimServer
from tests.edge.conftest import Recorded, Reply, TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import ChatUpstream, sdk_of, tenants
from tests.edge.test_app_sim import sim_config

THINKING = ["The user", " wants", " a city."]
ANSWER = ["Par", "is"]


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def thinker(n: int, recorded: Recorded) -> Reply:
    """SGLang's shape: a role chunk, the thinking, the answer, the finish and usage chunks."""
    body = json.loads(recorded.body)
    head = {"id": f"c{n}", "object": "chat.completion.chunk", "created": 1, "model": "r1"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    if not body.get("stream"):
        message = {"role": "assistant", "content": "".join(ANSWER),
                   "reasoning_content": "".join(THINKING)}  # fmt: skip
        usage = {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        whole = {**head, "object": "chat.completion", "usage": usage, "choices": [choice]}
        return Reply(headers=[("content-type", "application/json")],
                     chunks=[json.dumps(whole).encode()], chunked=False)  # fmt: skip
    chunks = [chunk({"role": "assistant", "content": "", "reasoning_content": None})]
    chunks += [chunk({"reasoning_content": t, "content": None}) for t in THINKING]
    chunks += [chunk({"reasoning_content": None, "content": t}) for t in ANSWER]
    chunks.append(chunk({}, "stop"))
    usage = {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    chunks += [sse({**head, "choices": [], "usage": usage}), b"data: [DONE]\n\n"]
    return Reply(headers=[("content-type", "text/event-stream")], chunks=chunks)


async def test_thinking_is_a_reasoning_item_and_stays_out_of_the_conversation() -> None:
    upstream = ChatUpstream(thinker)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge):
            sdk = sdk_of(edge)
            async with sdk:
                deltas: list[str] = []
                async with sdk.responses.stream(
                    model="tiny-model", input="Capital of France?"
                ) as stream:
                    async for event in stream:
                        if event.type == "response.reasoning_text.delta":
                            deltas.append(event.delta)
                    final = await stream.get_final_response()
                assert deltas == THINKING
                reasoning, message = final.output
                assert reasoning.type == "reasoning" and message.type == "message"
                assert reasoning.content is not None
                assert reasoning.content[0].text == "".join(THINKING)
                assert final.output_text == "".join(ANSWER)
                whole = await sdk.responses.create(model="tiny-model", input="Again?", store=False)
                assert [o.type for o in whole.output] == ["reasoning", "message"]
                again = await sdk.responses.create(
                    model="tiny-model", input="And Spain?", previous_response_id=final.id
                )
                assert again.output_text == "".join(ANSWER)
    # The second turn of the conversation carries the first answer, not its thinking.
    stored = upstream.bodies()[2]["messages"]
    assert stored[1] == {"role": "assistant", "content": "".join(ANSWER)}


async def test_a_thinking_stand_in_through_the_edge() -> None:
    """The stand-in as a reasoning model (`reasoning_tokens`): its thinking reaches the SDK as a
    reasoning item beside the answer."""
    async with SimServer(sim_config("b1", reasoning_tokens=4)) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                answer = await sdk.responses.create(
                    model="default", input="Why?", max_output_tokens=10
                )
                reasoning, message = answer.output
                assert reasoning.type == "reasoning" and reasoning.content
                assert reasoning.content[0].text and answer.output_text
                assert answer.usage is not None and answer.usage.output_tokens == 10
                # `reasoning.effort` "none" reaches the backend, which then does not think.
                plain = await sdk.responses.create(
                    model="default", input="Why?", max_output_tokens=10,
                    reasoning={"effort": "none"},
                )  # fmt: skip
                assert [o.type for o in plain.output] == ["message"]
                assert plain.reasoning is not None and plain.reasoning.effort == "none"
                assert plain.usage is not None
                assert plain.usage.output_tokens_details.reasoning_tokens == 0
