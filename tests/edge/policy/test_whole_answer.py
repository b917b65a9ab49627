"""Stream rules over answers asked for whole (`stream: false`): the same patterns a stream is
cut on empty the matching choice, as unit checks of `filter_whole` and through the edge over
real sockets, on chat completions, completions, `/generate` and `/v1/responses`."""

from __future__ import annotations

import json
from typing import Any

import httpx

from edge.policy.config import PolicyConfig
from edge.policy.stream import StreamRules
from edge.policy.whole_answer import filter_whole
from tests.edge.conftest import (
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
}
SECRET = "here: -----BEGIN PRIVATE KEY-----\nMIIE"
RULES = StreamRules.from_config(PolicyConfig.from_mapping(POLICY))
assert RULES is not None


def chat_answer(*messages: dict[str, Any]) -> dict[str, Any]:
    choices = [
        {"index": i, "message": m, "finish_reason": "stop",
         "logprobs": {"content": [{"token": "BEGIN", "logprob": -0.1}]}}
        for i, m in enumerate(messages)
    ]  # fmt: skip
    return {"id": "c1", "object": "chat.completion", "model": "tiny-model", "choices": choices,
            "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}  # fmt: skip


def filtered(route: str, answer: object) -> tuple[Any, str] | None:
    out = filter_whole(RULES, route, json.dumps(answer).encode())
    return None if out is None else (json.loads(out[0]), out[1])


def test_a_clean_answer_is_left_as_it_came() -> None:
    answer = chat_answer({"role": "assistant", "content": "nothing to see"})
    assert filtered("/v1/chat/completions", answer) is None


def test_the_matching_choice_is_emptied_and_the_others_kept() -> None:
    answer = chat_answer({"role": "assistant", "content": "fine"},
                         {"role": "assistant", "content": SECRET})  # fmt: skip
    out = filtered("/v1/chat/completions", answer)
    assert out is not None
    body, rule = out
    assert rule == "key-leak"
    kept, emptied = body["choices"]
    assert kept["message"]["content"] == "fine" and kept["finish_reason"] == "stop"
    assert emptied["message"] == {"role": "assistant", "content": ""}
    assert emptied["finish_reason"] == "content_filter" and emptied["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 9
    assert "PRIVATE" not in json.dumps(body)


def test_tool_arguments_reasoning_and_content_parts_are_read_folded() -> None:
    call = {"id": "t", "type": "function",
            "function": {"name": "save", "arguments": '{"k": "begin private key"}'}}  # fmt: skip
    for message in (
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "content": "ok", "reasoning_content": "BEGIN PRIVATE KEY"},
        {"role": "assistant", "content": [{"type": "text", "text": "ＢＥＧＩＮ PRIVATE KEY"}]},
    ):
        out = filtered("/v1/chat/completions", chat_answer(message))
        assert out is not None, message
        assert out[0]["choices"][0]["message"] == {"role": "assistant", "content": ""}


def test_completions_and_generate_answers() -> None:
    completion = {"choices": [{"index": 0, "text": SECRET, "finish_reason": "length",
                               "logprobs": {"tokens": ["BEGIN"]}}]}  # fmt: skip
    out = filtered("/v1/completions", completion)
    assert out is not None
    assert out[0]["choices"][0] == {"index": 0, "text": "", "finish_reason": "content_filter",
                                    "logprobs": None}  # fmt: skip
    generated = [
        {"text": "fine", "meta_info": {"id": "a", "finish_reason": {"type": "stop"}}},
        {"text": SECRET, "meta_info": {"id": "b", "finish_reason": {"type": "stop"},
                                       "output_token_logprobs": [[-0.1, 1, "BEGIN"]]}},
    ]  # fmt: skip
    out = filtered("/generate", generated)
    assert out is not None
    assert out[0][0]["text"] == "fine"
    assert out[0][1] == {"text": "", "meta_info": {"id": "b",
                         "finish_reason": {"type": "content_filter"}}}  # fmt: skip


def test_answers_of_other_routes_and_bodies_that_are_not_json_are_passed() -> None:
    assert filter_whole(RULES, "/v1/embeddings", json.dumps({"x": SECRET}).encode()) is None
    assert filter_whole(RULES, "/v1/chat/completions", SECRET.encode()) is None


def whole(answer: dict[str, Any]) -> Any:
    def reply(recorded: Recorded) -> Reply:
        return health_ok(recorded) or Reply(
            chunks=[json.dumps(answer).encode()], chunked=False,
            headers=[("content-type", "application/json")],
        )  # fmt: skip

    return reply


async def ask(
    answer: dict[str, Any], path: str, body: dict[str, Any]
) -> tuple[httpx.Response, str]:
    async with TinyUpstream(whole(answer)) as up:
        config = PolicyConfig.from_mapping(POLICY)
        async with run_edge(fast_config([up.url]), policies=config) as edge:
            async with client(edge) as http:
                response = await http.post(path, json=body)
            metrics = (await httpx.AsyncClient().get(f"{edge.admin_url}/metrics")).text
    return response, metrics


async def test_an_unstreamed_chat_answer_is_filtered_in_the_edge() -> None:
    answer = chat_answer({"role": "assistant", "content": SECRET})
    body = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}]}
    response, metrics = await ask(answer, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert "PRIVATE" not in response.text
    assert int(response.headers["content-length"]) == len(response.content)
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "content_filter" and choice["message"]["content"] == ""
    assert 'quicedge_policy_decisions_total{outcome="filtered",rule="key-leak"} 1.0' in metrics


async def test_an_unstreamed_responses_answer_is_incomplete_for_its_content() -> None:
    answer = chat_answer({"role": "assistant", "content": SECRET})
    response, _ = await ask(answer, "/v1/responses", {"model": "tiny-model", "input": "hi"})
    assert response.status_code == 200, response.text
    assert "PRIVATE" not in response.text
    obj = response.json()
    assert obj["status"] == "incomplete"
    assert obj["incomplete_details"] == {"reason": "content_filter"}


async def test_a_responses_stream_cut_by_a_rule_ends_incomplete_for_its_content() -> None:
    def chunk(content: str) -> bytes:
        obj = {
            "id": "c1",
            "object": "chat.completion.chunk",
            "model": "tiny-model",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        }
        return b"data: " + json.dumps(obj).encode() + b"\n\n"  # fmt: skip

    def reply(recorded: Recorded) -> Reply:
        chunks = [chunk("here: "), chunk("BEGIN PRIVATE"), chunk(" KEY"), b"data: [DONE]\n\n"]
        return health_ok(recorded) or Reply(
            headers=[("content-type", "text/event-stream")], chunks=chunks
        )

    async with TinyUpstream(reply) as up:
        config = PolicyConfig.from_mapping(POLICY)
        async with run_edge(fast_config([up.url]), policies=config) as edge, client(edge) as http:
            body = {"model": "tiny-model", "input": "hi", "stream": True}
            response = await http.post("/v1/responses", json=body)
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    last = events[-1]
    assert last["type"] == "response.incomplete", [e["type"] for e in events]
    assert last["response"]["incomplete_details"] == {"reason": "content_filter"}
