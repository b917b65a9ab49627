"""The pure stages: body limits, JSON, field validation, the routing view and the rid splice."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from edge import errors
from edge.stages.body import (
    MAX_NESTING,
    BodyBudget,
    ClientGone,
    check_content_type,
    declared_length,
    parse_json_object,
    read_body,
)
from edge.stages.forward import (
    label_from_body,
    request_id_from,
    splice_rid,
    upstream_headers,
    upstream_rid,
)
from edge.stages.validate import CHAT, COMPLETIONS, GENERATE, validate
from edge.stages.view import build_view, render_chat


def receiver(*messages: dict[str, Any]) -> Any:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return receive


@pytest.mark.parametrize(
    "value", [b"application/json", b"application/json; charset=utf-8", b"Application/JSON"]
)
def test_json_content_types_pass(value: bytes) -> None:
    check_content_type(value)


@pytest.mark.parametrize("value", [None, b"text/plain", b"application/x-www-form-urlencoded"])
def test_other_content_types_are_415(value: bytes | None) -> None:
    with pytest.raises(errors.UnsupportedMediaType):
        check_content_type(value)


def test_a_compressed_body_is_415() -> None:
    check_content_type(b"application/json", b"identity")
    check_content_type(b"application/json", b" Identity ")
    for coding in (b"gzip", b"br", b"deflate, gzip"):
        with pytest.raises(errors.UnsupportedMediaType, match="Content-Encoding") as refused:
            check_content_type(b"application/json", coding)
        assert (b"accept-encoding", b"identity") in refused.value.extra_headers


def test_declared_length_over_limit_is_413_before_reading() -> None:
    with pytest.raises(errors.PayloadTooLarge):
        declared_length(b"1001", 1000)
    assert declared_length(b"1000", 1000) == 1000
    with pytest.raises(errors.InvalidRequest):
        declared_length(b"ten", 1000)


async def test_body_is_counted_as_it_streams_in() -> None:
    chunks = [{"type": "http.request", "body": b"x" * 400, "more_body": True}] * 3
    with pytest.raises(errors.PayloadTooLarge):
        await read_body(receiver(*chunks), 1000)
    body = await read_body(
        receiver(
            {"type": "http.request", "body": b"ab", "more_body": True},
            {"type": "http.request", "body": b"cd", "more_body": False},
        ),
        1000,
    )
    assert body == b"abcd"


async def test_client_gone_while_sending_body() -> None:
    with pytest.raises(ClientGone):
        await read_body(
            receiver(
                {"type": "http.request", "body": b"ab", "more_body": True},
                {"type": "http.disconnect"},
            ),
            1000,
        )


def part(body: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_bodies_still_arriving_share_the_budget_and_give_it_back() -> None:
    """Two bodies in pieces: the second is refused (503, with retry-after) once both would pass
    the budget; each gives back what it held however it ended; a body in one piece is not
    counted."""
    budget = BodyBudget(1000)
    first_sent = asyncio.Event()
    finish_first = asyncio.Event()

    pending = [part(b"a" * 600)]

    async def first_receive() -> Any:
        if pending:
            first_sent.set()
            return pending.pop()
        await finish_first.wait()
        return part(b"b", more=False)

    first = asyncio.ensure_future(read_body(first_receive, 10_000, budget))
    await first_sent.wait()
    await asyncio.sleep(0)
    assert budget.held == 600
    with pytest.raises(errors.Overloaded) as refused:
        await read_body(receiver(part(b"c" * 300), part(b"d" * 300)), 10_000, budget)
    assert dict(refused.value.extra_headers)[b"retry-after"] == b"1"
    assert budget.held == 600  # the refused body gave back its 300
    assert await read_body(receiver(part(b"e" * 5000, more=False)), 10_000, budget)
    finish_first.set()
    assert await first == b"a" * 600 + b"b"
    assert budget.held == 0
    for ending in (part(b"f" * 20_000), {"type": "http.disconnect"}):
        with pytest.raises((errors.PayloadTooLarge, ClientGone)):
            await read_body(receiver(part(b"g" * 500), ending), 10_000, budget)
        assert budget.held == 0


@pytest.mark.parametrize("body", [b"", b"{", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_non_object_json_is_400(body: bytes) -> None:
    with pytest.raises(errors.InvalidJSON):
        parse_json_object(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # overflowed `json`'s stack: a 500
        b'{"temperature": NaN}',
        b'{"temperature": 1e999}',
        b'{"prompt": "\\ud800"}',  # a lone surrogate
        b'{"prompt": "\xc3("}',  # not UTF-8
        '{"prompt": "hi"}'.encode("utf-16"),
    ],
)
def test_what_rfc_8259_does_not_allow_is_400(body: bytes) -> None:
    with pytest.raises(errors.InvalidJSON, match="not valid JSON"):
        parse_json_object(body)


def test_bodies_nest_at_most_max_nesting_levels() -> None:
    """Deeper bodies are refused as they are read: the edge re-encodes bodies with orjson,
    which stops at 254 levels (a 500 before)."""
    at_limit = b'{"x": ' + b"[" * (MAX_NESTING - 1) + b"]" * (MAX_NESTING - 1) + b"}"
    assert parse_json_object(at_limit)
    # brackets in strings are text, escaped quotes included
    texts = b'{"x": "' + b'[\\"' * 500 + b'", "y": [[1], {"z": "]]"}]}'
    assert parse_json_object(texts)["y"] == [[1], {"z": "]]"}]
    wide = b'{"x": [' + b",".join([b"[1, {}]"] * 1000) + b"]}"
    assert len(parse_json_object(wide)["x"]) == 1000
    over = b'{"x": ' + b'[{"a": ' * (MAX_NESTING // 2) + b"1" + b"}]" * (MAX_NESTING // 2) + b"}"
    with pytest.raises(errors.InvalidJSON, match=f"deeper than {MAX_NESTING} levels"):
        parse_json_object(over)


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (CHAT, {}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": ["hi"]}, "messages[0]"),
        (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (COMPLETIONS, {}, "prompt"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": ["a", 1]}, "prompt"),  # neither texts nor ids: was a 500
        (COMPLETIONS, {"prompt": [1, True]}, "prompt"),
        (GENERATE, {}, "text"),
        (GENERATE, {"text": {"a": 1}}, "text"),
        (GENERATE, {"input_ids": "abc"}, "input_ids"),
        (GENERATE, {"text": "hi", "sampling_params": [1]}, "sampling_params"),
        (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": "hi", "model": 7}, "model"),
    ],
)
def test_missing_or_invalid_fields_name_the_field(
    route: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        validate(route, body)
    assert info.value.param == param
    assert info.value.status == 400


def test_valid_bodies_report_stream() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert validate(CHAT, chat) is True
    assert validate(COMPLETIONS, {"prompt": [1, 2, 3]}) is False
    assert validate(GENERATE, {"input_ids": [1, 2], "stream": False}) is False


def test_chat_view_renders_roles_in_order() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
    ]
    text = render_chat(messages)
    assert text == "<|system|>\nYou are terse.\n<|user|>\nHi\n<|assistant|>\n"
    view = build_view(CHAT, {"messages": messages, "user": "u1", "model": "m"}, None)
    assert view.text == text
    assert view.approx_tokens == len(text) // 4 + 1
    assert view.session_key == "u1"
    assert view.model == "m"
    # a shared system prompt gives a shared text prefix
    other = render_chat([messages[0], {"role": "user", "content": "Bye"}])
    assert other.startswith("<|system|>\nYou are terse.\n<|user|>\n")


def test_offered_tools_lead_the_view_and_tool_calls_follow_their_message() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}  # fmt: skip
    turn = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    view = build_view(CHAT, {"messages": turn, "tools": [tool]}, None)
    header = '<|tools|>\n[{"type":"function","function":{"name":"get_weather","parameters":{}}}]\n'
    assert view.text.startswith(header) and view.prompt_start == len(header)
    assert view.tools == [tool]
    assert '<|assistant|>\n\n<|call|>get_weather {"city":"Oslo"}\n<|tool|>\nsunny' in view.text
    # Two requests offering the same tools share the tools' text as a prefix; other tools do not.
    other = build_view(CHAT, {"messages": [{"role": "user", "content": "Hi"}], "tools": [tool]},
                       None)  # fmt: skip
    assert other.text.startswith(header)
    plain = build_view(CHAT, {"messages": turn}, None)
    assert plain.prompt_start == 0 and plain.tools is None and "<|tools|>" not in plain.text


def test_session_header_wins_over_user_field() -> None:
    view = build_view(COMPLETIONS, {"prompt": "abc", "user": "u1"}, "s9")
    assert view.session_key == "s9"
    hinted = {"prompt": "abc", "user": "u1", "prompt_cache_key": "agent-7"}
    assert build_view(COMPLETIONS, hinted, None).session_key == "agent-7"  # before the user
    assert build_view(COMPLETIONS, hinted, "s9").session_key == "s9"


def test_token_id_prompts_count_exactly() -> None:
    view = build_view(GENERATE, {"input_ids": [5, 6, 7]}, None)
    assert view.approx_tokens == 3
    assert view.text == "5 6 7"
    assert build_view(COMPLETIONS, {"prompt": [[1, 2], [3]]}, None).approx_tokens == 2


@pytest.mark.parametrize(
    "raw",
    [b'{"prompt": "hi"}', b'  \n{"prompt":"hi","n":1}', b"{}", b'\t{ "a" : [1, {"b": 2}] }'],
)
def test_rid_splice_keeps_the_rest_exactly(raw: bytes) -> None:
    body = json.loads(raw)
    out = splice_rid(raw, body, "abc123")
    assert json.loads(out) == {"rid": "abc123", **body}
    assert out.endswith(raw.lstrip()[1:])


def test_a_client_rid_is_replaced_by_the_edges() -> None:
    raw = b'{"rid": "mine", "text": "x"}'
    assert json.loads(splice_rid(raw, json.loads(raw), "edge1")) == {"rid": "edge1", "text": "x"}
    batch = b'{"text": ["a", "b"], "rid": ["x", "y"]}'
    out = json.loads(splice_rid(batch, json.loads(batch), "edge1"))
    assert out == {"text": ["a", "b"], "rid": ["edge1-0", "edge1-1"]}


def test_a_body_rid_is_a_label_only_when_well_formed() -> None:
    assert label_from_body("bench-000001") == "bench-000001"
    for bad in (None, 7, ["a"], "", "has space", "x" * 129, "é"):
        assert label_from_body(bad) is None


def test_upstream_rid_is_the_edges_own() -> None:
    assert upstream_rid("abc", from_client=False) == "abc"  # the edge made the label itself
    chosen = upstream_rid("abc", from_client=True)
    assert chosen != "abc" and len(chosen) == 32


def test_request_id_header() -> None:
    assert request_id_from(b"req-1.2:3_x") == "req-1.2:3_x"
    generated = request_id_from(None)
    assert len(generated) == 32 and generated != request_id_from(None)
    for bad in (b"", b"has space", b'quote"', b"x" * 129):
        with pytest.raises(errors.InvalidRequest):
            request_id_from(bad)


def test_upstream_headers_carry_id_trace_and_early_data() -> None:
    headers = dict(
        upstream_headers(label="r1", early_data=True, traceparent=b"00-a-b-01", tracestate=None)
    )
    assert headers[b"x-request-id"] == b"r1"
    assert headers[b"early-data"] == b"1"
    assert headers[b"traceparent"] == b"00-a-b-01"
    plain = dict(upstream_headers(label="r1", early_data=False, traceparent=None, tracestate=None))
    assert b"early-data" not in plain and b"traceparent" not in plain
