"""The edge asks every OpenAI stream's backend for its usage chunk (`forward.ask_usage`) and
keeps that chunk from a client that did not ask (`SSEScanner(strip_usage=True)`): the counts
are read, the client's stream is the one it asked for, at any split of the bytes."""

from __future__ import annotations

import json

import orjson
import pytest

from edge.sse import SSEScanner, Usage
from edge.stages.forward import ask_usage, splice_rid
from tests.edge.test_relay_scanner import CHAT_STREAM, chat_chunk, splits, sse

USAGE = {
    "prompt_tokens": 36,
    "completion_tokens": 2,
    "prompt_tokens_details": {"cached_tokens": 30},
}


def _asked(body: dict[str, object]) -> dict[str, object] | None:
    payload = splice_rid(json.dumps(body).encode(), body, "e1")
    asked = ask_usage(payload, body)
    return None if asked is None else orjson.loads(asked)


def test_a_stream_without_options_is_asked_for_usage_and_keeps_its_fields() -> None:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    assert _asked(body) == {**body, "rid": "e1", "stream_options": {"include_usage": True}}
    spaced = b'  \n{ "stream" : true }'
    asked = ask_usage(spaced, {"stream": True})
    assert asked is not None
    assert orjson.loads(asked) == {"stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    "options",
    [None, {}, {"include_usage": False}, {"continuous_usage_stats": True}],
)
def test_options_without_usage_get_it_and_keep_the_rest(options: object) -> None:
    body = {"model": "m", "stream": True, "prompt": "x", "stream_options": options}
    want = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    assert _asked(body) == {**body, "rid": "e1", "stream_options": want}


@pytest.mark.parametrize("options", [{"include_usage": True}, "yes", [1], {"include_usage": 1}])
def test_options_that_ask_already_or_are_not_an_object_are_left_alone(options: object) -> None:
    """Asked already: the client keeps its usage chunk. Not an object (or a value the backend
    reads its own way): the backend's answer, a 400 or the chunk, is the client's."""
    assert _asked({"model": "m", "stream": True, "stream_options": options}) is None


def test_the_usage_chunk_is_read_and_not_passed_on_at_any_split() -> None:
    expected = CHAT_STREAM.replace(sse({"id": "r1", "choices": [], "usage": USAGE}), b"")
    assert expected != CHAT_STREAM and expected.endswith(b"data: [DONE]\n\n")
    for parts in splits(CHAT_STREAM):
        scanner = SSEScanner.for_route("/v1/chat/completions", strip_usage=True)
        out = b"".join(scanner.take(part)[0] for part in parts) + scanner.rest()
        assert out == expected
        assert scanner.usage() == Usage(36, 30, 2)


def test_only_the_usage_chunk_goes_and_spaced_json_is_understood() -> None:
    """Text that mentions the marker is text; a usage chunk written with spaces is still one."""
    mention = chat_chunk({"content": '"choices":[] and "choices": []'})
    usage = b'{"id": "r1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}'
    stream = sse(mention, usage, b"[DONE]")
    scanner = SSEScanner.for_route("/v1/chat/completions", strip_usage=True)
    out, content = scanner.take(stream)
    assert out == sse(mention, b"[DONE]") and content == 1
    assert scanner.usage() == Usage(3, None, 1)


def test_without_strip_the_usage_chunk_is_relayed() -> None:
    scanner = SSEScanner.for_route("/v1/chat/completions")
    assert scanner.take(CHAT_STREAM)[0] == CHAT_STREAM


def test_a_negative_count_is_unknown_not_a_credit() -> None:
    """A backend reporting `completion_tokens: -1000` would have given the tenant 1,000 tokens
    back when its answer was debited."""
    bad = {"id": "r1", "choices": [], "usage": {"prompt_tokens": -5, "completion_tokens": -1000}}
    scanner = SSEScanner.for_route("/v1/chat/completions")
    scanner.take(sse(chat_chunk({"content": "x"}), bad, b"[DONE]"))
    assert scanner.usage() == Usage(None, None, None)
