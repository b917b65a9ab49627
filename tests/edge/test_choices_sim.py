"""Several choices (`n` > 1) relayed and accounted end to end, against the stand-in, which
streams them as SGLang does (serving_chat.py `_generate_chat_stream`): one choice per chunk,
choices interleaved by `index`, every choice's finish chunk after all are done, then one usage
chunk summed over the choices (usage_processor.py `calculate_streaming_usage`: completion
tokens of all choices, prompt tokens once)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from openai.types.chat import ChatCompletionMessageParam

from backends.sim import SimServer
from edge.policy.config import PolicyConfig
from edge.sse import SSEScanner
from tests.edge.conftest import client, fast_config, run_edge
from tests.edge.state.helpers import as_tenant, sdk_of, state, tenants
from tests.edge.state.test_stored_completions import kept_as
from tests.edge.test_app_sim import metrics_text, sim_config
from tests.edge.test_generate_batch_usage import completion_tokens

ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "three ways to say hello"}]
CHAT = {
    "messages": ASK,
    "max_tokens": 10,
    "n": 3,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def _choices(events: list[Any]) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            index = choice["index"]
            assert index not in finishes  # nothing of a choice after its finish
            if choice["finish_reason"] is not None:
                finishes[index] = choice["finish_reason"]
            else:
                texts[index] = texts.get(index, "") + (choice["delta"].get("content") or "")
    return texts, finishes


async def test_a_streamed_chat_with_n_3_relays_every_choice_and_charges_their_sum() -> None:
    async with SimServer(sim_config("b1")) as sim:
        async with httpx.AsyncClient() as direct:
            whole = (
                await direct.post(f"{sim.url}/v1/chat/completions",
                                  json={**CHAT, "stream": False, "stream_options": None})
            ).json()  # fmt: skip
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            scanner = SSEScanner.for_route("/v1/chat/completions")
            raw = b""
            async with http.stream("POST", "/v1/chat/completions", headers=as_tenant("alpha"),
                                   json=CHAT) as r:  # fmt: skip
                assert r.status_code == 200
                async for chunk in r.aiter_raw():
                    raw += chunk
                    scanner.feed(chunk)
            events = [
                json.loads(line[6:])
                for line in raw.decode().split("\n")
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            expected = whole["usage"]["completion_tokens"]
            charged = 0.0
            for _ in range(200):  # the debit follows the answer's end
                charged = completion_tokens(await metrics_text(edge))
                if charged >= expected:
                    break
                await asyncio.sleep(0.01)
    assert raw.endswith(b"data: [DONE]\n\n")
    texts, finishes = _choices(events[:-1])
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finishes == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert len(set(texts.values())) == 3
    # the usage the stand-in reported, summed over the choices, is what the edge accounts
    # (the streamed request found the prompt cached: only the cache detail differs)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert events[-1]["choices"] == []
    assert [events[-1]["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]
    usage, text = scanner.final()
    assert usage.completion_tokens == whole["usage"]["completion_tokens"]
    assert usage.prompt_tokens == whole["usage"]["prompt_tokens"]
    assert charged == expected


async def test_a_stored_chat_stream_with_n_3_keeps_every_choice() -> None:
    """Each SGLang chunk names its own choice's rid as `id`; the stream is kept under the
    first chunk's, with every choice's text and finish and the summed usage."""
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], state=state(), admission=tenants("alpha"))
        async with run_edge(config) as edge:
            sdk = sdk_of(edge)
            async with sdk:
                stream = await sdk.chat.completions.create(
                    model="default", messages=ASK, max_tokens=10, n=3, store=True, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                chunks = [c async for c in stream]
                kept = await kept_as(sdk, chunks[0].id)
    said: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    for c in chunks:
        for choice in c.choices:
            said[choice.index] = said.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert [(c.index, c.message.content, c.finish_reason) for c in kept.choices] == [
        (i, said[i], finished[i]) for i in range(3)
    ]
    assert kept.usage == chunks[-1].usage


async def test_a_stream_rule_matching_one_choice_ends_every_choice_with_content_filter() -> None:
    async with SimServer(sim_config("b1")) as sim:
        async with httpx.AsyncClient() as direct:
            body = {"messages": ASK, "max_tokens": 10, "n": 3}
            whole = (await direct.post(f"{sim.url}/v1/chat/completions", json=body)).json()
        texts = [c["message"]["content"] for c in whole["choices"]]
        # a word of choice 1 that no other choice says, past its first word
        word = next(w for w in texts[1].split()[1:] if w.strip(",.") == w
                    and all(w not in t for t in (texts[0], texts[2])))  # fmt: skip
        policy = {"stream_rules": [{"id": "word", "patterns": [rf"\b{word}\b"]}],
                  "stream_hold": True}  # fmt: skip
        config = fast_config([sim.url])
        async with run_edge(config, policies=PolicyConfig.from_mapping(policy)) as edge:
            async with client(edge) as http:
                response = await http.post("/v1/chat/completions",
                                           json={**body, "stream": True})  # fmt: skip
    assert response.status_code == 200
    assert response.content.endswith(b"data: [DONE]\n\n")
    assert word.encode() not in response.content
    events = [json.loads(e[6:]) for e in response.content.split(b"\n\n")
              if e.startswith(b"data: {")]  # fmt: skip
    said, finishes = _choices(events)
    assert finishes == dict.fromkeys(range(3), "content_filter")
    for index, text in said.items():  # what came is the start of each choice's answer
        assert texts[index].startswith(text)


async def test_per_choice_usage_on_every_chunk_is_not_charged_as_the_whole_answers() -> None:
    """`continuous_usage_stats` without `include_usage`: SGLang puts each chunk's own choice's
    counts on it (serving_completions.py `_generate_completion_stream`) and sends no summed
    usage chunk, so the last event's usage is one choice's, not the answer's."""
    body = {"prompt": "count to ten", "max_tokens": 8, "ignore_eos": True, "n": 3,
            "stream": True, "stream_options": {"continuous_usage_stats": True}}  # fmt: skip
    async with SimServer(sim_config("b1")) as sim:
        config = fast_config([sim.url], admission=tenants("alpha"))
        async with run_edge(config) as edge, client(edge) as http:
            r = await http.post("/v1/completions", headers=as_tenant("alpha"), json=body)
            assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
            # the summed usage chunk the edge asked for is not the client's
            assert b'"choices":[]' not in r.content and b'"choices": []' not in r.content
            charged = 0.0
            for _ in range(200):  # the debit follows the answer's end
                charged = completion_tokens(await metrics_text(edge))
                if charged >= 3 * 8:
                    break
                await asyncio.sleep(0.01)
    assert charged == 3 * 8
