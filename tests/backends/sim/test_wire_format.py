"""The HTTP contract, field for field, against a real SimServer over a real socket."""

from __future__ import annotations

import asyncio
import json

import httpx

from backends.sim import SimServer
from tests.backends.sim.conftest import stream_post

META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "total_retractions",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "dp_rank",
}


async def test_generate_non_stream(sim: SimServer, client: httpx.AsyncClient) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}
    r = await client.post(f"{sim.url}/generate", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert META_KEYS | {"e2e_latency", "response_sent_to_client_ts"} == set(meta)
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == 8 == len(out["output_ids"])
    assert meta["prompt_tokens"] == 6  # BOS + 5 pieces
    assert meta["cached_tokens"] == 0
    assert isinstance(out["text"], str) and out["text"]
    # Deterministic: the same prompt gives the same answer.
    again = (await client.post(f"{sim.url}/generate", json=body)).json()
    assert again["text"] == out["text"] and again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["cached_tokens"] == 5  # prompt_tokens - 1


async def test_generate_stream_is_cumulative_and_ends_with_done(
    sim: SimServer, client: httpx.AsyncClient
) -> None:
    body = {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
        "stream": True,
        "rid": "req-abc",
    }
    r, events = await stream_post(client, f"{sim.url}/generate", body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5]
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        assert cur["text"].startswith(prev["text"])  # cumulative text
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    for c in chunks[:-1]:
        assert set(c["meta_info"]) == META_KEYS and c["meta_info"]["finish_reason"] is None
        assert c["meta_info"]["id"] == "req-abc"
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 5}
    assert "e2e_latency" in last and last["e2e_latency"] >= 0


async def test_chat_stream_order(sim: SimServer, client: httpx.AsyncClient) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r, events = await stream_post(client, f"{sim.url}/v1/chat/completions", body)
    assert r.status_code == 200
    assert events[-1] == "[DONE]"
    role, *content, finish, usage = events[:-1]
    for e in events[:-1]:
        assert e["object"] == "chat.completion.chunk" and e["model"] == "m"
        assert e["id"] == role["id"]
    assert role["choices"][0]["delta"] == {
        "reasoning_content": None,
        "role": "assistant",
        "content": "",
    }
    assert len(content) == 4
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert all(c["choices"][0]["delta"]["content"] for c in content)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["choices"][0]["delta"]["content"] is None
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 4


async def test_completions_stream_finish_on_last_content_chunk(
    sim: SimServer, client: httpx.AsyncClient
) -> None:
    body = {"prompt": "Once upon", "max_tokens": 3, "stream": True}
    r, events = await stream_post(client, f"{sim.url}/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 3  # no usage chunk without include_usage
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)


async def test_chat_non_stream(sim: SimServer, client: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    r = await client.post(f"{sim.url}/v1/chat/completions", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "chat.completion"
    assert set(out) == {"id", "object", "created", "model", "choices", "usage", "metadata"}
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None
    usage = out["usage"]
    assert set(usage) == {
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "reasoning_tokens",
    }
    assert usage["completion_tokens"] == 3


async def test_models_and_health(sim: SimServer, client: httpx.AsyncClient) -> None:
    r = await client.get(f"{sim.url}/v1/models")
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "list"
    card = data["data"][0]
    assert card["owned_by"] == "sglang" and card["id"] == sim.config.model_name
    r = await client.get(f"{sim.url}/health")
    assert r.status_code == 200 and r.content == b""


async def test_continuous_usage_stats(sim: SimServer, client: httpx.AsyncClient) -> None:
    body = {
        "prompt": "x",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    _, events = await stream_post(client, f"{sim.url}/v1/completions", body)
    content = [e for e in events[:-1] if e["choices"]]
    assert [e["usage"]["completion_tokens"] for e in content] == [1, 2, 3]


async def test_stop_string_on_chat(sim: SimServer, client: httpx.AsyncClient) -> None:
    base = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 12, "ignore_eos": True}
    full = (await client.post(f"{sim.url}/v1/chat/completions", json=base)).json()
    text = full["choices"][0]["message"]["content"]
    word = text.split()[4].strip(",.")
    stopped = (
        await client.post(f"{sim.url}/v1/chat/completions", json={**base, "stop": [word]})
    ).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == word
    assert choice["message"]["content"] == text[: text.index(word)]


async def test_content_parts_render_like_a_string(
    sim: SimServer, client: httpx.AsyncClient
) -> None:
    url = f"{sim.url}/v1/chat/completions"
    plain = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
    parts = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        "max_tokens": 2,
    }
    a = (await client.post(url, json=plain)).json()
    b = (await client.post(url, json=parts)).json()
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


async def test_token_id_prompt_and_prefill_only(sim: SimServer, client: httpx.AsyncClient) -> None:
    r = await client.post(f"{sim.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == 3
    r = await client.post(
        f"{sim.url}/generate",
        json={"input_ids": [9, 9, 9], "sampling_params": {"max_new_tokens": 0}},
    )
    out = r.json()
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


async def test_pipelined_requests_answer_in_order(sim: SimServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    body = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "rid": "p%d"}'
    requests = b"".join(
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body % i), body % i)
        for i in range(3)
    )
    writer.write(requests)
    for i in range(3):
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        payload = await reader.readexactly(length)
        assert b'"id":"p%d"' % i in payload
    writer.close()


async def test_chat_content_chunk_bytes_match_the_generic_encoding(
    sim: SimServer, client: httpx.AsyncClient
) -> None:
    body = {"messages": [{"role": "user", "content": "é ü"}], "max_tokens": 3, "stream": True}
    async with client.stream("POST", f"{sim.url}/v1/chat/completions", json=body) as r:
        raw = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    for line in raw:
        event = json.loads(line[len("data: ") :])
        generic = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
        assert line[len("data: ") :] == generic
