"""Generated backend output through the edge's readers, in one process: every object that reads
what a backend streams or answers takes any bytes without raising, and those that only watch
a stream pass it on unchanged. An example costs a few milliseconds here, several times less
than through a real edge (`test_fuzz_upstream.py`), so this test runs more of them."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.models.tap import ShadowTap
from edge.policy.config import PolicyConfig
from edge.policy.stream import StreamRules
from edge.sse import SSEScanner, answer_of_body
from edge.state.response_builder import ResponseBuilder
from tests.edge.fuzzing import CHAT_CHUNK, EVENT, FUZZ, WHOLE_ANSWER, split

MANY = settings(FUZZ, max_examples=300)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
_TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


@st.composite
def streams(draw: st.DrawFn) -> list[bytes]:
    """A backend's stream (events, most of them chat chunks, maybe [DONE]) in pieces."""
    events = draw(st.lists(st.one_of(CHAT_CHUNK.map(_event), EVENT), max_size=10))
    return draw(split(b"".join(events)))


def _event(chunk: Any) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _events(out: bytes) -> list[dict[str, Any]]:
    """The Responses events in `out`, each checked to be `event: TYPE` then its JSON."""
    events = []
    for block in out.split(b"\n\n")[:-1]:
        name, data = block.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert name == b"event: " + event["type"].encode()
        events.append(event)
    return events


RULES = StreamRules.from_config(
    PolicyConfig.from_mapping({"stream_rules": [{"id": "leak", "patterns": ["zq+x"]}]})
)


@MANY
@given(st.sampled_from(ROUTES), streams())
def test_every_reader_takes_whatever_the_backend_streams(route: str, pieces: list[bytes]) -> None:
    """One stream through each reader of a backend's stream (drawn once: drawing is the cost)."""
    sent = b"".join(pieces)
    # the Responses translation (of a chat stream): well-formed events, one terminal one, last
    builder = ResponseBuilder({"model": "m"}, "resp_1", "m")
    out = b"".join(builder.feed(piece) for piece in pieces) + builder.finish()
    events = _events(out)
    assert events[0]["type"] == "response.created"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events if e["type"] in _TERMINAL] == [events[-1]["type"]]
    orjson.dumps(builder.stored())  # what a stored response keeps
    orjson.dumps(builder.reply())  # what a conversation keeps
    # the accounting scanner: counts, or nothing
    scanner = SSEScanner.for_route(route)
    assert all(scanner.feed(piece) >= 0 for piece in pieces)
    usage = scanner.usage()
    assert all(n is None or type(n) is int for n in (usage.prompt_tokens, usage.completion_tokens))
    # the stream guard (its rule all but never matches here) and a shadow tap that strips
    # nothing: they watch, and pass the stream on unchanged
    assert RULES is not None
    guard = RULES.guard(route)
    guarded = b"".join(guard.feed(piece) for piece in pieces) + guard.finish()
    assert guarded == sent or guard.cut == "leak"
    tap = ShadowTap(route, strip=False)
    assert b"".join(tap.feed(piece) for piece in pieces) + tap.finish() == sent
    tap.answer()


@MANY
@given(st.one_of(WHOLE_ANSWER.map(lambda a: json.dumps(a).encode()), st.binary(max_size=60)))
def test_a_whole_answer_is_translated_or_refused_whatever_the_backend_answers(body: bytes) -> None:
    builder = ResponseBuilder({"model": "m"}, "resp_1", "m")
    translated = builder.from_chat_body(body)
    if translated is not None:
        assert orjson.loads(translated)["object"] == "response"
        orjson.dumps(builder.reply())
    usage, text = answer_of_body(body)
    assert text is None or isinstance(text, str)
    assert all(n is None or type(n) is int for n in (usage.prompt_tokens, usage.completion_tokens))
