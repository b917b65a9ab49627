"""Stream rules in the edge, over real sockets, in front of a scripted upstream whose chunks are
written byte for byte: choices and tool calls interleaved as `n` > 1 streams them, and the
decision recorded where a client, the metrics and the audit look."""

from __future__ import annotations

import json
from typing import Any

import httpx

from edge.policy.config import PolicyConfig
from tests.edge.conftest import (
    LISTENERS,
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)

POLICY: dict[str, Any] = {
    "stream_rules": [{"id": "key-leak", "patterns": ["BEGIN PRIVATE KEY"], "literal": True}],
    "stream_hold": True,
}


def chat_chunk(index: int, **delta: Any) -> bytes:
    choice = {"index": index, "delta": delta, "finish_reason": None}
    obj = {"id": "c1", "object": "chat.completion.chunk", "model": "tiny-model",
           "choices": [choice]}  # fmt: skip
    return b"data: " + json.dumps(obj).encode()


def scripted(events: list[bytes], end: bytes = b"\n\n") -> Any:
    """An upstream that streams `events`, each followed by `end`, then `[DONE]`."""

    def answer(recorded: Recorded) -> Reply:
        chunks = [e + end for e in events] + [b"data: [DONE]" + end]
        return health_ok(recorded) or Reply(
            headers=[("content-type", "text/event-stream")], chunks=chunks, delay=0.005
        )

    return answer


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny-model", "stream": True,
            "messages": [{"role": "user", "content": "hi"}], **extra}  # fmt: skip


def by_index(body: bytes) -> tuple[dict[int, str], dict[int, str], set[str]]:
    """Each choice's text and each tool call's arguments as a client reassembles them, and the
    finish reasons."""
    texts: dict[int, str] = {}
    calls: dict[int, str] = {}
    reasons: set[str] = set()
    for line in body.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:])["choices"]:
            delta = c.get("delta") or {}
            texts[c["index"]] = texts.get(c["index"], "") + (delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                arguments = call["function"].get("arguments", "")
                calls[call["index"]] = calls.get(call["index"], "") + arguments
            if c.get("finish_reason"):
                reasons.add(c["finish_reason"])
    return texts, calls, reasons


async def post(events: list[bytes], body: dict[str, Any], listener: str, end: bytes = b"\n\n",
               policy: dict[str, Any] = POLICY) -> tuple[httpx.Response, str]:  # fmt: skip
    config = PolicyConfig.from_mapping(policy)
    async with TinyUpstream(scripted(events, end)) as up:
        async with run_edge(fast_config([up.url]), policies=config, listener=listener) as edge:
            async with client(edge) as http:
                response = await http.post("/v1/chat/completions", json=body)
            metrics = (await httpx.AsyncClient().get(f"{edge.admin_url}/metrics")).text
    return response, metrics


FILTERED = 'quicedge_policy_decisions_total{outcome="filtered",rule="key-leak"} 1.0'


@LISTENERS
async def test_interleaved_choices_cannot_split_a_match_past_the_rule(listener: str) -> None:
    events = [chat_chunk(0, content="BEGIN "), chat_chunk(1, content="Sure"),
              chat_chunk(0, content="PRIVATE "), chat_chunk(1, content="!"),
              chat_chunk(0, content="KEY"), chat_chunk(1, content=" bye")]  # fmt: skip
    response, metrics = await post(events, chat(n=2), listener)
    texts, _, reasons = by_index(response.content)
    assert response.status_code == 200 and reasons == {"content_filter"}
    assert "BEGIN" not in response.text and texts.get(0, "") == ""
    assert FILTERED in metrics


@LISTENERS
async def test_interleaved_tool_calls_cannot_split_a_match_past_the_rule(listener: str) -> None:
    def call(index: int, arguments: str) -> bytes:
        function = {"name": f"f{index}", "arguments": arguments}
        return chat_chunk(0, tool_calls=[{"index": index, "type": "function",
                                          "function": function}])  # fmt: skip

    events = [call(0, '{"k": "BEGIN '), call(1, "{}"), call(0, "PRIVATE KEY"), call(0, '"}')]
    response, metrics = await post(events, chat(), listener)
    _, calls, reasons = by_index(response.content)
    assert reasons == {"content_filter"} and "PRIVATE" not in response.text
    assert calls.get(0, "") == "" and FILTERED in metrics


@LISTENERS
async def test_crlf_events_are_checked(listener: str) -> None:
    """sse-starlette servers end events with `\\r\\n\\r\\n`: the rule still runs on each."""
    events = [chat_chunk(0, content=t) for t in ("tok ", "tok ", "BEGIN PRIV", "ATE KEY", "!")]
    response, metrics = await post(events, chat(), listener, end=b"\r\n\r\n",
                                   policy={**POLICY, "stream_hold": False})  # fmt: skip
    texts, _, reasons = by_index(response.content)
    assert reasons == {"content_filter"} and "ATE KEY" not in response.text
    assert texts[0] == "tok tok BEGIN PRIV" and FILTERED in metrics


@LISTENERS
async def test_a_last_event_without_its_blank_line_is_checked(listener: str) -> None:
    def answer(recorded: Recorded) -> Reply:
        chunks = [
            chat_chunk(0, content="tok ") + b"\n\n",
            chat_chunk(0, content="BEGIN ") + b"\n\n",
            chat_chunk(0, content="PRIVATE KEY") + b"\n",
        ]  # no blank line, no [DONE]
        return health_ok(recorded) or Reply(
            headers=[("content-type", "text/event-stream")], chunks=chunks, delay=0.005
        )  # fmt: skip

    config = PolicyConfig.from_mapping({**POLICY, "stream_hold": False})
    async with TinyUpstream(answer) as up:
        async with run_edge(fast_config([up.url]), policies=config, listener=listener) as edge:
            async with client(edge) as http:
                response = await http.post("/v1/chat/completions", json=chat())
            metrics = (await httpx.AsyncClient().get(f"{edge.admin_url}/metrics")).text
    assert "PRIVATE KEY" not in response.text
    assert response.content.endswith(b"data: [DONE]\n\n") and b"content_filter" in response.content
    assert FILTERED in metrics  # the decision is the stream's, as for a cut in mid-stream


WORD: dict[str, Any] = {"stream_rules": [{"id": "kill-word", "patterns": [r"\bkill\b"]}]}


def finish_chunk() -> bytes:
    choice = {"index": 0, "delta": {}, "finish_reason": "stop"}
    obj = {"id": "c1", "object": "chat.completion.chunk", "model": "tiny-model",
           "choices": [choice]}  # fmt: skip
    return b"data: " + json.dumps(obj).encode()


@LISTENERS
async def test_a_word_boundary_at_a_chunks_end_waits_for_the_next_text(listener: str) -> None:
    """`\\bkill\\b` against `kill` + `ing`, a common token split: the end of a chunk is not the
    end of the text, so the `\\b` there is decided by the text that follows, as it is over the
    whole answer; a `kill` that ends the answer still ends the stream."""
    events = [chat_chunk(0, content=t) for t in ("The job is ", "kill", "ing ", "me")]
    response, metrics = await post([*events, finish_chunk()], chat(), listener, policy=WORD)
    texts, _, reasons = by_index(response.content)
    assert texts[0] == "The job is killing me" and reasons == {"stop"}
    assert "kill-word" not in metrics
    events = [chat_chunk(0, content=t) for t in ("Please ", "kill")]
    response, metrics = await post([*events, finish_chunk()], chat(), listener, policy=WORD)
    _, _, reasons = by_index(response.content)
    assert reasons == {"content_filter"}
    assert 'quicedge_policy_decisions_total{outcome="filtered",rule="kill-word"} 1.0' in metrics


@LISTENERS
async def test_a_generate_stream_of_segments_is_watched(listener: str) -> None:
    """`/generate` from an SGLang run with `--stream-output`: each event's text is the new
    segment, not the text so far; the secret across segments still ends the stream."""

    def segment(text: str) -> bytes:
        return b"data: " + json.dumps({"text": text, "meta_info": {"id": "g1"}}).encode()

    def answer(recorded: Recorded) -> Reply:
        chunks = [segment(t) + b"\n\n" for t in ("ok, ", "BEGIN ", "PRIVATE ", "KEY", "!")]
        return health_ok(recorded) or Reply(
            headers=[("content-type", "text/event-stream")],
            chunks=[*chunks, b"data: [DONE]\n\n"], delay=0.005,
        )  # fmt: skip

    config = PolicyConfig.from_mapping(POLICY)
    async with TinyUpstream(answer) as up:
        async with run_edge(fast_config([up.url]), policies=config, listener=listener) as edge:
            async with client(edge) as http:
                body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 8}}
                response = await http.post("/generate", json=body)
            metrics = (await httpx.AsyncClient().get(f"{edge.admin_url}/metrics")).text
    assert response.status_code == 200 and b"content_filter" in response.content
    assert b"PRIVATE" not in response.content and FILTERED in metrics
