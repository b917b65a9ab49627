"""The state's parts alone: histories and truncation, the memory store's TTL refresh and leases,
the Responses translation, settings."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from edge.errors import ConversationBusy, ConversationNotFound, InvalidRequest, PayloadTooLarge
from edge.state.config import ConversationConfig, StateConfig
from edge.state.conversations import (
    Conversations,
    History,
    MemoryConversations,
    parse_response_id,
    response_id,
)
from edge.state.response_builder import ResponseBuilder
from edge.state.responses import parse_request
from tests.edge.state.helpers import chat_chunks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


MISSING = ConversationNotFound("gone")


async def test_memory_ttl_is_refreshed_by_use_and_leases_expire() -> None:
    clock = Clock()
    config = ConversationConfig(ttl=10.0, lease=5.0)
    store = MemoryConversations(config, clock=clock)
    conversations = Conversations(store, config)
    turn = await conversations.start("t", user("hi"))
    assert await conversations.commit(turn, {"role": "assistant", "content": "hello"})
    for _ in range(3):  # used every 8 s: it outlives its 10 s TTL
        clock.now += 8
        assert await store.load("t", turn.cid) is not None
    clock.now += 11  # unused past its TTL: gone
    assert await store.load("t", turn.cid) is None

    second = await conversations.start("t", user("again"))
    assert await conversations.commit(second, {"role": "assistant", "content": "ok"})
    held = await conversations.resume("t", second.cid, user("one"), missing=MISSING)
    with pytest.raises(ConversationBusy):
        await conversations.resume("t", second.cid, user("two"), missing=MISSING)
    clock.now += 6  # the first turn's lease ran out; another turn takes the conversation
    late = await conversations.resume("t", second.cid, user("three"), missing=MISSING)
    assert not await conversations.commit(held, {"role": "assistant", "content": "stale"})
    assert await conversations.commit(late, {"role": "assistant", "content": "fresh"})
    blob = await store.load("t", second.cid)
    assert blob is not None
    contents = [m["content"] for m in History.decode(blob).messages]
    assert contents == ["again", "ok", "three", "fresh"]


async def test_continuing_an_earlier_response_forks_and_leaves_the_original() -> None:
    config = ConversationConfig()
    conversations = Conversations(MemoryConversations(config), config)
    one = await conversations.start("t", user("q1"))
    await conversations.commit(one, {"role": "assistant", "content": "a1"})
    two = await conversations.resume("t", one.cid, user("q2"), missing=MISSING)
    await conversations.commit(two, {"role": "assistant", "content": "a2"})
    fork = await conversations.resume("t", one.cid, user("q2'"), after=1, missing=MISSING)
    assert fork.cid != one.cid and fork.number == 2
    assert [m["content"] for m in fork.messages] == ["q1", "a1", "q2'"]
    await conversations.commit(fork, {"role": "assistant", "content": "a2'"})
    latest = await conversations.resume("t", one.cid, user("q3"), missing=MISSING)
    assert [m["content"] for m in latest.messages] == ["q1", "a1", "q2", "a2", "q3"]
    await conversations.release(latest)
    with pytest.raises(ConversationNotFound):
        await conversations.resume("t", one.cid, user("x"), after=7, missing=MISSING)


def test_truncation_keeps_pinned_system_and_whole_recent_turns() -> None:
    history = History()
    history.append(
        [{"role": "system", "content": "S"}, *user("u1")], {"role": "assistant", "content": "a1"}
    )
    for n in (2, 3, 4):
        history.append(user(f"u{n}"), {"role": "assistant", "content": f"a{n}"})
    assert history.pinned == [{"role": "system", "content": "S"}]
    assert history.upto(2) is not None
    assert history.drop_oldest() and history.first_kept == 2
    assert [m["content"] for m in history.prompt([])] == ["S", "u2", "a2", "u3", "a3", "u4", "a4"]
    assert history.upto(1) is None  # dropped: cannot be continued


async def test_reject_mode_is_413_and_truncate_mode_fits() -> None:
    for overflow in ("reject", "truncate"):
        config = ConversationConfig(max_bytes=1024, overflow=overflow)  # type: ignore[arg-type]
        conversations = Conversations(MemoryConversations(config), config)
        turn = await conversations.start("t", user("a" * 600))
        await conversations.commit(turn, {"role": "assistant", "content": "ok"})
        if overflow == "reject":
            with pytest.raises(PayloadTooLarge):
                await conversations.resume("t", turn.cid, user("b" * 600), missing=MISSING)
        else:
            nxt = await conversations.resume("t", turn.cid, user("b" * 600), missing=MISSING)
            assert nxt.truncated and len(orjson.dumps(nxt.messages)) <= 1024
        with pytest.raises(PayloadTooLarge):  # a single turn over the limit cannot fit at all
            await conversations.start("t", user("c" * 2000))


def test_response_ids_name_their_conversation_and_turn() -> None:
    rid = response_id("ab" * 12, 300)
    assert parse_response_id(rid) == ("ab" * 12, 300)
    with pytest.raises(ConversationNotFound):
        parse_response_id("resp_" + "z" * 32)


def test_a_developer_message_is_kept_as_itself_and_sent_upstream_as_system() -> None:
    request = parse_request({"input": [{"role": "developer", "content": "Be brief."},
                                       {"role": "user", "content": "hi"}]})  # fmt: skip
    assert [m["role"] for m in request.new] == ["developer", "user"]  # what is stored
    sent = request.chat_body(request.new)["messages"]
    assert sent == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert request.new[0]["role"] == "developer"  # the stored copy is untouched


def test_the_responses_stream_translation() -> None:
    request = parse_request({"input": "hi", "stream": True, "instructions": "Be kind."})
    assert request.chat_body(request.new)["messages"][0] == {
        "role": "system",
        "content": "Be kind.",
    }
    builder = ResponseBuilder(request.echo, "resp_x", "m")
    raw = b"".join(chat_chunks(["Hel", "lo"]))
    out = b"".join(builder.feed(raw[i : i + 7]) for i in range(0, len(raw), 7))  # any split
    events = [orjson.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: ")]
    types = [e["type"] for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == [
        "Hel", "lo"]  # fmt: skip
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"
    assert builder.ended and builder.failed is None

    failing = ResponseBuilder(request.echo, "resp_y", "m")
    out = failing.feed(b'data: {"error":{"message":"boom","code":500}}\n\ndata: [DONE]\n\n')
    assert b"response.failed" in out and failing.failed is not None


def test_settings_reject_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValueError, match="state: unknown setting"):
        StateConfig.from_mapping({"stor": "redis"})
    with pytest.raises(ValueError, match="state.redis_url"):
        StateConfig.from_mapping({"store": "redis"})
    with pytest.raises(ValueError, match="state.conversations.ttl"):
        StateConfig.from_mapping({"conversations": {"ttl": 0}})
    with pytest.raises(ValueError, match="state.cache.model_versions"):
        StateConfig.from_mapping({"cache": {"model_versions": ["nover"]}})
    config = StateConfig.from_mapping(
        {"store": "redis", "redis_url": "redis://127.0.0.1:1/0",
         "cache": {"allow_tenants": ["*"], "ttl": 5}, "conversations": {"overflow": "reject"}}
    )  # fmt: skip
    assert config.cache.enabled and config.cache.allows("anyone")
    assert config.conversations.overflow == "reject"


def test_the_state_table_is_read_from_toml() -> None:
    from edge import serve
    from edge.config import ProxyConfig

    args = serve.build_parser().parse_args([])
    toml = {"proxy": {"backends": ["http://127.0.0.1:1"]},
            "state": {"cache": {"allow_tenants": ["a"]}}}  # fmt: skip
    loaded = serve.load_settings(args, {}, toml=toml)
    proxy = loaded.get("proxy", ProxyConfig).with_features(loaded)
    assert proxy.state.cache.allow_tenants == ["a"]
    with pytest.raises(ValueError, match=r"state\.cache.*allow"):
        serve.load_settings(args, {}, toml={**toml, "state": {"cache": {"allow": ["a"]}}})


async def test_an_unstored_turn_reads_the_history_and_writes_nothing() -> None:
    config = ConversationConfig()
    store = MemoryConversations(config)
    conversations = Conversations(store, config)
    one = await conversations.start("t", user("q1"))
    await conversations.commit(one, {"role": "assistant", "content": "a1"})
    peek = await conversations.resume("t", one.cid, user("aside"), store=False, missing=MISSING)
    assert peek.token is None and [m["content"] for m in peek.messages] == ["q1", "a1", "aside"]
    held = await conversations.resume("t", one.cid, user("q2"), missing=MISSING)  # no lease taken
    assert await conversations.commit(peek, {"role": "assistant", "content": "ignored"})
    assert await conversations.commit(held, {"role": "assistant", "content": "a2"})
    blob = await store.load("t", one.cid)
    assert blob is not None
    assert [m["content"] for m in History.decode(blob).messages] == ["q1", "a1", "q2", "a2"]


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": CITY}  # fmt: skip


def sse_events(out: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: ")]


def test_function_tools_and_items_become_chat_tools_and_messages() -> None:
    request = parse_request({
        "input": [
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather",
             "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "rain"}]},
        ],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
    })  # fmt: skip
    chat = request.chat_body(request.new)
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": WEATHER["parameters"]}}]  # fmt: skip
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [  # parallel calls: one message
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]  # fmt: skip
    assert request.echo["tools"] == [WEATHER] and request.echo["parallel_tool_calls"] is False
    effort = parse_request({"input": "hi", "reasoning": {"effort": "low", "summary": None}})
    assert effort.chat["reasoning_effort"] == "low"
    assert effort.echo["reasoning"] == {"effort": "low", "summary": None}
    assert "reasoning_effort" not in parse_request({"input": "hi"}).chat
    bad_ones: list[tuple[Any, str]] = [
        ({"effort": "extreme"}, "reasoning.effort"), ({"summary": "auto"}, "reasoning.summary"),
        ({"budget": 3}, "reasoning.budget"), ("low", "reasoning")]  # fmt: skip
    for reasoning, param in bad_ones:
        with pytest.raises(InvalidRequest) as bad:
            parse_request({"input": "hi", "reasoning": reasoning})
        assert bad.value.param == param
    hinted = parse_request({"input": "hi", "prompt_cache_key": "agent-7"})
    assert hinted.chat["prompt_cache_key"] == "agent-7" == hinted.echo["prompt_cache_key"]
    plain = parse_request({"input": "hi", "tool_choice": "none"})
    assert "tools" not in plain.chat and "tool_choice" not in plain.chat  # none to choose among


def tool_chunks(arguments: list[str], *, text: str = "") -> list[bytes]:
    """A chat stream that calls get_weather, streaming its arguments (SGLang's shape)."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def sse(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"

    out = [sse({"role": "assistant", "content": text})]
    first = {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    out.append(sse({"tool_calls": [first]}))
    out += [sse({"tool_calls": [{"index": 0, "function": {"arguments": a}}]}) for a in arguments]
    out.append(sse({}, "tool_calls"))
    return [*out, b"data: [DONE]\n\n"]


def test_a_streamed_tool_call_becomes_function_call_events_and_a_stored_reply() -> None:
    request = parse_request({"input": "Weather in Paris?", "tools": [WEATHER], "stream": True})
    builder = ResponseBuilder(request.echo, "resp_" + "ab" * 12 + "00000001", "m")
    raw = b"".join(tool_chunks(['{"ci', 'ty":"Par', 'is"}']))
    events = sse_events(b"".join(builder.feed(raw[i : i + 11]) for i in range(0, len(raw), 11)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * 3,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]  # fmt: skip
    added = events[2]["item"]
    assert added["type"] == "function_call" and added["status"] == "in_progress"
    done = events[-2]["item"]
    assert done == {"type": "function_call", "id": added["id"], "call_id": "call_1",
                    "name": "get_weather", "arguments": '{"city":"Paris"}',
                    "status": "completed"}  # fmt: skip
    assert events[-1]["response"]["output"] == [done]
    assert events[-1]["response"]["tools"] == [WEATHER]
    assert builder.reply() == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}  # fmt: skip
    # read back as it was answered, the same item ids
    again = ResponseBuilder.restored(builder.id, builder.reply(), builder.stored())
    assert again.response("completed")["output"] == [done]


def test_text_then_a_call_are_two_items_in_the_order_they_began() -> None:
    builder = ResponseBuilder({}, "resp_x", "m")
    out = b"".join(builder.feed(c) for c in tool_chunks(["{}"], text="Let me look."))
    events = sse_events(out)
    added = [(e["output_index"], e["item"]["type"]) for e in events
             if e["type"] == "response.output_item.added"]  # fmt: skip
    assert added == [(0, "message"), (1, "function_call")]
    final = events[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["message", "function_call"]
    assert builder.reply()["content"] == "Let me look."


def test_a_whole_chat_answer_with_tool_calls_becomes_function_call_items() -> None:
    builder = ResponseBuilder({}, "resp_y", "m")
    body = orjson.dumps({
        "id": "c", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "tool_calls": [
                {"id": "call_a", "index": 0, "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
    })  # fmt: skip
    response = orjson.loads(builder.from_chat_body(body) or b"")
    assert response["status"] == "completed"
    assert [(i["type"], i["call_id"], i["arguments"]) for i in response["output"]] == [
        ("function_call", "call_a", '{"city":"Oslo"}')]  # fmt: skip


def test_an_oversized_upstream_event_ends_the_answer_failed_and_keeps_nothing() -> None:
    from edge.state.chat_answer import MAX_EVENT_BYTES, ChatAnswer

    builder = ResponseBuilder({}, "resp_z", "m")
    out = builder.feed(
        b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * MAX_EVENT_BYTES
    )
    events = sse_events(out)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "event_too_large"
    assert builder.feed(b'"}}]}\n\ndata: [DONE]\n\n') == b""  # nothing after the end
    answer = ChatAnswer()
    assert answer.feed(b"data: " + b"y" * (MAX_EVENT_BYTES + 1)) == []
    assert answer.oversized and answer.feed(b"\n\ndata: [DONE]\n\n") == [] and not answer.done


def test_sdk_fields_that_need_nothing_here_are_taken_at_those_values_only() -> None:
    taken = parse_request({
        "input": "hi", "background": False, "service_tier": "auto", "max_tool_calls": 3,
        "prompt_cache_retention": "in_memory", "safety_identifier": "user-42",
        "stream": True, "stream_options": {"include_obfuscation": False},
    })  # fmt: skip
    assert taken.chat["user"] == "user-42"  # the end user, for the backend and routing
    assert {k: taken.echo[k] for k in ("background", "service_tier", "max_tool_calls",
                                       "safety_identifier")} == {
        "background": False, "service_tier": "default", "max_tool_calls": 3,
        "safety_identifier": "user-42"}  # fmt: skip
    both = parse_request({"input": "hi", "user": "u1", "safety_identifier": "s1"})
    assert both.chat["user"] == "u1"
    refused: list[tuple[dict[str, Any], str]] = [
        ({"background": True, "store": False}, "background"),
        ({"background": "yes"}, "background"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"stream_options": {"chunk_size": 2}}, "stream_options.chunk_size"),
        ({"stream_options": "yes"}, "stream_options"),
        ({"max_tool_calls": -1}, "max_tool_calls"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
        ({"safety_identifier": 7}, "safety_identifier"),
    ]
    for extra, param in refused:
        with pytest.raises(InvalidRequest) as bad:
            parse_request({"input": "hi", **extra})
        assert bad.value.param == param


def test_the_next_turns_input_is_placed_where_storing_it_puts_it() -> None:
    for history in (History(pinned=[{"role": "system", "content": "S"}]), History()):
        new = [{"role": "developer", "content": "D"}, {"role": "user", "content": "U"}]
        before = history.next_input(new)
        history.append(new, {"role": "assistant", "content": "A"})
        assert history.turn_input(1) == before
        later = [{"role": "system", "content": "late"}, {"role": "user", "content": "U2"}]
        before = history.next_input(later)  # not the first turn: nothing more is pinned
        history.append(later, {"role": "assistant", "content": "A2"})
        assert history.turn_input(2) == before
