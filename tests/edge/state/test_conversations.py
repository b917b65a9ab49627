"""Stored conversations end to end: httpx → hypercorn → the app → a stand-in (or a scripted chat
upstream that records prompts), with real Redis shared by two edges."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import openai
import pytest

from backends.sim import SimServer
from edge.routing.base import RequestView
from edge.stages.view import build_view
from tests.edge.conftest import Reply, TinyUpstream, client, fast_config, run_edge
from tests.edge.state.helpers import (
    CHAT,
    ChatUpstream,
    as_tenant,
    chat_chunks,
    sdk_of,
    sse_events,
    state,
    tenants,
)
from tests.edge.test_app_sim import sim_config
from tests.helpers import RedisServer

USER = {"role": "user", "content": "Tell me about the edge, in a few words please."}


def turn(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def metric(edge: Any, line: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(edge.admin_url + "/metrics")).text
    for row in text.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


async def test_responses_conversation_continues_through_a_second_edge(
    redis_url: str, redis_prefix: str
) -> None:
    """Turn 1 on edge A, turn 2 on edge B (sharing Redis), sending only the new input: B rebuilds
    the prompt, and the stand-in's radix cache holds all of turn 1's prompt."""
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=state(redis_url, redis_prefix))
        async with run_edge(config) as a, run_edge(config) as b:
            async with client(a) as ha, client(b) as hb:
                first = await ha.post("/v1/responses", json={
                    "model": "default", "input": USER["content"], "instructions": "Be brief.",
                    "max_output_tokens": 8, "temperature": 0,
                })  # fmt: skip
                assert first.status_code == 200, first.text
                one = first.json()
                assert one["object"] == "response" and one["status"] in ("completed", "incomplete")
                assert one["id"].startswith("resp_") and one["previous_response_id"] is None
                assert one["output"][0]["content"][0]["type"] == "output_text"
                text_one = one["output"][0]["content"][0]["text"]
                assert text_one
                second = await hb.post("/v1/responses", json={
                    "model": "default", "input": "And why does it matter?",
                    "instructions": "Be brief.", "previous_response_id": one["id"],
                    "max_output_tokens": 8,
                })  # fmt: skip
                assert second.status_code == 200, second.text
                two = second.json()
                assert two["previous_response_id"] == one["id"] and two["id"] != one["id"]
                # the backend saw the whole history: a longer prompt, turn 1's part cached
                assert two["usage"]["input_tokens"] > one["usage"]["input_tokens"]
                cached = two["usage"]["input_tokens_details"]["cached_tokens"]
                assert cached >= one["usage"]["input_tokens"]
                # and a third turn on A continues from B's reply
                third = await ha.post("/v1/responses", json={
                    "model": "default", "input": "Thanks.", "previous_response_id": two["id"],
                    "instructions": "Be brief.", "max_output_tokens": 4,
                })  # fmt: skip
                assert third.status_code == 200, third.text
                assert third.json()["usage"]["input_tokens"] > two["usage"]["input_tokens"]
            assert await metric(a, 'quicedge_conversation_turns_total{outcome="committed"}') == 2


async def test_responses_stream_has_the_semantic_events() -> None:
    async with SimServer(sim_config("b1")) as sim:
        async with run_edge(fast_config([sim.url])) as edge, client(edge) as http:
            response = await http.post("/v1/responses", json={
                "model": "default", "input": [{"role": "user", "content": [
                    {"type": "input_text", "text": "Stream to me"}]}],
                "stream": True, "max_output_tokens": 6,
            })  # fmt: skip
            assert response.status_code == 200, response.text
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events(response.content)
            names = [name for name, _ in events]
            assert names[:4] == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
            ]
            assert "response.output_text.delta" in names
            # a budget-bound answer ends as incomplete, the others as completed
            assert names[-1] in ("response.completed", "response.incomplete")
            assert all(data != "[DONE]" for _, data in events)
            assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
            deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
            final = events[-1][1]["response"]
            assert final["output"][0]["content"][0]["text"] == deltas
            assert final["usage"]["output_tokens"] == 6
            # streamed and stored: the next turn continues it
            nxt = await http.post("/v1/responses", json={
                "model": "default", "input": "more", "previous_response_id": final["id"],
                "max_output_tokens": 4,
            })  # fmt: skip
            assert nxt.status_code == 200, nxt.text
            assert nxt.json()["usage"]["input_tokens"] > final["usage"]["input_tokens"]


async def test_chat_conversation_header_rebuilds_a_byte_identical_prompt() -> None:
    """Each turn's upstream messages start with the previous turn's messages and reply, byte
    for byte, and the routing view of turn N+1 starts with the whole prompt of turn N."""
    upstream = ChatUpstream()
    async with TinyUpstream(upstream) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            system = {"role": "system", "content": "You are terse."}
            first = await http.post(CHAT, headers={"x-quicedge-conversation": "new"}, json={
                "model": "tiny-model", "messages": [system, USER], "stream": True})  # fmt: skip
            assert first.status_code == 200, first.text
            conv = first.headers["x-quicedge-conversation"]
            assert conv.startswith("conv_")
            for n in range(1, 4):
                response = await http.post(
                    CHAT, headers={"x-quicedge-conversation": conv},
                    json={"model": "tiny-model", "messages": turn(f"question {n}"),
                          "stream": n % 2 == 0},
                )  # fmt: skip
                assert response.status_code == 200, response.text
                assert response.headers["x-quicedge-conversation"] == conv
    raw = [r.body for r in upstream.chats]
    bodies = upstream.bodies()
    for n in range(1, 4):
        before, after = bodies[n - 1]["messages"], bodies[n]["messages"]
        assert after[: len(before)] == before
        assert after[len(before)] == {"role": "assistant", "content": f"answer {n - 1} done"}
        assert after[len(before) + 1 :] == turn(f"question {n}")
        # the serialised history is the same bytes: the previous messages array, unclosed
        prefix = json.dumps(before, separators=(",", ":")).encode()[:-1]
        start = raw[n].index(b'"messages":') + len(b'"messages":')
        assert raw[n][start : start + len(prefix)] == prefix
        view_before, view_after = (build_view(CHAT, b, None) for b in (bodies[n - 1], bodies[n]))
        assert isinstance(view_after, RequestView)
        assert view_after.text.startswith(view_before.text)


async def test_the_ttft_policy_sees_the_previous_turn_cached() -> None:
    """The rebuilt prompt lines up with what the prefix tree learned from turn 1's answer."""
    async with SimServer(sim_config("b1")) as s1, SimServer(sim_config("b2")) as s2:
        config = fast_config([s1.url, s2.url], policy="ttft")
        async with run_edge(config, trace=True) as edge, client(edge) as http:
            first = await http.post(CHAT, headers={"x-quicedge-conversation": "new"}, json={
                "model": "default", "messages": [USER], "max_tokens": 8})  # fmt: skip
            conv = first.headers["x-quicedge-conversation"]
            backend = first.headers["x-quicedge-backend"]
            second = await http.post(CHAT, headers={"x-quicedge-conversation": conv}, json={
                "model": "default", "messages": turn("go on"), "max_tokens": 8})  # fmt: skip
            assert second.status_code == 200, second.text
            assert second.headers["x-quicedge-backend"] == backend
            assert edge.spans is not None
            routes = [s for s in edge.spans.get_finished_spans() if s.name.endswith("route")]
            predicted = routes[-1].attributes["quicedge.predicted_cached_tokens"]  # type: ignore[index]
            assert predicted >= first.json()["usage"]["prompt_tokens"]
            assert (
                second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                >= (first.json()["usage"]["prompt_tokens"])
            )


async def test_another_tenants_id_is_not_found() -> None:
    upstream = ChatUpstream()
    async with TinyUpstream(upstream) as up:
        config = fast_config([up.url], admission=tenants("alpha", "beta"))
        async with run_edge(config) as edge, client(edge) as http:
            mine = as_tenant("alpha")
            first = await http.post(CHAT, headers={**mine, "x-quicedge-conversation": "new"},
                                    json={"messages": [USER]})  # fmt: skip
            conv = first.headers["x-quicedge-conversation"]
            other = await http.post(
                CHAT,
                headers={**as_tenant("beta"), "x-quicedge-conversation": conv},
                json={"messages": turn("what did alpha say?")},
            )
            assert other.status_code == 404
            assert other.json() == {"error": {
                "message": f"Conversation with id '{conv}' not found.",
                "type": "invalid_request_error", "param": "x-quicedge-conversation",
                "code": "conversation_not_found"}}  # fmt: skip
            made = await http.post("/v1/responses", headers=mine, json={"input": "hi"})
            rid = made.json()["id"]
            stolen = await http.post(
                "/v1/responses",
                headers=as_tenant("beta"),
                json={"input": "hi", "previous_response_id": rid},
            )
            assert stolen.status_code == 404
            assert stolen.json()["error"]["code"] == "previous_response_not_found"
            # the owner still continues it, and nothing of beta's reached the upstream
            again = await http.post(CHAT, headers={**mine, "x-quicedge-conversation": conv},
                                    json={"messages": turn("more")})  # fmt: skip
            assert again.status_code == 200
    assert all("alpha say" not in r.body.decode() for r in upstream.chats)


@pytest.mark.parametrize("value", ["conv_" + "0" * 24, "conv_nothex", "resp_x"])
async def test_unknown_ids_are_404_in_openai_shape(value: str) -> None:
    async with TinyUpstream(ChatUpstream()) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            response = await http.post(CHAT, headers={"x-quicedge-conversation": value},
                                       json={"messages": [USER]})  # fmt: skip
            assert response.status_code == 404
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            unknown = await http.post("/v1/responses", json={
                "input": "hi", "previous_response_id": "resp_" + "ab" * 16})  # fmt: skip
            assert unknown.status_code == 404
            assert unknown.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_conversation_expires_after_its_ttl(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    settings = state(redis_url if store == "redis" else None, redis_prefix,
                     conversations={"ttl": 0.3})  # fmt: skip
    async with TinyUpstream(ChatUpstream()) as up:
        async with run_edge(fast_config([up.url], state=settings)) as edge, client(edge) as http:
            first = await http.post(CHAT, headers={"x-quicedge-conversation": "new"},
                                    json={"messages": [USER]})  # fmt: skip
            conv = first.headers["x-quicedge-conversation"]
            deadline = asyncio.get_running_loop().time() + 15
            while True:  # expired well within the bound, however loaded the machine
                await asyncio.sleep(0.4)
                later = await http.post(CHAT, headers={"x-quicedge-conversation": conv},
                                        json={"messages": turn("still there?")})  # fmt: skip
                if later.status_code == 404:
                    break
                assert later.status_code == 200
                assert asyncio.get_running_loop().time() < deadline, "never expired"
            assert later.json()["error"]["code"] == "conversation_not_found"


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_racing_turns_one_is_409_and_the_history_is_not_interleaved(
    store: str, redis_url: str, redis_prefix: str
) -> None:
    gate = asyncio.Event()
    upstream = ChatUpstream()
    settings = state(redis_url if store == "redis" else None, redis_prefix)
    async with TinyUpstream(upstream) as up:
        async with run_edge(fast_config([up.url], state=settings)) as edge, client(edge) as http:
            first = await http.post(CHAT, headers={"x-quicedge-conversation": "new"},
                                    json={"messages": [USER]})  # fmt: skip
            conv = first.headers["x-quicedge-conversation"]
            upstream.gate, upstream.arrived = gate, asyncio.Event()
            headers = {"x-quicedge-conversation": conv}
            slow = asyncio.ensure_future(
                http.post(CHAT, headers=headers, json={"messages": turn("A"), "stream": True})
            )
            await asyncio.wait_for(upstream.arrived.wait(), 10)  # turn A holds the lease
            busy = await http.post(CHAT, headers=headers, json={"messages": turn("B")})
            assert busy.status_code == 409
            assert busy.json()["error"]["code"] == "conversation_busy"
            gate.set()
            assert (await slow).status_code == 200
            upstream.gate = None
            after = await http.post(CHAT, headers=headers, json={"messages": turn("C")})
            assert after.status_code == 200
    contents = [m["content"] for m in upstream.bodies()[-1]["messages"]]
    assert contents == [USER["content"], "answer 0 done", "A", "answer 1 done", "C"]


async def test_a_failed_stream_is_not_appended_and_frees_the_conversation() -> None:
    def reply(n: int, recorded: Any) -> Reply:
        if n == 1:  # turn 2 dies mid-stream
            return Reply(headers=[("content-type", "text/event-stream")],
                         chunks=chat_chunks(["half", "way"]), die_after=2)  # fmt: skip
        if n == 2:  # turn 3 ends before its [DONE]
            return Reply(headers=[("content-type", "text/event-stream")],
                         chunks=chat_chunks(["short"])[:-1])  # fmt: skip
        return Reply(headers=[("content-type", "text/event-stream")],
                     chunks=chat_chunks([f"answer {n}"]))  # fmt: skip

    upstream = ChatUpstream(reply)
    async with TinyUpstream(upstream) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            first = await http.post(CHAT, headers={"x-quicedge-conversation": "new"},
                                    json={"messages": [USER], "stream": True})  # fmt: skip
            conv = first.headers["x-quicedge-conversation"]
            headers = {"x-quicedge-conversation": conv}
            cut = await http.post(
                CHAT, headers=headers, json={"messages": turn("lost"), "stream": True}
            )
            assert b'"error"' in cut.content  # the client saw the failure as an error event
            short = await http.post(
                CHAT, headers=headers, json={"messages": turn("short"), "stream": True}
            )
            assert short.status_code == 200 and b"[DONE]" not in short.content
            again = await http.post(
                CHAT, headers=headers, json={"messages": turn("retry"), "stream": True}
            )
            assert again.status_code == 200
            assert await metric(edge, 'quicedge_conversation_turns_total{outcome="failed"}') == 2
    contents = [m["content"] for m in upstream.bodies()[-1]["messages"]]
    assert contents == [USER["content"], "answer 0", "retry"]


async def test_over_the_size_limit_413_or_the_oldest_turns_go() -> None:
    big = "x" * 700
    upstream = ChatUpstream()
    reject = state(conversations={"max_bytes": 2048, "overflow": "reject"})
    truncate = state(conversations={"max_bytes": 2048, "overflow": "truncate"})
    async with TinyUpstream(upstream) as up:
        async with run_edge(fast_config([up.url], state=reject)) as edge, client(edge) as http:
            first = await http.post(CHAT, headers={"x-quicedge-conversation": "new"},
                                    json={"messages": turn(big)})  # fmt: skip
            headers = {"x-quicedge-conversation": first.headers["x-quicedge-conversation"]}
            assert (await http.post(CHAT, headers=headers, json={"messages": turn(big)})).is_success
            too_big = await http.post(CHAT, headers=headers, json={"messages": turn(big)})
            assert too_big.status_code == 413
            assert too_big.json()["error"]["code"] == "conversation_too_large"
        sent = len(upstream.chats)
        async with run_edge(fast_config([up.url], state=truncate)) as edge, client(edge) as http:
            system = {"role": "system", "content": "Keep me."}
            first = await http.post(
                CHAT,
                headers={"x-quicedge-conversation": "new"},
                json={"messages": [system, *turn("first " + big)]},
            )
            headers = {"x-quicedge-conversation": first.headers["x-quicedge-conversation"]}
            truncated = []
            for n in range(4):
                response = await http.post(
                    CHAT, headers=headers, json={"messages": turn(f"turn {n} {big}")}
                )
                assert response.status_code == 200, response.text
                truncated.append(response.headers.get("x-quicedge-conversation-truncated"))
            assert "true" in truncated
    for recorded in upstream.chats[sent:]:
        messages = json.loads(recorded.body)["messages"]
        assert len(json.dumps(messages, separators=(",", ":"))) <= 2048
        assert messages[0] == {"role": "system", "content": "Keep me."}
        assert messages[-1]["content"].startswith(("first", "turn"))
    last = json.loads(upstream.chats[-1].body)["messages"]
    assert not any(m["content"].startswith("first") for m in last)  # the oldest turn went


async def test_redis_down_is_503_for_conversations_while_stateless_requests_go_on() -> None:
    server = RedisServer()
    try:
        settings = state(server.url, "t:", timeout=0.3)
        async with TinyUpstream(ChatUpstream()) as up:
            async with run_edge(fast_config([up.url], state=settings)) as edge:
                async with client(edge) as http:
                    first = await http.post(CHAT, headers={"x-quicedge-conversation": "new"},
                                            json={"messages": [USER]})  # fmt: skip
                    assert first.status_code == 200
                    conv = first.headers["x-quicedge-conversation"]
                    server.stop()
                    down = await http.post(CHAT, headers={"x-quicedge-conversation": conv},
                                           json={"messages": turn("hello?")})  # fmt: skip
                    assert down.status_code == 503
                    assert down.json()["error"]["code"] == "state_unavailable"
                    responses = await http.post("/v1/responses", json={"input": "hi"})
                    assert responses.status_code == 503
                    plain = await http.post(CHAT, json={"messages": [USER]})
                    assert plain.status_code == 200
                    unstored = await http.post(
                        "/v1/responses", json={"input": "hi", "store": False}
                    )
                    assert unstored.status_code == 200
    finally:
        with contextlib.suppress(Exception):
            server.stop()


async def test_bad_responses_requests_are_400_by_field() -> None:
    async with TinyUpstream(ChatUpstream()) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            fn = {"type": "function", "name": "f"}
            cases = [({"input": "x", "background": True, "store": False}, "background"),
                     ({}, "input"),
                     ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
                     ({"input": "x", "store": "yes"}, "store"),
                     ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                     ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
                     ({"input": "x", "tools": [{**fn, "parameters": 3}]}, "tools[0].parameters"),
                     ({"input": "x", "tools": [fn], "tool_choice": {"type": "function",
                                                                     "name": "g"}},
                      "tool_choice.name"),
                     ({"input": "x", "tool_choice": "required"}, "tool_choice"),
                     ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
                     ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                  "arguments": {}}]}, "input[0].arguments"),
                     ({"input": [{"type": "function_call_output", "output": "x"}]},
                      "input[0].call_id"),
                     ({"input": [{"type": "file_search_call"}]}, "input[0]"),
                     ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
                     ({"input": "x", "top_logprobs": 21}, "top_logprobs")]  # fmt: skip
            for body, param in cases:
                response = await http.post("/v1/responses", json=body)
                assert response.status_code == 400, body
                assert response.json()["error"]["param"] == param
            wrong = await http.post(
                "/v1/completions", json={"prompt": "x"}, headers={"x-quicedge-conversation": "new"}
            )
            assert wrong.status_code == 400
            get = await http.get("/v1/responses")
            assert get.status_code == 405


async def test_responses_truncation_chooses_per_request_and_the_default_is_the_edges() -> None:
    """`truncation: "auto"` drops the oldest turns past the size limit even where the edge
    rejects, `"disabled"` is a 413 even where it truncates; not given, the edge's `overflow`
    applies and the response says which (OpenAI's field)."""
    big = "x" * 700
    upstream = ChatUpstream()
    for overflow in ("reject", "truncate"):
        limited = state(conversations={"max_bytes": 2048, "overflow": overflow})
        async with TinyUpstream(upstream) as up:
            config = fast_config([up.url], state=limited, admission=tenants("alpha"))
            async with run_edge(config) as edge:
                sdk = sdk_of(edge)
                async with sdk:
                    first = await sdk.responses.create(model="default", input=big)
                    assert first.truncation == ("auto" if overflow == "truncate" else "disabled")
                    second = await sdk.responses.create(
                        model="default", input=big, previous_response_id=first.id
                    )
                    with pytest.raises(openai.APIStatusError) as refused:
                        await sdk.responses.create(
                            model="default", input=big, previous_response_id=second.id,
                            truncation="disabled",
                        )  # fmt: skip
                    assert refused.value.status_code == 413
                    third = await sdk.responses.create(
                        model="default", input=big, previous_response_id=second.id,
                        truncation="auto",
                    )  # fmt: skip
                    assert third.truncation == "auto" and third.status == "completed"
                    with pytest.raises(openai.BadRequestError) as bad:
                        await sdk.responses.create(
                            model="default", input="x", truncation="sometimes",  # type: ignore[arg-type]
                        )  # fmt: skip
                    assert bad.value.body["param"] == "truncation"  # type: ignore[index]
            last = upstream.bodies()[-1]["messages"]
            assert len(json.dumps(last, separators=(",", ":"))) <= 2048
            assert len(last) == 3  # the first turn went: the second's question and reply, the new
