"""SSEScanner: the same answer whether the stream comes whole, byte by byte, or split anywhere."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest

from backends.pool import UpstreamPool, UpstreamResponse
from backends.sim import SimConfig, SimServer
from edge.relay import RelayResult, StreamRelay, relay_stream
from edge.sse import SSEScanner, Usage, answer_of_body, usage_from


def sse(*objs: object) -> bytes:
    out = b""
    for obj in objs:
        out += b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
    return out


def chat_chunk(delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
    return {
        "id": "r1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


CHAT_STREAM = sse(
    chat_chunk({"role": "assistant", "content": ""}),
    chat_chunk({"content": " Paris"}),
    chat_chunk({"content": " is"}),
    chat_chunk({}, finish="stop"),
    {
        "id": "r1",
        "choices": [],
        "usage": {
            "prompt_tokens": 36,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 30},
        },
    },
    b"[DONE]",
)


def meta(completion: int) -> dict[str, int]:
    return {"prompt_tokens": 5, "cached_tokens": 2, "completion_tokens": completion}


GENERATE_STREAM = sse(
    {"text": " Paris", "meta_info": meta(1)},
    {"text": " Paris.", "meta_info": meta(2)},
    b"[DONE]",
)

COMPLETIONS_STREAM = sse(
    {"choices": [{"index": 0, "text": "a"}], "usage": None},
    {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}], "usage": None},
    b"[DONE]",
)


def splits(stream: bytes) -> list[list[bytes]]:
    """Whole, one byte at a time, and cut at every single position."""
    ways = [[stream], [stream[i : i + 1] for i in range(len(stream))]]
    ways += [[stream[:i], stream[i:]] for i in range(1, len(stream))]
    return ways


CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"


@pytest.mark.parametrize(
    ("route", "stream", "content", "events", "usage"),
    [
        (CHAT, CHAT_STREAM, 2, 5, Usage(36, 30, 2)),
        (GENERATE, GENERATE_STREAM, 2, 2, Usage(5, 2, 2)),
        (COMPLETIONS, COMPLETIONS_STREAM, 2, 2, Usage()),
    ],
    ids=["chat", "generate", "completions"],
)
def test_every_split_gives_the_same_accounting(
    route: str, stream: bytes, content: int, events: int, usage: Usage
) -> None:
    for parts in splits(stream):
        scanner = SSEScanner.for_route(route)
        seen = sum(scanner.feed(part) for part in parts)
        assert seen == content
        assert scanner.events == events
        assert scanner.done
        assert scanner.usage() == usage
        assert scanner.error is None


def test_first_content_is_reported_in_the_chunk_that_completes_it() -> None:
    scanner = SSEScanner()
    role, first, _ = CHAT_STREAM.split(b"\n\n", 2)
    assert scanner.feed(role + b"\n\n") == 0  # the role chunk has empty content
    assert scanner.feed(first[:10]) == 0
    assert scanner.feed(first[10:] + b"\n") == 0
    assert scanner.feed(b"\n") == 1


def dumps_as(obj: object, *, spaced: bool) -> bytes:
    return json.dumps(obj, separators=(", ", ": ") if spaced else (",", ":")).encode()


def test_a_tool_calls_argument_deltas_are_its_tokens() -> None:
    """A call-only answer has no content: its arguments' deltas are what the first token and
    the gaps are measured on, in compact JSON (SGLang's) or spaced."""
    opening = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]}  # fmt: skip
    pieces = [{"tool_calls": [{"index": 0, "function": {"arguments": a}}]} for a in ('{"a', '":1}')]
    for spaced in (False, True):
        dumps = functools.partial(dumps_as, spaced=spaced)
        scanner = SSEScanner()
        assert scanner.feed(sse(dumps(chat_chunk({"role": "assistant", "content": ""})))) == 0
        assert scanner.feed(sse(dumps(chat_chunk(opening)))) == 0  # no argument text yet
        assert scanner.feed(sse(*(dumps(chat_chunk(p)) for p in pieces))) == 2
        assert scanner.feed(sse(dumps(chat_chunk({}, "tool_calls")), b"[DONE]")) == 0
        assert scanner.content_events == 2 and scanner.done
    completions = SSEScanner.for_route("/v1/completions")  # not a chat stream: text only
    assert completions.feed(sse(json.dumps(chat_chunk(pieces[0])).encode())) == 0


def test_a_reasoning_models_thinking_deltas_are_its_tokens() -> None:
    """SGLang with a reasoning parser streams the thinking as `reasoning_content` first: the
    client gets those tokens, so the first of them is the first token."""
    for spaced in (False, True):
        scanner = SSEScanner()
        thinking = [chat_chunk({"reasoning_content": t, "content": None}) for t in ("Hm", ", so")]
        answer = chat_chunk({"reasoning_content": None, "content": "Paris"})
        assert scanner.feed(sse(dumps_as(thinking[0], spaced=spaced))) == 1
        assert scanner.feed(sse(dumps_as(thinking[1], spaced=spaced))) == 1
        assert scanner.feed(sse(dumps_as(answer, spaced=spaced), b"[DONE]")) == 1
        assert scanner.content_events == 3
        assert scanner.final()[1] == "Paris"  # the answer's text, without the thinking


def test_trailing_partial_event_is_kept_not_counted() -> None:
    scanner = SSEScanner.for_route(GENERATE)
    assert scanner.feed(GENERATE_STREAM + b'data: {"text": "x"') == 2
    assert scanner.feed(b"}") == 0
    assert scanner.events == 2
    assert scanner.feed(b"\n\n") == 1
    assert scanner.events == 3


def test_whitespace_in_json_is_understood() -> None:
    scanner = SSEScanner()
    assert scanner.feed(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n') == 1
    assert scanner.feed(b'data: {"choices": [{"delta": {"content": ""}}]}\n\n') == 0


def test_error_event_is_recorded() -> None:
    scanner = SSEScanner()
    scanner.feed(sse({"error": {"message": "context too long", "code": 400}}, b"[DONE]"))
    assert scanner.error == {"message": "context too long", "code": 400}
    assert scanner.done


def test_comments_and_other_fields_are_relayed_not_counted() -> None:
    scanner = SSEScanner()
    assert scanner.feed(b": keep-alive\n\nevent: ping\nid: 3\n\n") == 0
    assert scanner.events == 0


def test_usage_from_openai_and_native() -> None:
    assert usage_from({"usage": {"prompt_tokens": 3, "completion_tokens": 1}}) == Usage(3, None, 1)
    assert usage_from({"meta_info": {"prompt_tokens": 9, "cached_tokens": 4}}) == Usage(9, 4, None)
    assert usage_from([1, 2]) == Usage()
    assert usage_from({"usage": {"prompt_tokens": True}}) == Usage()


def test_generate_stream_gives_the_whole_text_for_free() -> None:
    scanner = SSEScanner.for_route(GENERATE)
    scanner.feed(GENERATE_STREAM)
    assert scanner.final() == (Usage(5, 2, 2), " Paris.")
    chat = SSEScanner()
    chat.feed(CHAT_STREAM)
    assert chat.final()[1] == " Paris is"  # deltas joined, decoded once at the end


def test_chat_deltas_with_escapes_join_into_the_text_at_any_split() -> None:
    # json.dumps escapes quotes, backslashes, newlines and non-ASCII (the emoji as a surrogate
    # pair); each escape lies within one delta.
    pieces = ['say "hi"', " caf\u00e9 \\ ", "é\n", "😀"]
    stream = sse(*(chat_chunk({"content": p}) for p in pieces), b"[DONE]")
    expected = "".join(pieces)
    whole = SSEScanner()
    whole.feed(stream)
    assert whole.final()[1] == expected
    bytewise = SSEScanner()
    for i in range(len(stream)):
        bytewise.feed(stream[i : i + 1])
    assert bytewise.final()[1] == expected


def test_an_answer_too_long_to_learn_is_not_kept() -> None:
    chunk = sse(chat_chunk({"content": "x" * 4096}))
    scanner = SSEScanner()
    # 400 KiB of deltas, over the 256 KiB kept for routing feedback: all still counted.
    assert sum(scanner.feed(chunk) for _ in range(100)) == 100
    scanner.feed(sse(b"[DONE]"))
    assert scanner.final()[1] is None


def test_text_that_looks_like_the_protocol_is_only_text() -> None:
    """Generated text that says `data: [DONE]` or `"content":"` is escaped text, not framing."""
    tricky = ["data: [DONE]", '"content":"x"', "\n\ndata: [DONE]\n\n"]
    stream = sse(*(chat_chunk({"content": p}) for p in tricky))
    for parts in splits(stream):
        scanner = SSEScanner.for_route(CHAT)
        assert sum(scanner.feed(part) for part in parts) == 3
        assert not scanner.done and scanner.events == 3
        scanner.feed(sse(b"[DONE]"))
        assert scanner.done and scanner.final()[1] == "".join(tricky)


def test_many_events_in_one_chunk_count_each() -> None:
    stream = sse(*(chat_chunk({"content": f" t{i}"}) for i in range(50)), b"[DONE]")
    scanner = SSEScanner.for_route(CHAT)
    assert scanner.feed(stream) == 50
    assert scanner.done and scanner.events == 50
    assert scanner.final()[1] == "".join(f" t{i}" for i in range(50))


def test_whole_answers_give_usage_and_text() -> None:
    chat = {
        "choices": [{"message": {"role": "assistant", "content": "Paris."}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2},
    }
    assert answer_of_body(json.dumps(chat).encode()) == (Usage(9, None, 2), "Paris.")
    completion = {"choices": [{"text": "abc"}]}
    assert answer_of_body(json.dumps(completion).encode()) == (Usage(), "abc")
    assert answer_of_body(b"not json") == (Usage(), None)


PACED = {"profile": "h100-llama3-8b", "time_scale": 0.2}
"""Tokens a few ms apart: those after the first arrive while the relay waits, so the pool's
read callback writes them."""


@asynccontextmanager
async def generate_stream(
    tokens: int, on_head: Callable[[UpstreamResponse], None] | None = None, **sim: Any
) -> AsyncIterator[tuple[UpstreamPool, str, UpstreamResponse]]:
    """A streamed /generate answer of `tokens` tokens from a stand-in, its head read."""
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": tokens}}
    async with SimServer(SimConfig(name="w", port=0, **sim)) as server:
        pool = UpstreamPool()
        try:
            response = await pool.request(
                server.url, "POST", "/generate", headers=[], body=json.dumps(body).encode(),
                on_head=on_head,
            )  # fmt: skip
            yield pool, server.url, response
        finally:
            await pool.aclose()


class FailingWriter:
    """A body writer that breaks on its second chunk, as a bug in a listener would."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write_head(self, start: Any, body: bytes = b"", more: bool = True) -> bool:
        return self.write_body(body, more)

    def write_body(self, body: bytes, more: bool = True) -> bool:
        if self.chunks:
            raise RuntimeError("the listener broke")
        self.chunks.append(body)
        return True

    async def drained(self) -> None:
        return None


async def test_a_body_writer_failing_in_the_read_callback_fails_the_relay() -> None:
    """An error raised where the pool's read callback writes is the relay's error, at once;
    the upstream request is aborted, nothing hangs."""
    async with generate_stream(64, **PACED) as (pool, url, response):
        writer = FailingWriter()

        async def send(message: Any) -> None:
            return None

        with pytest.raises(RuntimeError, match="the listener broke"):
            await asyncio.wait_for(
                relay_stream(response, send, RelayResult(), route=GENERATE, writer=writer), 10
            )
        assert len(writer.chunks) == 1
        assert not response.complete
        assert pool.stats().backends[url].active == 0  # its connection was closed


class RecordingWriter:
    """A body writer that keeps what it was given, and what had happened by then."""

    def __init__(self, completed: list[bool] | None = None) -> None:
        self.heads: list[tuple[Any, int]] = []  # the start message, and how many writes before
        self.writes: list[tuple[bytes, bool, bool]] = []  # body, more, completed before it
        self._completed = completed if completed is not None else []

    def write_head(self, start: Any, body: bytes = b"", more: bool = True) -> bool:
        self.heads.append((start, len(self.writes)))
        return self.write_body(body, more)

    def write_body(self, body: bytes, more: bool = True) -> bool:
        self.writes.append((body, more, bool(self._completed)))
        return True

    async def drained(self) -> None:
        return None


async def test_the_stream_ends_from_the_read_callback_with_its_last_chunk() -> None:
    """When the backend's body ends while the relay waits, the read callback writes the last
    chunk and the stream's end together (the client has its whole answer before the relay's
    task wakes), calls `on_complete` first, and gives the connection back to the pool."""
    async with generate_stream(8, **PACED) as (pool, url, response):
        completed: list[bool] = []
        writer = RecordingWriter(completed)
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        result = RelayResult()
        await asyncio.wait_for(
            relay_stream(
                response, send, result, route=GENERATE, writer=writer,
                on_complete=lambda: completed.append(True),
            ),
            10,
        )  # fmt: skip
        assert sent == []  # nothing went through the task's ASGI send
        *chunks, (last, more, was_completed) = writer.writes
        assert all(m and not c for _, m, c in chunks)
        assert not more and was_completed and last.endswith(b"data: [DONE]\n\n")
        assert completed == [True] and response.complete
        assert result.text and result.delays  # tokens were relayed and accounted
        assert pool.stats().backends[url].idle == 1


async def test_an_answer_that_came_with_its_head_goes_out_in_one_write() -> None:
    """The whole answer arrived before the relay began: head, body and end in one write."""
    async with generate_stream(4, profile="instant") as (pool, url, response):
        await asyncio.sleep(0.2)  # the rest of the answer arrives meanwhile
        writer = RecordingWriter()
        start = {"type": "http.response.start", "status": 200, "headers": []}
        result = RelayResult()
        await relay_stream(response, _no_send, result, route=GENERATE, writer=writer,
                           start=start)  # fmt: skip
        assert writer.heads == [(start, 0)]
        ((data, more, _),) = writer.writes
        assert not more and data.endswith(b"data: [DONE]\n\n") and data.count(b"data:") == 5
        assert result.first_client is not None and response.complete
        assert pool.stats().backends[url].idle == 1


async def test_without_a_body_writer_the_head_is_an_asgi_message() -> None:
    async with generate_stream(2, profile="instant") as (_, _, response):
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        start = {"type": "http.response.start", "status": 200, "headers": []}
        await relay_stream(response, send, RelayResult(), route=GENERATE, start=start)
        assert sent[0] is start and sent[-1] == {
            "type": "http.response.body", "body": b"", "more_body": False,
        }  # fmt: skip
        assert b"".join(m["body"] for m in sent[1:]).endswith(b"data: [DONE]\n\n")


async def _no_send(message: Any) -> None:
    raise AssertionError(f"sent as an ASGI message: {message}")


def begun(
    relay: StreamRelay, start: Any, tokens: int, **sim: Any
) -> AbstractAsyncContextManager[tuple[UpstreamPool, str, UpstreamResponse]]:
    """`generate_stream` with the relay begun from the read that brought the head."""
    return generate_stream(tokens, on_head=lambda r: relay.begin(r, start), **sim)


START = {"type": "http.response.start", "status": 200, "headers": []}


async def test_the_head_goes_out_from_the_read_callback_that_brought_it() -> None:
    """`begin`, as the pool's `on_head`, writes the head (with the body bytes that came with it)
    before the request's task resumes; `run` then relays the rest without sending it again."""
    writer = RecordingWriter()
    result = RelayResult()
    relay = StreamRelay(result, route=GENERATE, writer=writer)
    async with begun(relay, START, 8, **PACED) as (pool, url, response):
        assert writer.heads == [(START, 0)]  # before pool.request returned
        assert relay.began and relay.began_at is not None
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        await asyncio.wait_for(relay.run(response, send, START), 10)
        assert sent == [] and writer.heads == [(START, 0)]
        body = b"".join(data for data, _, _ in writer.writes)
        assert body.count(b"data:") == 9 and body.endswith(b"data: [DONE]\n\n")
        assert result.first_client is not None and result.text
        assert pool.stats().backends[url].idle == 1


async def test_a_head_the_writer_refuses_in_the_callback_fails_the_relay() -> None:
    """A write that raises inside the read callback is kept, the upstream request aborted, and
    `run` raises it in the request's task, where the app can answer for it."""

    class RefusingWriter(RecordingWriter):
        def write_head(self, start: Any, body: bytes = b"", more: bool = True) -> bool:
            raise ValueError("a header the listener refuses")

    relay = StreamRelay(RelayResult(), route=GENERATE, writer=RefusingWriter())
    async with begun(relay, START, 8, **PACED) as (pool, url, response):
        with pytest.raises(ValueError, match="a header the listener refuses"):
            await asyncio.wait_for(relay.run(response, _no_send, START), 10)
        assert not response.complete
        assert pool.stats().backends[url].active == 0  # its connection was closed


@pytest.mark.parametrize("ending", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_a_stream_with_cr_line_ends_is_scanned_as_it_comes(ending: bytes) -> None:
    """Only `\\n\\n` ended an event: a CRLF stream (sse-starlette's) was held whole until it
    ended, its first token with it. It passes with LF line ends, at every split."""
    stream = CHAT_STREAM.replace(b"\n", ending)
    for parts in splits(stream):
        scanner = SSEScanner.for_route(CHAT)
        passed = b"".join(scanner.take(part)[0] for part in parts) + scanner.rest()
        assert passed == CHAT_STREAM
        assert scanner.content_events == 2 and scanner.events == 5 and scanner.done
    role, first, _ = stream.split(ending * 2, 2)
    scanner = SSEScanner.for_route(CHAT)
    assert scanner.take(role + ending * 2 + first + ending * 2)[1] == 1  # at its blank line
