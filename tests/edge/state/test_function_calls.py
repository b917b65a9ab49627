"""Function calling through `/v1/responses`: the official OpenAI SDK against the edge and a
stand-in that calls tools as SGLang does with a tool-call parser; the loop's turns kept in the
memory store and real Redis, and read back as items."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import AsyncOpenAI

from backends.sim import SimServer
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.state.helpers import as_tenant, sdk_of, state, tenants
from tests.edge.test_app_sim import sim_config

WEATHER: Any = {
    "type": "function", "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"}},
                   "required": ["city", "days"]},
}  # fmt: skip
ARGUMENTS = {"city": "sim", "days": 1}
"""What the stand-in fills WEATHER's schema with."""


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_function_calling_loop_through_the_sdk(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    stored = state(redis_url if store == "redis" else None, redis_prefix)
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=stored, admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            sdk = sdk_of(edge)
            async with sdk:
                await calling_loop(sdk, http)


async def calling_loop(sdk: AsyncOpenAI, http: Any) -> None:
    asked = await sdk.responses.create(
        model="default", input="What is the weather in Oslo? Use get_weather.", tools=[WEATHER]
    )
    assert asked.status == "completed"
    [call] = asked.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == ARGUMENTS and call.call_id.startswith("call_")
    assert [t.name for t in asked.tools] == ["get_weather"]  # type: ignore[union-attr]

    # The result goes back alone: the call is in the stored conversation already.
    answered = await sdk.responses.create(
        model="default", previous_response_id=asked.id, tools=[WEATHER], max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert [o.type for o in answered.output] == ["message"] and answered.output_text

    # Read back: the response as it was answered, what each turn sent, the whole conversation.
    again = await sdk.responses.retrieve(asked.id)
    assert again.output[0].model_dump() == call.model_dump()
    sent = [i async for i in sdk.responses.input_items.list(answered.id, order="asc")]
    assert [(i.type, getattr(i, "call_id", None)) for i in sent] == [
        ("function_call_output", call.call_id)
    ]
    conv = "conv_" + asked.id[len("resp_") : len("resp_") + 24]
    listed = (await http.get(f"/v1/conversations/{conv}/items?order=asc",
                             headers=as_tenant("alpha"))).json()["data"]  # fmt: skip
    assert [i["type"] for i in listed] == [
        "message", "function_call", "function_call_output", "message"]  # fmt: skip
    assert listed[1]["call_id"] == call.call_id and listed[2]["output"] == "sunny"
    through_sdk = [i async for i in sdk.conversations.items.list(conv, order="asc")]
    assert [i.type for i in through_sdk] == [i["type"] for i in listed]

    # The client may also send the whole loop itself, without a stored conversation.
    whole = await sdk.responses.create(
        model="default", store=False, tools=[WEATHER], max_output_tokens=6,
        input=[
            {"role": "user", "content": "Weather in Oslo? Use get_weather."},
            {"type": "function_call", "call_id": call.call_id, "name": "get_weather",
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
    )  # fmt: skip
    assert [o.type for o in whole.output] == ["message"]


async def test_a_streamed_call_accumulates_in_the_sdk() -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                deltas: list[str] = []
                kinds: list[str] = []
                async with sdk.responses.stream(
                    model="default", input="Weather in Oslo?", tools=[WEATHER],
                    tool_choice={"type": "function", "name": "get_weather"},
                ) as stream:  # fmt: skip
                    async for event in stream:
                        kinds.append(event.type)
                        if event.type == "response.function_call_arguments.delta":
                            deltas.append(event.delta)
                    final = await stream.get_final_response()
                [call] = final.output
                assert call.type == "function_call" and json.loads(call.arguments) == ARGUMENTS
                assert len(deltas) > 1 and "".join(deltas) == call.arguments  # streamed
                assert "response.output_text.delta" not in kinds  # a call only: no message
                done = ["response.function_call_arguments.done", "response.output_item.done"]
                assert kinds[-3:] == [*done, "response.completed"]


async def test_tool_choice_none_answers_in_text_and_hosted_tools_are_refused() -> None:
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                text = await sdk.responses.create(
                    model="default", input="Use get_weather for Oslo.", tools=[WEATHER],
                    tool_choice="none", max_output_tokens=4,
                )  # fmt: skip
                assert [o.type for o in text.output] == ["message"]
                try:
                    await sdk.responses.create(
                        model="default", input="x", tools=[{"type": "web_search"}]
                    )
                except Exception as exc:  # the SDK's BadRequestError
                    assert getattr(exc, "status_code", None) == 400
                    assert getattr(exc, "body", {})["param"] == "tools[0].type"
                else:
                    raise AssertionError("a hosted tool was accepted")


CHAT_WEATHER = {"type": "function", "function": {
    "name": WEATHER["name"], "parameters": WEATHER["parameters"]}}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_chat_conversation_keeps_the_models_tool_calls(stream: bool) -> None:
    """`x-quicedge-conversation` with tools: the call is stored with the turn, so the next
    turn sends only the tool's result and the backend sees the call before it."""
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            headers = {**as_tenant("alpha"), "x-quicedge-conversation": "new"}
            body = {"messages": [{"role": "user", "content": "Weather? Use get_weather."}],
                    "tools": [CHAT_WEATHER], "stream": stream}  # fmt: skip
            asked = await http.post("/v1/chat/completions", headers=headers, json=body)
            assert asked.status_code == 200, asked.text
            conv = asked.headers["x-quicedge-conversation"]
            if stream:
                raw = b"".join(
                    line for line in asked.content.split(b"\n") if b'"id":"call_' in line
                )
                call_id = json.loads(raw[len(b"data: ") :])["choices"][0]["delta"]["tool_calls"][0][
                    "id"
                ]
            else:
                call_id = asked.json()["choices"][0]["message"]["tool_calls"][0]["id"]
            headers["x-quicedge-conversation"] = conv
            result = {"role": "tool", "tool_call_id": call_id, "content": "sunny"}
            answered = await http.post("/v1/chat/completions", headers=headers, json={
                "messages": [result], "tools": [CHAT_WEATHER], "max_tokens": 4})  # fmt: skip
            assert answered.status_code == 200, answered.text
            assert answered.json()["choices"][0]["finish_reason"] in ("stop", "length")
            items = (await http.get(f"/v1/conversations/{conv}/items?order=asc",
                                    headers=as_tenant("alpha"))).json()["data"]  # fmt: skip
    assert [i["type"] for i in items] == [
        "message", "function_call", "function_call_output", "message"]  # fmt: skip
    assert items[1]["call_id"] == call_id and json.loads(items[1]["arguments"]) == ARGUMENTS


async def test_the_sdks_other_fields_at_their_plain_values_go_through() -> None:
    """What an SDK user may set without thinking of it (`service_tier="auto"`, a
    `safety_identifier`, `background=False`, …) is taken and echoed, streamed or not."""
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                plain = dict(service_tier="auto", safety_identifier="user-42",
                             background=False, max_tool_calls=2,
                             prompt_cache_retention="in_memory")  # fmt: skip
                whole = await sdk.responses.create(
                    model="default",
                    input="Hi",
                    **plain,  # type: ignore[arg-type]
                )
                assert whole.status == "completed" and whole.service_tier == "default"
                assert whole.safety_identifier == "user-42" and whole.background is False
                async with sdk.responses.stream(
                    model="default",
                    input="Hi",
                    stream_options={"include_obfuscation": False},
                    **plain,  # type: ignore[arg-type]
                ) as stream:
                    final = await stream.get_final_response()
                assert final.output_text == whole.output_text
