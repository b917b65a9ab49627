"""Function calling on `/v1/chat/completions` (SGLang with `--tool-call-parser`): which requests
call a tool, the schema-derived arguments generated through the scheduler, the whole and the
streamed wire shapes, max_tokens cutting, the 400s, replayed calls in the chat template, and the
official `openai` SDK reading both forms. Real SimServers over real sockets."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import (
    FunctionToolCallArgumentsDeltaEvent,
    FunctionToolCallArgumentsDoneEvent,
)

from backends.sim import SimServer
from backends.sim.chat_template import TemplateError, render, with_tools
from backends.sim.tokenizer import Tokenizer
from backends.sim.tools import arguments, split_pieces
from tests.backends.sim.conftest import MakeSim, stream_post

CALL_ID = re.compile(r"call_[0-9a-f]{24}")

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a place.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "a city"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "threshold": {"type": "number"},
                "hourly": {"type": "boolean"},
                "fields": {"type": "array", "items": {"type": "string"}},
                "options": {"type": "object"},
                "either": {"type": ["string", "null"]},
                "anything": {},
            },
            "required": ["location"],
        },
        "strict": False,
    },
}
SEARCH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}
CLOCK: dict[str, Any] = {
    "type": "function",
    "function": {"name": "clock-now"},
}  # no parameters at all
TOOLS: list[Any] = [WEATHER, SEARCH, CLOCK]

WEATHER_ARGS = (
    '{"location":"sim","days":1,"unit":"celsius","threshold":1.5,"hourly":true,'
    '"fields":[],"options":{},"either":null,"anything":null}'
)
SEARCH_ARGS = '{"query":"sim"}'
ARGS = {"get_weather": WEATHER_ARGS, "search": SEARCH_ARGS, "clock-now": "{}"}


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


async def post(client: httpx.AsyncClient, sim: SimServer, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(f"{sim.url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def the_call(body: dict[str, Any]) -> dict[str, Any]:
    (choice,) = body["choices"]
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] is None
    (call,) = message["tool_calls"]
    return call


def joined_call(events: list[Any]) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    """The opening tool-call delta, the joined arguments and the argument-only deltas."""
    deltas = [e["choices"][0]["delta"] for e in events if e != "[DONE]" and e["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    opening, later = calls[0], calls[1:]
    joined = opening["function"]["arguments"] + "".join(c["function"]["arguments"] for c in later)
    return opening, joined, later


def test_the_arguments_follow_the_schema_in_order() -> None:
    assert arguments(WEATHER["function"]["parameters"]) == WEATHER_ARGS
    assert arguments({"properties": {"z": {"type": "string"}, "a": {"enum": [3, 4]}}}) == (
        '{"z":"sim","a":3}'
    )
    assert arguments({}) == "{}"
    assert split_pieces('{"query":"sim"}') == ['{"qu', 'ery"', ':"si', 'm"}']


async def test_a_whole_call(sim: SimServer, client: httpx.AsyncClient) -> None:
    body = await post(client, sim, chat("What does get_weather say for Paris?", tools=TOOLS))
    call = the_call(body)
    assert CALL_ID.fullmatch(call["id"]), call["id"]
    assert call["index"] == 0 and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"  # auto: the tool the text names
    assert call["function"]["arguments"] == WEATHER_ARGS
    assert json.loads(call["function"]["arguments"]) == {
        "location": "sim",
        "days": 1,
        "unit": "celsius",
        "threshold": 1.5,
        "hourly": True,
        "fields": [],
        "options": {},
        "either": None,
        "anything": None,
    }
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    usage = body["usage"]
    # One token per piece of the arguments, then the end-of-turn token.
    assert usage["completion_tokens"] == len(split_pieces(WEATHER_ARGS)) + 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    again = the_call(
        await post(client, sim, chat("What does get_weather say for Paris?", tools=TOOLS))
    )
    assert again["id"] != call["id"] and again["function"] == call["function"]


async def test_a_streamed_call(make_sim: MakeSim, client: httpx.AsyncClient) -> None:
    sim = await make_sim(profile="h100-llama3-8b")  # real decode steps: one chunk per token
    body = chat("the weather?", tools=TOOLS, tool_choice="required", stream=True)
    body["stream_options"] = {"include_usage": True}
    response, events = await stream_post(client, f"{sim.url}/v1/chat/completions", body)
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    role, opening_chunk = events[0], events[1]
    assert role["choices"][0]["delta"] == {
        "reasoning_content": None,
        "role": "assistant",
        "content": "",
    }
    (opening_call,) = opening_chunk["choices"][0]["delta"]["tool_calls"]
    assert set(opening_chunk["choices"][0]["delta"]) == {"tool_calls"}
    assert set(opening_call) == {"index", "id", "type", "function"}
    assert opening_call["index"] == 0 and opening_call["type"] == "function"
    assert CALL_ID.fullmatch(opening_call["id"])
    assert opening_call["function"]["name"] == "get_weather"
    opening, joined, later = joined_call(events)
    assert opening is opening_call or opening == opening_call
    assert joined == WEATHER_ARGS
    assert json.loads(joined)["unit"] == "celsius"
    assert later, "the arguments come token by token"
    for call in later:
        assert call == {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
        assert call["function"]["arguments"]
    finish, usage_chunk = events[-3], events[-2]
    assert finish["choices"][0]["finish_reason"] == "tool_calls"
    assert finish["choices"][0]["matched_stop"] is None
    assert finish["choices"][0]["delta"] == {
        "role": None,
        "content": None,
        "reasoning_content": None,
        "tool_calls": None,
    }
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(split_pieces(WEATHER_ARGS)) + 1
    # Nothing else: role, opening, one chunk per later argument piece, finish, usage, [DONE].
    assert len(events) == 2 + len(later) + 3


@pytest.mark.parametrize(
    ("text", "choice", "called"),
    [
        ("search for cats", {"type": "function", "function": {"name": "clock-now"}}, "clock-now"),
        ("search the get_weather", "auto", "get_weather"),  # both named: the first in `tools`
        ("please search", "auto", "search"),
        ("what is the clock-now", None, "clock-now"),  # no tool_choice with tools: auto
        ("please search", "required", "search"),
        ("nothing named here", "required", "get_weather"),  # required, none named: the first
        ("nothing named here", "auto", None),  # auto, none named: text
        ("please search", "none", None),
    ],
)
async def test_which_tool_each_choice_calls(
    sim: SimServer, client: httpx.AsyncClient, text: str, choice: Any, called: str | None
) -> None:
    extra = {"tools": TOOLS} | ({} if choice is None else {"tool_choice": choice})
    body = await post(client, sim, chat(text, max_tokens=8, **extra))
    (answer,) = body["choices"]
    if called is None:
        plain = await post(client, sim, chat(text, max_tokens=8))
        # a text answer; its prompt is longer by the tools' definitions, which lead it
        assert answer["message"]["tool_calls"] is None and answer["message"]["content"]
        assert answer["finish_reason"] == plain["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
        return
    call = the_call(body)
    assert call["function"]["name"] == called
    assert call["function"]["arguments"] == ARGS[called][: 8 * 4]


async def test_after_a_tool_result_the_answer_is_text(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(profile="h100-llama3-8b")  # real decode steps: one chunk per token
    first = the_call(await post(client, sim, chat("get_weather for Paris?", tools=TOOLS)))
    messages = [
        {"role": "user", "content": "get_weather for Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [first | {"index": 0}]},
        {"role": "tool", "tool_call_id": first["id"], "content": "sunny, mentions search"},
    ]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "search"}}):
        body = await post(
            client,
            sim,
            {"messages": messages, "tools": TOOLS, "tool_choice": choice, "max_tokens": 5},
        )
        (answer,) = body["choices"]
        assert answer["message"]["tool_calls"] is None
        assert isinstance(answer["message"]["content"], str) and answer["message"]["content"]
    # A text answer streams as it does without tools: the same chunk shapes, in the same order
    # (its tokens differ: the tools' definitions lead its prompt).
    plain = {"messages": messages, "max_tokens": 5, "stream": True}
    _, with_tools = await stream_post(
        client, f"{sim.url}/v1/chat/completions", plain | {"tools": TOOLS}
    )
    _, without = await stream_post(client, f"{sim.url}/v1/chat/completions", plain)

    def shapes(events: list[Any]) -> list[Any]:
        return [e if e == "[DONE]" else sorted(e["choices"][0]["delta"]) for e in events]

    assert shapes(with_tools) == shapes(without)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in with_tools[:-1])


async def test_max_tokens_cuts_the_arguments(sim: SimServer, client: httpx.AsyncClient) -> None:
    body = await post(client, sim, chat("get_weather", tools=TOOLS, max_tokens=3))
    call = the_call(body)
    assert call["function"]["arguments"] == WEATHER_ARGS[:12]  # three pieces of four
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    _, events = await stream_post(
        client,
        f"{sim.url}/v1/chat/completions",
        chat("get_weather", tools=TOOLS, max_tokens=3, stream=True),
    )
    opening, joined, _ = joined_call(events)
    assert opening["function"]["name"] == "get_weather" and joined == WEATHER_ARGS[:12]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # Exactly the arguments' length: every piece, still cut by max_tokens (no end-of-turn).
    pieces = len(split_pieces(SEARCH_ARGS))
    exact = await post(client, sim, chat("search", tools=TOOLS, max_tokens=pieces))
    assert the_call(exact)["function"]["arguments"] == SEARCH_ARGS
    assert exact["choices"][0]["finish_reason"] == "length"


async def test_an_aborted_call_stream_finishes_with_abort(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(profile="h100-llama3-8b", time_scale=50.0)  # ~0.4 s per token
    body = chat("get_weather", tools=TOOLS, stream=True, rid="victim")
    url = f"{sim.url}/v1/chat/completions"
    async with client.stream("POST", url, json=body) as response:
        lines = response.aiter_lines()
        seen: list[str] = []
        async for line in lines:
            if line:
                seen.append(line)
            if '"tool_calls":[{"index":0,"id"' in line:
                r = await client.post(f"{sim.url}/abort_request", json={"rid": "victim"})
                assert r.status_code == 200
                break
        rest: list[Any] = [
            json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" async for x in lines if x
        ]
    assert len(seen) == 2  # role, then the opening of the call
    assert rest[-1] == "[DONE]"
    # SGLang's graceful abort: the finish chunk says "abort" (not "tool_calls"), no error event
    assert rest[-2]["choices"][0]["finish_reason"] == "abort"
    assert all(e == "[DONE]" or e["choices"][0]["finish_reason"] is None for e in rest[:-2])


OPENAI_ERROR = {"object", "message", "type", "param", "code"}


def user(text: str = "hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


GOOD_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"tools": {"type": "function"}}, "'tools' must be a list"),
        ({"tools": [WEATHER, "search"]}, "tools[1] must be an object"),
        ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function must be an object"),
        (
            {"tools": [WEATHER, {"type": "function", "function": {"name": "get weather"}}]},
            "tools[1].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [SEARCH, SEARCH]}, "tools[1].function.name 'search' is given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "description": 1}}]},
            "tools[0].function.description",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "strict": "yes"}}]},
            "tools[0].function.strict",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "a", "parameters": {"properties": [1]}},
                    }
                ]
            },
            "tools[0].function.parameters.properties must be an object",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "a", "parameters": {"properties": {"p": 1}}},
                    }
                ]
            },
            "tools[0].function.parameters.properties.p",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "a",
                            "parameters": {"properties": {"p": {"enum": []}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters.properties.p.enum",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice must be"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice names no tool 'x'",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "web", "function": {"name": "search"}}},
            "tool_choice must be",
        ),
        ({"tool_choice": "auto"}, "'tool_choice' is only allowed when 'tools' are given"),
        ({"tools": [], "tool_choice": "none"}, "'tool_choice' is only allowed"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "'parallel_tool_calls'"),
        (
            {"messages": [user(), {"role": "assistant", "tool_calls": {"id": "a"}}]},
            "messages[1].tool_calls must be a list",
        ),
        (
            {"messages": [user(), {"role": "assistant", "tool_calls": [GOOD_CALL | {"id": 7}]}]},
            "messages[1].tool_calls[0].id",
        ),
        (
            {
                "messages": [
                    user(),
                    {
                        "role": "assistant",
                        "tool_calls": [GOOD_CALL | {"function": {"name": "f", "arguments": {}}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    user(),
                    {
                        "role": "assistant",
                        "tool_calls": [GOOD_CALL | {"function": {"arguments": "{}"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.name",
        ),
        (
            {
                "messages": [
                    user(),
                    {"role": "assistant", "tool_calls": [GOOD_CALL | {"type": "code"}]},
                ]
            },
            "messages[1].tool_calls[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [GOOD_CALL]}]},
            "messages[0].tool_calls is only allowed on assistant messages",
        ),
        (
            {"messages": [user(), {"role": "tool", "tool_call_id": 5, "content": "r"}]},
            "messages[1].tool_call_id must be a string",
        ),
    ],
)
async def test_malformed_tool_fields_are_400s(
    sim: SimServer, client: httpx.AsyncClient, extra: dict[str, Any], needle: str
) -> None:
    body = {"messages": [user("weather")], **extra}
    for stream in (False, True):
        response = await client.post(
            f"{sim.url}/v1/chat/completions", json=body | {"stream": stream}
        )
        assert response.status_code == 400, (extra, response.text)
        error = response.json()
        assert set(error) == OPENAI_ERROR and error["code"] == 400
        assert needle in error["message"], error["message"]


async def test_tool_fields_that_are_fine(sim: SimServer, client: httpx.AsyncClient) -> None:
    extras: list[dict[str, Any]] = [
        {"tools": None, "tool_choice": None},
        {"tools": []},  # no tools: a text answer
        {"tools": TOOLS, "parallel_tool_calls": False, "tool_choice": None},
    ]
    for extra in extras:
        body = await post(client, sim, chat("search", max_tokens=2, **extra))
        called = body["choices"][0]["message"]["tool_calls"] is not None
        assert called == bool(extra["tools"])


def test_replayed_calls_render_deterministically() -> None:
    call = {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}
    two = [call, {**call, "id": "call_b", "function": {"name": "g", "arguments": "{}"}}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": two},
        {"role": "tool", "tool_call_id": "call_a", "content": "done"},
        {"role": "tool", "content": [{"type": "text", "text": "also done"}]},
    ]
    assert render(messages) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\ngo<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name":"f","arguments":"{\\"x\\":1}"}\n{"name":"g","arguments":"{}"}<|eot_id|>'
        "<|start_header_id|>tool<|end_header_id|>\n\ndone<|eot_id|>"
        "<|start_header_id|>tool<|end_header_id|>\n\nalso done<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # Content null, absent or "" render alike; text comes before the calls.
    for content in (None, ""):
        messages[1]["content"] = content
        assert render(messages) == render(
            [*messages[:1], {"role": "assistant", "tool_calls": two}, *messages[2:]]
        )
    messages[1]["content"] = "Let me check."
    assert "\n\nLet me check.\n" + '{"name":"f"' in render(messages)
    with pytest.raises(TemplateError, match=r"messages\[1\]\.tool_calls\[1\]\.function"):
        render([messages[0], {"role": "assistant", "tool_calls": [call, {**call, "function": 3}]}])


async def test_a_replayed_call_and_its_result_are_the_prompt(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(enable_cache_report=True)
    turn1 = [{"role": "user", "content": "get_weather for Paris?"}]
    first = await post(client, sim, {"messages": turn1, "tools": TOOLS})
    call = the_call(first)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    second = await post(client, sim, {"messages": turn2, "tools": TOOLS, "max_tokens": 4})
    assert second["choices"][0]["message"]["tool_calls"] is None  # after a result: text
    rendered = with_tools(render(turn2), TOOLS)
    line = json.dumps({"name": "get_weather", "arguments": WEATHER_ARGS}, separators=(",", ":"))
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{line}<|eot_id|>" in rendered
    assert rendered.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                               'Tools: [{"type":"function"')  # fmt: skip
    assert second["usage"]["prompt_tokens"] == len(Tokenizer().encode(rendered))
    # Turn 2 starts with turn 1's prompt, which the radix cache holds.
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 1


async def test_guard_mode_answers_its_verdict_even_with_tools(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(guard=True, guard_unsafe=("attack",))
    body = await post(client, sim, chat("search", tools=TOOLS, tool_choice="required"))
    message = body["choices"][0]["message"]
    assert message["content"] == "safe" and message["tool_calls"] is None


def sdk(sim: SimServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="sim", max_retries=0)


async def test_the_openai_sdk_reads_a_whole_call(sim: SimServer) -> None:
    async with sdk(sim) as client:
        completion = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "get_weather for Paris?"}],
            tools=TOOLS,
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and CALL_ID.fullmatch(call.id)
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["location"] == "sim"


STRICT_SEARCH: Any = {
    "type": "function",
    "function": {
        "name": "search",
        "strict": True,  # the SDK's stream helper takes only strict tools
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}


async def test_the_openai_sdk_accumulates_a_streamed_call(make_sim: MakeSim) -> None:
    sim = await make_sim(profile="h100-llama3-8b")
    async with sdk(sim) as client:
        completions = client.chat.completions
        stream_helper = getattr(completions, "stream", None) or client.beta.chat.completions.stream
        deltas: list[str] = []
        done: list[Any] = []
        async with stream_helper(
            model="m",
            messages=[{"role": "user", "content": "please search"}],
            tools=[STRICT_SEARCH],
            tool_choice="required",
            stream_options={"include_usage": True},
        ) as stream:
            async for event in stream:
                if isinstance(event, FunctionToolCallArgumentsDeltaEvent):
                    deltas.append(event.arguments_delta)
                elif isinstance(event, FunctionToolCallArgumentsDoneEvent):
                    done.append(event)
            final = await stream.get_final_completion()
    assert "".join(deltas) == SEARCH_ARGS and len(deltas) > 1
    assert [(e.name, e.arguments, e.parsed_arguments) for e in done] == [
        ("search", SEARCH_ARGS, {"query": "sim"})
    ]
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "search"
    assert json.loads(calls[0].function.arguments) == {"query": "sim"}
    assert CALL_ID.fullmatch(calls[0].id)
    assert final.usage is not None and final.usage.completion_tokens == 4 + 1


async def test_the_openai_sdk_reads_a_raw_chunk_stream(sim: SimServer) -> None:
    async with sdk(sim) as client:
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "what is the clock-now"}],
            tools=TOOLS,
            stream=True,
        )
        names, args, reasons = [], [], []
        async for chunk in stream:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    assert call.index == 0
                    if call.function is not None and call.function.name:
                        names.append(call.function.name)
                    if call.function is not None and call.function.arguments:
                        args.append(call.function.arguments)
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
    assert names == ["clock-now"] and "".join(args) == "{}" and reasons == ["tool_calls"]


async def test_the_raw_bytes_of_a_call_stream(sim: SimServer, client: httpx.AsyncClient) -> None:
    """The raw bytes of a call stream: compact JSON, `data: ` framing, blank-line separated."""
    body = chat("search", tools=TOOLS, stream=True)
    async with client.stream("POST", f"{sim.url}/v1/chat/completions", json=body) as response:
        raw = b"".join([part async for part in response.aiter_bytes()])
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    assert all(f.startswith(b"data: ") and b": " not in f[6:] for f in frames[:-2])
    assert b'"delta":{"tool_calls":[{"index":0,"id":"call_' in frames[1]
    assert b'"finish_reason":"tool_calls","matched_stop":null}]}' in frames[-3]
