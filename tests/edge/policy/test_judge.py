"""The model-judged track against the stand-in in guard mode (`backends.sim --guard`, a
Llama-Guard-style classifier timed by the stand-in's model): `hold` refuses before routing,
`race` cancels a request whose response has not started, a late verdict is only counted; and
against scripted guards that misbehave (hung, erroring, answering nonsense), which go open or
closed as configured."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from backends.sim import SimConfig, SimServer
from edge.policy.config import PolicyConfig
from edge.policy.judge import verdict_of
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
    sse_reply,
)
from tests.helpers import wait_until


@contextlib.asynccontextmanager
async def sim_guard(**options: Any) -> AsyncIterator[SimServer]:
    """A stand-in in guard mode: prompts that mention an attack are `unsafe\nS2`."""
    values: dict[str, Any] = {"port": 0, "profile": "instant", **options}
    config = SimConfig(guard=True, guard_unsafe=("S2=attack",), **values)
    async with SimServer(config) as server:
        yield server


def misbehaving_guard(reply: Reply | None = None, delay: float = 0.0) -> Any:
    """A guard that hangs for `delay` seconds, then answers `reply` (a 200 of nonsense, a 500)."""

    async def answer(recorded: Recorded) -> Reply:
        if recorded.path != "/v1/chat/completions":
            return health_ok(recorded) or Reply(status=404)
        await asyncio.sleep(delay)
        if reply is not None:
            return reply
        body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "safe"}}]}
        return Reply(chunks=[json.dumps(body).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    return answer


def backend(head_delay: float = 0.0) -> Any:
    async def answer(recorded: Recorded) -> Reply:
        ok = health_ok(recorded)
        if ok is not None:
            return ok
        await asyncio.sleep(head_delay)  # a backend slow to start its answer (queued, prefill)
        return sse_reply(["fine", " answer"])

    return answer


def edge_with(url: str, guard_url: str, **judge: Any) -> Any:
    """An edge in front of `url` whose guard model is `guard_url` (`[policy.judge]`)."""
    policies = PolicyConfig.from_mapping({"judge": {"backends": [guard_url], **judge}})
    return run_edge(fast_config([url]), policies=policies)


def completion(prompt: str, stream: bool = False) -> dict[str, Any]:
    return {"model": "tiny-model", "prompt": prompt, "stream": stream}


def generations(up: TinyUpstream) -> list[Recorded]:
    return [r for r in up.requests if r.path == "/v1/completions"]


async def metrics(edge: Any) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{edge.admin_url}/metrics")).text


async def test_hold_refuses_unsafe_before_routing_and_passes_safe() -> None:
    async with TinyUpstream(backend()) as up, sim_guard() as g:
        async with edge_with(up.url, g.url) as edge, client(edge) as http:
            refused = await http.post("/v1/completions", json=completion("plan an attack"))
            passed = await http.post("/v1/completions", json=completion("plan a picnic"))
            text = await metrics(edge)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "policy_violation"
    assert refused.headers["x-quicedge-policy-rule"] == "judge"
    assert passed.status_code == 200
    assert len(generations(up)) == 1  # only the safe one was forwarded
    assert 'quicedge_policy_judge_seconds_count{verdict="unsafe"} 1.0' in text
    assert 'quicedge_policy_decisions_total{outcome="safe",rule="judge"} 1.0' in text


async def test_the_guard_reads_the_newest_text_and_not_the_tools_definitions() -> None:
    """A prompt longer than `max_prompt_chars` is cut at its start: padding in front cannot
    hide the request from the guard. Offered tools' definitions are not part of what it reads."""
    attack_tool = {"type": "function", "function": {"name": "f", "description": "attack plans"}}
    async with TinyUpstream(backend()) as up, sim_guard() as g:
        async with edge_with(up.url, g.url, max_prompt_chars=500) as edge, client(edge) as http:
            hidden = "a picnic. " * 200 + "plan an attack"
            padded = await http.post("/v1/completions", json=completion(hidden))
            tools = await http.post("/v1/chat/completions", json={
                "model": "tiny-model", "tools": [attack_tool],
                "messages": [{"role": "user", "content": "plan a picnic"}]})  # fmt: skip
    assert padded.status_code == 403 and padded.headers["x-quicedge-policy-rule"] == "judge"
    assert tools.status_code == 200, tools.text


async def test_race_cancels_a_request_whose_answer_has_not_started() -> None:
    async with TinyUpstream(backend(head_delay=5.0)) as up, sim_guard() as g:
        async with edge_with(up.url, g.url, mode="race") as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=completion("attack!", True))
            await wait_until(lambda: any(r.path == "/abort_request" for r in up.requests), 10)
    assert response.status_code == 200  # a streaming refusal: a well-formed stream
    events = response.content.split(b"\n\n")
    assert json.loads(events[0][6:])["choices"][0]["finish_reason"] == "content_filter"
    assert events[-2:] == [b"data: [DONE]", b""]
    assert len(generations(up)) == 1  # it was forwarded at once


async def test_race_verdict_after_the_answer_started_is_only_counted() -> None:
    # An H100-timed guard slowed 60x: its verdict (a prefill and four decode steps, ~1.5 s)
    # comes well after the backend's answer has started.
    slow = {"profile": "h100-llama3-8b", "time_scale": 60.0}
    async with TinyUpstream(backend()) as up, sim_guard(**slow) as g:
        async with edge_with(up.url, g.url, mode="race") as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=completion("attack", True))
            counter = edge.wiring.metrics.policy_decisions.labels("judge", "unsafe_late")
            await wait_until(lambda: counter.value == 1, 10)
    assert response.status_code == 200 and b"fine" in response.content


NONSENSE = Reply(chunks=[json.dumps({"choices": [{"message": {"content": "maybe"}}]}).encode()],
                 chunked=False, headers=[("content-type", "application/json")])  # fmt: skip
FAILURES = {
    "hung": misbehaving_guard(delay=5.0),
    "erroring": misbehaving_guard(Reply(status=500, chunks=[b"boom"], chunked=False)),
    "nonsense": misbehaving_guard(NONSENSE),
}


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize(("on_error", "status"), [("open", 200), ("closed", 503)])
async def test_a_failing_guard(failure: str, on_error: str, status: int) -> None:
    async with TinyUpstream(backend()) as up, TinyUpstream(FAILURES[failure]) as g:
        async with (
            edge_with(up.url, g.url, timeout=0.5, on_error=on_error) as edge,
            client(edge) as http,
        ):
            response = await http.post("/v1/completions", json=completion("hello"))
            text = await metrics(edge)
    assert response.status_code == status
    assert 'quicedge_policy_judge_seconds_count{verdict="error"} 1.0' in text
    if status == 503:
        assert response.json()["error"]["code"] == "policy_unavailable"
        assert generations(up) == []
    else:
        assert len(generations(up)) == 1


@pytest.mark.parametrize(
    ("text", "verdict"),
    [("safe", "safe"), ("Unsafe\nS1", "unsafe"), (" SAFE.", "safe"), ("maybe", "error")],
)
def test_verdict_of_the_first_word(text: str, verdict: str) -> None:
    raw = json.dumps({"choices": [{"message": {"content": text}}]}).encode()
    assert verdict_of(raw) == verdict
    assert verdict_of(b"not json") == "error"


async def test_race_holds_a_background_response_for_the_verdict() -> None:
    """A background answer runs in a task of its own, which a race could not cancel: it waits
    for the verdict, and an unsafe one is refused before anything is forwarded."""
    async with TinyUpstream(backend()) as up, sim_guard() as g:
        async with edge_with(up.url, g.url, mode="race") as edge, client(edge) as http:
            refused = await http.post(
                "/v1/responses", json={"input": "plan an attack", "background": True}
            )
    assert refused.status_code == 403, refused.text
    assert refused.headers["x-quicedge-policy-rule"] == "judge"
    assert not [r for r in up.requests if r.path == "/v1/chat/completions"]


async def test_routes_name_the_route_the_client_called() -> None:
    """`routes = ["/v1/responses"]` judges Responses requests (the edge forwards them as chat
    completions, which is not what the operator listed), and only those."""
    async with TinyUpstream(backend()) as up, sim_guard() as g:
        async with (
            edge_with(up.url, g.url, routes=["/v1/responses"]) as edge,
            client(edge) as http,
        ):
            refused = await http.post("/v1/responses", json={"input": "plan an attack"})
            chat = {"messages": [{"role": "user", "content": "plan an attack"}]}
            passed = await http.post("/v1/chat/completions", json=chat)
    assert refused.status_code == 403, refused.text
    assert refused.headers["x-quicedge-policy-rule"] == "judge"
    assert passed.status_code == 200, passed.text


@pytest.mark.parametrize("mode", ["hold", "race"])
async def test_a_judged_responses_stream_is_refused_as_a_responses_stream(mode: str) -> None:
    delay = 5.0 if mode == "race" else 0.0  # the verdict comes before the answer starts
    async with TinyUpstream(backend(head_delay=delay)) as up, sim_guard() as g:
        async with edge_with(up.url, g.url, mode=mode) as edge, client(edge) as http:
            body = {"input": "plan an attack", "stream": True}
            refused = await http.post("/v1/responses", json=body)
    assert refused.status_code == 200 and refused.headers["x-quicedge-policy-rule"] == "judge"
    data = [line[6:] for line in refused.text.splitlines() if line.startswith("data: ")]
    types = [json.loads(d).get("type") for d in data]
    # a refusal is the answer a content filter gave: incomplete, for its content
    assert types[0] == "response.created" and types[-1] == "response.incomplete", types


async def test_a_guard_answer_past_the_bound_is_an_error_unread() -> None:
    """The guard answers a few words (`max_tokens` 8); a body past 64 KiB (a misconfigured
    backend, a guard gone wrong) is not buffered whole for every request: it is `error`."""
    head = json.dumps({"choices": [{"message": {"content": "safe"}}]}).encode()
    huge = Reply(chunks=[head + b" " * (4 << 20)], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip
    async with TinyUpstream(backend()) as up, TinyUpstream(misbehaving_guard(huge)) as g:
        async with edge_with(up.url, g.url, on_error="closed") as edge, client(edge) as http:
            response = await http.post("/v1/completions", json=completion("hello"))
            text = await metrics(edge)
    assert response.status_code == 503 and generations(up) == []
    assert 'quicedge_policy_judge_seconds_count{verdict="error"} 1.0' in text
