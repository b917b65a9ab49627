"""Several choices on the OpenAI routes (`n` > 1, a batch of completion prompts), in SGLang's
shapes: tokenizer_manager.py `_handle_batch_request` numbers prompt i's choice j as index
i * n + j and streams the choices' outputs as they come; serving_chat.py
`_generate_chat_stream` opens each choice with a role chunk and sends every choice's finish
chunk after all are done; serving_completions.py puts a choice's finish on its last chunk;
usage_processor.py sums completion tokens over all choices and prompt tokens once per prompt.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.backends.sim.conftest import MakeSim, stream_post

CHAT = {"messages": [{"role": "user", "content": "tell me three things"}], "max_tokens": 12}


async def test_whole_chat_with_n_answers_n_choices_and_sums_usage(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim()
    one = (await client.post(f"{sim.url}/v1/chat/completions", json=CHAT)).json()
    r = await client.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    texts = [c["message"]["content"] for c in choices]
    # choice 0 is the n = 1 answer; the others are other samples
    assert texts[0] == one["choices"][0]["message"]["content"]
    assert len(set(texts)) == 3
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    usage = body["usage"]
    prompt = one["usage"]["prompt_tokens"]
    assert usage["prompt_tokens"] == prompt  # counted once, not n times
    assert usage["completion_tokens"] > one["usage"]["completion_tokens"]
    assert usage["total_tokens"] == prompt + usage["completion_tokens"]


def _chat_choices(events: list[Any]) -> tuple[dict[int, str], dict[int, str], list[Any]]:
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage: list[Any] = []
    for event in events[:-1]:
        if not event["choices"]:
            usage.append(event["usage"])
            continue
        (choice,) = event["choices"]
        index = choice["index"]
        if choice["finish_reason"] is not None:
            assert index not in finishes
            finishes[index] = choice["finish_reason"]
            continue
        assert index not in finishes
        if index not in texts:  # the role chunk opens a choice
            assert choice["delta"]["role"] == "assistant" and choice["delta"]["content"] == ""
            texts[index] = ""
            continue
        texts[index] += choice["delta"]["content"]
    return texts, finishes, usage


async def test_streamed_chat_with_n_interleaves_choices_then_finishes_then_usage(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim()
    body = {**CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    response, events = await stream_post(client, f"{sim.url}/v1/chat/completions", body)
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    texts, finishes, usage = _chat_choices(events)
    whole = (await client.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "n": 3})).json()
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finishes == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert usage == [whole["usage"]]
    # every finish chunk comes after the last content chunk of any choice
    kinds = ["finish" if e["choices"] and e["choices"][0]["finish_reason"] else "other"
             for e in events[:-2]]  # fmt: skip
    assert kinds[-3:] == ["finish"] * 3 and "finish" not in kinds[:-3]
    # the choices' chunks interleave, each with its own choice's id
    order = [e["choices"][0]["index"] for e in events[:-2] if e["choices"]][:-3]
    assert order != sorted(order)
    ids = {e["choices"][0]["index"]: e["id"] for e in events[:-5]}
    assert len(set(ids.values())) == 3


async def test_completions_with_a_batch_and_n_number_choices_prompt_major(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim()
    url = f"{sim.url}/v1/completions"
    prompts = ["the first prompt", "a second, longer prompt than that"]
    singles = [(await client.post(url, json={"prompt": p, "max_tokens": 8})).json()
               for p in prompts]  # fmt: skip
    r = await client.post(url, json={"prompt": prompts, "n": 2, "max_tokens": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # index i * n + j: choice 0 of each prompt is that prompt's n = 1 answer
    assert body["choices"][0]["text"] == singles[0]["choices"][0]["text"]
    assert body["choices"][2]["text"] == singles[1]["choices"][0]["text"]
    usage = body["usage"]
    prompt = sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["prompt_tokens"] == prompt
    assert usage["completion_tokens"] == 4 * 8
    # streamed: the same texts and finishes per index; finish on each choice's last chunk
    stream = {"prompt": prompts, "n": 2, "max_tokens": 8, "stream": True,
              "stream_options": {"include_usage": True}}  # fmt: skip
    response, events = await stream_post(client, url, stream)
    assert response.status_code == 200 and events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for event in events[:-2]:
        (choice,) = event["choices"]
        assert choice["index"] not in finishes
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in body["choices"]}
    assert finishes == dict.fromkeys(range(4), "length")
    assert events[-2]["choices"] == [] and events[-2]["usage"]["prompt_tokens"] == prompt
    assert events[-2]["usage"]["completion_tokens"] == 32


async def test_a_batch_with_a_rid_names_each_prompt(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim()
    body = {"prompt": ["one", "two"], "max_tokens": 4, "rid": "job", "stream": True}
    response, events = await stream_post(client, f"{sim.url}/v1/completions", body)
    assert response.status_code == 200
    assert {(e["choices"][0]["index"], e["id"]) for e in events[:-1]} == {(0, "job_0"),
                                                                         (1, "job_1")}  # fmt: skip


async def test_n_with_what_the_stand_in_cannot_sample_is_a_400(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim()
    r = await client.post(f"{sim.url}/v1/chat/completions",
                          json={**CHAT, "n": 2, "logprobs": True})  # fmt: skip
    assert r.status_code == 400 and "'n' > 1" in r.json()["message"]
    r = await client.post(f"{sim.url}/v1/completions", json={"prompt": "x", "n": 0})
    assert r.status_code == 400
