"""Corners of SGLang's wire contract that a proxy in front must read right: how a refused
streamed `/generate` and a request stopped by `/abort_request` come back.

SGLang (python/sglang/srt/entrypoints/http_server.py, `generate_request`) starts a streamed
`/generate` answer before the tokenizer manager validates the request, so a refusal is a 200 event
stream holding one `{"error": {"message"}}` event and `[DONE]`. An abort without a status code
(what `/abort_request` does: `FINISH_ABORT()`, "Aborted" / "Abort in waiting queue") is a
graceful finish, not an error: `finish_reason` "abort" on every route, streamed or whole
(tokenizer_manager.py `_handle_abort_finish_reason`; serving_chat.py `_generate_chat_stream`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from backends.sim import SimServer
from tests.backends.sim.conftest import MakeSim, stream_post
from tests.backends.sim.test_runtime import wait_load

LONG = "word " * 200


async def test_a_refused_streamed_generate_is_an_error_event_in_a_200_stream(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(context_length=64)
    body = {"text": LONG, "stream": True}
    response, events = await stream_post(client, f"{sim.url}/generate", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert len(events) == 2 and events[1] == "[DONE]"
    assert set(events[0]) == {"error"} and set(events[0]["error"]) == {"message"}
    assert "context length" in events[0]["error"]["message"]
    # a value the tokenizer manager refuses comes back the same way
    body = {"text": "hi", "stream": True, "sampling_params": {"temperature": -1}}
    response, events = await stream_post(client, f"{sim.url}/generate", body)
    assert response.status_code == 200 and "temperature" in events[0]["error"]["message"]
    # not streamed, it stays a 400 (`_create_error_response`)
    r = await client.post(f"{sim.url}/generate", json={"text": LONG})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


async def _abort_when_running(client: httpx.AsyncClient, sim: SimServer, rid: str) -> None:
    await wait_load(client, sim, lambda e: e["num_running_reqs"] == 1)
    r = await client.post(f"{sim.url}/abort_request", json={"rid": rid})
    assert r.status_code == 200


LONG_RUN = {"max_tokens": 100_000, "ignore_eos": True, "rid": "victim"}


async def test_an_aborted_chat_stream_finishes_with_abort(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(profile="h100-llama3-8b", enable_cache_report=True)
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        **LONG_RUN,
    }
    aborter = asyncio.create_task(_abort_when_running(client, sim, "victim"))
    response, events = await stream_post(client, f"{sim.url}/v1/chat/completions", body)
    await aborter
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    finish, usage = events[-3], events[-2]
    assert finish["choices"][0]["finish_reason"] == "abort"
    assert finish["choices"][0]["matched_stop"] is None
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] > 0


async def test_an_aborted_completion_stream_finishes_with_abort(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(profile="h100-llama3-8b")
    body = {"prompt": "hi", "stream": True, **LONG_RUN}
    aborter = asyncio.create_task(_abort_when_running(client, sim, "victim"))
    response, events = await stream_post(client, f"{sim.url}/v1/completions", body)
    await aborter
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert not any("error" in e for e in events[:-1])


async def test_an_aborted_whole_answer_is_a_200_with_finish_reason_abort(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    sim = await make_sim(profile="h100-llama3-8b")
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **LONG_RUN}),
        ("/v1/completions", {"prompt": "hi", **LONG_RUN}),
    ]:
        aborter = asyncio.create_task(_abort_when_running(client, sim, "victim"))
        r = await client.post(f"{sim.url}{path}", json=body)
        await aborter
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "abort" and choice["matched_stop"] is None
    body = {"text": "hi", "rid": "victim", "sampling_params": {"max_new_tokens": 100_000}}
    aborter = asyncio.create_task(_abort_when_running(client, sim, "victim"))
    r = await client.post(f"{sim.url}/generate", json=body)
    await aborter
    assert r.status_code == 200, r.text
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


async def test_a_request_without_a_model_is_answered_as_model_default(
    sim: SimServer, client: httpx.AsyncClient
) -> None:
    # protocol.py: `model: str = Field(default=DEFAULT_MODEL_NAME)` ("default"), and the answer
    # names `request.model`, whatever the served model's name
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in [("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi"})]:
        r = await client.post(f"{sim.url}{path}", json=body)
        assert r.status_code == 200 and r.json()["model"] == "default"
        _, events = await stream_post(client, f"{sim.url}{path}", {**body, "stream": True})
        assert {e["model"] for e in events[:-1]} == {"default"}
        r = await client.post(f"{sim.url}{path}", json={**body, "model": "any/name"})
        assert r.json()["model"] == "any/name"


async def test_streamed_completions_carry_each_chunks_logprobs(
    sim: SimServer, client: httpx.AsyncClient
) -> None:
    # serving_completions.py `_generate_completion_stream`: each chunk's `logprobs` is
    # `to_openai_style_logprobs` of its new tokens; utils.py writes `text_offset` -1 ("Not
    # supported yet"), whole answers too
    body = {"prompt": "hi", "max_tokens": 6, "logprobs": 2, "ignore_eos": True}
    whole = (await client.post(f"{sim.url}/v1/completions", json=body)).json()
    expected = whole["choices"][0]["logprobs"]
    assert expected["text_offset"] == [-1] * 6
    _, events = await stream_post(client, f"{sim.url}/v1/completions", {**body, "stream": True})
    chunks = [e["choices"][0] for e in events[:-1]]
    assert all(c["logprobs"] is not None for c in chunks)
    joined: dict[str, list[Any]] = {k: [] for k in expected}
    for c in chunks:
        assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["top_logprobs"])
        for key in joined:
            joined[key] += c["logprobs"][key]
    assert joined == expected
    assert "".join(joined["tokens"]) == whole["choices"][0]["text"]


async def test_health_answers_no_sooner_than_sglangs_poll(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    # http_server.py `health_generate`: `await asyncio.sleep(1)` before each look, so a real
    # server's /health takes at least a second; `health_poll` models it (0.3 s here)
    sim = await make_sim(health_poll=0.3)
    started = time.perf_counter()
    r = await client.get(f"{sim.url}/health")
    assert r.status_code == 200 and time.perf_counter() - started >= 0.3
    # a busy server waits the same
    body = {"text": "x", "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True}}
    busy = asyncio.create_task(client.post(f"{sim.url}/generate", json={**body, "rid": "busy"}))
    await wait_load(client, sim, lambda e: e["num_running_reqs"] == 1)
    started = time.perf_counter()
    r = await client.get(f"{sim.url}/health")
    assert r.status_code == 200 and time.perf_counter() - started >= 0.3
    await client.post(f"{sim.url}/abort_request", json={"rid": "busy"})
    await busy
    # without it, the answer comes as soon as the check is done (the stand-in's default)
    plain = await make_sim()
    assert (await client.get(f"{plain.url}/health")).status_code == 200


async def test_a_batched_generate_answers_one_output_per_prompt(
    sim: SimServer, client: httpx.AsyncClient
) -> None:
    # io_struct.py GenerateReqInput: a list of texts (or of id lists) is a batch; a `rid` string
    # becomes `rid_0`, `rid_1`, ...; tokenizer_manager.py `_handle_batch_request` answers a
    # list in order when whole, and streams each output with its `index` when streamed
    one = {"sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    body = {"text": ["first prompt", "second prompt here"], "rid": "b", **one}
    r = await client.post(f"{sim.url}/generate", json=body)
    assert r.status_code == 200
    whole = r.json()
    assert isinstance(whole, list) and len(whole) == 2
    assert [o["meta_info"]["id"] for o in whole] == ["b_0", "b_1"]
    assert [o["meta_info"]["completion_tokens"] for o in whole] == [3, 3]
    assert whole[0]["meta_info"]["prompt_tokens"] != whole[1]["meta_info"]["prompt_tokens"]
    singles = [
        (await client.post(f"{sim.url}/generate", json={"text": t, **one})).json()
        for t in body["text"]
    ]
    assert [o["text"] for o in whole] == [o["text"] for o in singles]
    # streamed: every event names its prompt; each prompt's last event carries its finish
    _, events = await stream_post(client, f"{sim.url}/generate", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    outputs = events[:-1]
    assert {o["index"] for o in outputs} == {0, 1}
    for i in (0, 1):
        mine = [o for o in outputs if o["index"] == i]
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        assert mine[-1]["text"] == whole[i]["text"]
        assert mine[-1]["meta_info"]["id"] == f"b_{i}"
    # token-id prompts, per-prompt sampling params, and a list of rids
    ids_body = {"input_ids": [[1, 2, 3], [4, 5]], "rid": ["x", "y"],
                "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}  # fmt: skip
    out = (await client.post(f"{sim.url}/generate", json=ids_body)).json()
    assert [o["meta_info"]["id"] for o in out] == ["x", "y"]
    assert [o["meta_info"]["completion_tokens"] for o in out] == [1, 2]
    bad = {"text": ["a", "b"], "rid": ["only-one"]}
    r = await client.post(f"{sim.url}/generate", json=bad)
    assert r.status_code == 400 and "batch_size" in r.json()["error"]["message"]


async def test_completions_refuse_max_tokens_zero(
    sim: SimServer, client: httpx.AsyncClient
) -> None:
    # protocol.py CompletionRequest `validate_max_tokens_positive`: "max_tokens must be
    # positive" (a 400); chat takes 0 (`max_completion_tokens or max_tokens`: no new token)
    r = await client.post(f"{sim.url}/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens must be positive" in r.json()["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    r = await client.post(f"{sim.url}/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0
