"""`--reasoning-tokens N`: the stand-in thinks N tokens before each chat answer and sends them as
`reasoning_content`, as SGLang does for a reasoning model with `--reasoning-parser`. Real
SimServers over real sockets."""

from __future__ import annotations

from typing import Any

import httpx

from tests.backends.sim.conftest import MakeSim, stream_post

CHAT = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 12}


def delta_of(event: Any) -> dict[str, Any]:
    """The first choice's delta of a chunk (empty for `[DONE]` and the usage chunk)."""
    if not isinstance(event, dict) or not event.get("choices"):
        return {}
    return dict(event["choices"][0]["delta"])


def deltas(events: list[Any], field: str) -> list[str]:
    return [d[field] for d in map(delta_of, events) if d.get(field)]


async def test_the_first_tokens_are_thinking_then_the_answer(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    plain = await make_sim()
    thinker = await make_sim(reasoning_tokens=5)
    url = "/v1/chat/completions"
    whole = (await client.post(thinker.url + url, json=CHAT)).json()
    message, usage = whole["choices"][0]["message"], whole["usage"]
    reference = (await client.post(plain.url + url, json=CHAT)).json()["choices"][0]["message"]
    # The same tokens a model without thinking generates, the first five as thinking.
    assert message["reasoning_content"] + message["content"] == reference["content"]
    assert message["reasoning_content"] and message["content"]
    assert usage["reasoning_tokens"] == 5 and usage["completion_tokens"] == 12
    _, events = await stream_post(client, thinker.url + url, {**CHAT, "stream": True})
    thought, said = deltas(events, "reasoning_content"), deltas(events, "content")
    assert "".join(thought) == message["reasoning_content"]
    assert "".join(said) == message["content"]
    kinds = [("thinking" if d.get("reasoning_content") else "answer") for d in map(delta_of, events)
             if d.get("reasoning_content") or d.get("content")]  # fmt: skip
    assert kinds == sorted(kinds, reverse=True)  # all the thinking, then all the answer
    # Cut by max_tokens while thinking: thinking only, no answer.
    short = (await client.post(thinker.url + url, json={**CHAT, "max_tokens": 3})).json()
    assert short["choices"][0]["finish_reason"] == "length"
    assert short["choices"][0]["message"]["content"] == ""
    assert short["usage"]["reasoning_tokens"] == 3
    assert (await client.post(plain.url + url, json=CHAT)).json()["usage"]["reasoning_tokens"] == 0


async def test_a_tool_call_or_a_fixed_format_does_not_think(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    thinker = await make_sim(reasoning_tokens=5)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    url = thinker.url + "/v1/chat/completions"
    called = await client.post(url, json={**CHAT, "tools": [tool], "tool_choice": "required"})
    assert called.json()["choices"][0]["message"]["reasoning_content"] is None
    fmt = {"type": "json_object"}
    fixed = (await client.post(url, json={**CHAT, "response_format": fmt})).json()
    assert fixed["choices"][0]["message"]["content"] == "{}"
    assert fixed["choices"][0]["message"]["reasoning_content"] is None


async def test_a_request_turns_the_thinking_off_as_sglang_lets_it(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    thinker = await make_sim(reasoning_tokens=5)
    url = thinker.url + "/v1/chat/completions"

    async def thought(extra: dict[str, Any]) -> int:
        reply = await client.post(url, json={**CHAT, **extra})
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["reasoning_tokens"])

    assert await thought({"reasoning_effort": "high"}) == 5
    assert await thought({"reasoning_effort": 0.5}) == 5
    assert await thought({"reasoning_effort": "none"}) == 0
    assert await thought({"chat_template_kwargs": {"enable_thinking": False}}) == 0
    # The template's own switch wins over the effort, as SGLang only fills it in when unset.
    on = {"reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}}
    assert await thought(on) == 5
    for bad in ({"reasoning_effort": "extreme"}, {"reasoning_effort": 2},
                {"reasoning_effort": True}, {"chat_template_kwargs": "off"}):  # fmt: skip
        refused = await client.post(url, json={**CHAT, **bad})
        assert refused.status_code == 400
        assert next(iter(bad)) in refused.json()["message"]
