"""The response cache and answers that are not the model's whole answer: one its backend
aborted before a usage chunk, one a stream rule cut; and the stream rules over a whole answer
replayed from the cache."""

from __future__ import annotations

import json
from typing import Any

from edge.policy.config import PolicyConfig
from edge.policy.gateway import PolicyGateway
from tests.edge.conftest import Reply, TinyUpstream, client, fast_config, health_ok, run_edge
from tests.edge.state.helpers import CHAT, ChatUpstream, chat_chunks, state

USE = {"x-quicedge-cache": "use"}
GREEDY = {"model": "default", "messages": [{"role": "user", "content": "Cache me"}],
          "max_tokens": 8, "temperature": 0}  # fmt: skip
KEY_RULE = {"id": "key-leak", "patterns": ["BEGIN PRIVATE KEY"], "literal": True}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def aborted_with_usage() -> list[bytes]:
    """A chat stream SGLang aborted (`/abort_request`, a drain) with `include_usage`: its
    finish chunk says `abort`, then comes the usage chunk (no choices), then `[DONE]`."""
    chunks = chat_chunks(["half"])
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    finish = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]}
    usage = {**head, "choices": [],
             "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}  # fmt: skip
    return [*chunks[:2], _sse(finish), _sse(usage), b"data: [DONE]\n\n"]


async def test_an_aborted_stream_with_a_usage_chunk_is_not_stored() -> None:
    def reply(n: int, recorded: Any) -> Reply:
        chunks = aborted_with_usage() if n == 0 else chat_chunks(["whole"])
        return Reply(headers=[("content-type", "text/event-stream")], chunks=chunks)

    upstream = ChatUpstream(reply)
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], state=state(cache={"allow_tenants": ["*"]}))
        async with run_edge(config) as edge, client(edge) as http:
            body = {**GREEDY, "stream": True, "stream_options": {"include_usage": True}}
            seen = []
            for _ in range(3):
                response = await http.post(CHAT, headers=USE, json=body)
                assert response.status_code == 200
                seen.append((response.headers["x-quicedge-cache"], b'"abort"' in response.content))
    assert seen == [("miss", True), ("miss", False), ("hit-l1", False)]
    assert len(upstream.chats) == 2


def leaky(recorded: Any) -> Reply:
    """A chat answer that leaks a key, streamed or whole as asked."""
    found = health_ok(recorded)
    if found is not None:
        return found
    text = ["-----BEGIN PRIVATE KEY", "----- abc"]
    if json.loads(recorded.body).get("stream"):
        return Reply(headers=[("content-type", "text/event-stream")], chunks=chat_chunks(text))
    whole = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                          "finish_reason": "stop"}]}  # fmt: skip
    return Reply(headers=[("content-type", "application/json")], chunked=False,
                 chunks=[json.dumps(whole).encode()])  # fmt: skip


async def _swap(edge: Any, rules: list[dict[str, Any]]) -> None:
    policy = PolicyConfig.from_mapping({"stream_rules": rules})
    await edge.wiring.swap_gateway(PolicyGateway.from_config(policy))


async def test_an_answer_a_stream_rule_cut_is_not_stored() -> None:
    """A cut answer is the policy's, not the model's: stored, it would outlive the rule that
    cut it (a reload that drops the rule would still get the cut answer)."""
    requests: list[Any] = []

    def script(recorded: Any) -> Reply:
        if health_ok(recorded) is None:
            requests.append(recorded)
        return leaky(recorded)

    async with TinyUpstream(script) as up:
        config = fast_config([up.url], state=state(cache={"allow_tenants": ["*"]}))
        async with run_edge(config) as edge, client(edge) as http:
            await _swap(edge, [KEY_RULE])
            for stream in (True, False):
                body = {**GREEDY, "stream": stream}
                cut = await http.post(CHAT, headers=USE, json=body)
                assert cut.status_code == 200 and b"content_filter" in cut.content
                assert b"PRIVATE KEY" not in cut.content
                again = await http.post(CHAT, headers=USE, json=body)
                assert again.headers["x-quicedge-cache"] == "miss"  # not stored
            await _swap(edge, [])
            for stream in (True, False):
                body = {**GREEDY, "stream": stream}
                whole = await http.post(CHAT, headers=USE, json=body)
                assert whole.headers["x-quicedge-cache"] == "miss"
                assert b"PRIVATE KEY" in whole.content and b"content_filter" not in whole.content
                hit = await http.post(CHAT, headers=USE, json=body)
                assert hit.headers["x-quicedge-cache"] == "hit-l1"
                assert hit.content == whole.content
    assert len(requests) == 6


async def test_a_whole_answer_replayed_meets_the_stream_rules_in_force_now() -> None:
    """A whole answer stored before a reload added a stream rule is filtered when replayed,
    as a fresh whole answer is (`edge.policy.whole_answer`): a hit is no way around it."""
    async with TinyUpstream(leaky) as up:
        config = fast_config([up.url], state=state(cache={"allow_tenants": ["*"]}))
        async with run_edge(config) as edge, client(edge) as http:
            stored = await http.post(CHAT, headers=USE, json=GREEDY)
            assert stored.headers["x-quicedge-cache"] == "miss"
            assert b"PRIVATE KEY" in stored.content
            await _swap(edge, [KEY_RULE])
            hit = await http.post(CHAT, headers=USE, json=GREEDY)
            assert hit.status_code == 200 and hit.headers["x-quicedge-cache"] == "hit-l1"
            assert b"PRIVATE KEY" not in hit.content
            answer = hit.json()
            assert answer["choices"][0]["finish_reason"] == "content_filter"
            assert int(hit.headers["content-length"]) == len(hit.content)
