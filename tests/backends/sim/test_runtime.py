"""Behaviour while requests run: loads, metrics, aborts, flush, health, cache reports."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from backends.sim import SimServer, get_profile
from backends.sim.textgen import WORDS
from tests.backends.sim.conftest import MakeSim, sse_events, stream_post


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def load(client: httpx.AsyncClient, server: SimServer) -> dict[str, Any]:
    r = await client.get(f"{server.url}/v1/loads")
    assert r.status_code == 200
    return r.json()["loads"][0]


async def wait_load(
    client: httpx.AsyncClient, server: SimServer, pred: Any, timeout: float = 10.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        entry = await load(client, server)
        if pred(entry):
            return entry
        assert time.monotonic() < deadline, f"load never matched: {entry}"
        await asyncio.sleep(0.02)


async def test_running_and_queued_in_loads_and_metrics(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    server = await make_sim(profile="h100-llama3-8b", max_running_requests=16, enable_metrics=True)
    body = {"text": "count", "sampling_params": {"max_new_tokens": 20_000, "ignore_eos": True}}
    tasks = [
        asyncio.create_task(client.post(f"{server.url}/generate", json={**body, "rid": f"q{i}"}))
        for i in range(40)
    ]
    entry = await wait_load(
        client, server, lambda e: e["num_running_reqs"] + e["num_waiting_reqs"] == 40
    )
    assert entry["num_running_reqs"] == 16 and entry["num_waiting_reqs"] == 24
    text = (await client.get(f"{server.url}/metrics")).text
    assert metric(text, "sglang:num_running_reqs") == 16
    assert metric(text, "sglang:num_queue_reqs") == 24
    assert metric(text, "sglang:num_used_tokens") > 0
    assert metric(text, "sglang:gen_throughput") > 0  # first tokens came out of prefill
    legacy = (await client.get(f"{server.url}/get_load")).json()
    assert legacy[0]["num_reqs"] == 40 and legacy[0]["num_waiting_reqs"] == 24
    r = await client.post(f"{server.url}/abort_request", json={"abort_all": True})
    assert r.status_code == 200
    replies = await asyncio.gather(*tasks)
    # SGLang's graceful abort: a 200 whose finish_reason says so ("Abort in waiting queue" for
    # the queued ones)
    reasons = [r.json()["meta_info"]["finish_reason"] for r in replies]
    assert all(r.status_code == 200 for r in replies)
    assert (
        sorted(reason["message"] for reason in reasons)
        == ["Abort in waiting queue"] * 24 + ["Aborted"] * 16
    )
    assert all(reason["type"] == "abort" and reason["status_code"] is None for reason in reasons)
    entry = await load(client, server)
    assert entry["num_running_reqs"] == 0 and entry["num_waiting_reqs"] == 0
    text = (await client.get(f"{server.url}/metrics")).text
    assert metric(text, "sglang:num_aborted_requests_total") == 40


async def test_client_disconnect_aborts_stream(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    server = await make_sim(profile="h100-llama3-8b", enable_metrics=True)
    body = {
        "text": "tell me everything",
        "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True},
        "stream": True,
    }
    async with httpx.AsyncClient() as own:
        async with own.stream("POST", f"{server.url}/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
    # The connection is gone; the request must be aborted and its slot freed.
    await wait_load(client, server, lambda e: e["num_running_reqs"] == 0)
    text = (await client.get(f"{server.url}/metrics")).text
    assert metric(text, "sglang:num_aborted_requests_total") == 1


async def test_client_disconnect_aborts_non_stream(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    server = await make_sim(profile="h100-llama3-8b")
    payload = b'{"text": "x", "sampling_params": {"max_new_tokens": 100000, "ignore_eos": true}}'
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
        % (len(payload), payload)
    )
    await writer.drain()
    await wait_load(client, server, lambda e: e["num_running_reqs"] == 1)
    writer.close()
    await wait_load(client, server, lambda e: e["num_running_reqs"] == 0)


async def test_abort_request_by_rid_ends_the_stream(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    server = await make_sim(profile="h100-llama3-8b")
    body = {
        "text": "x",
        "rid": "victim",
        "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True},
        "stream": True,
    }

    async def abort_soon() -> int:
        await wait_load(client, server, lambda e: e["num_running_reqs"] == 1)
        r = await client.post(f"{server.url}/abort_request", json={"rid": "victim"})
        return r.status_code

    aborter = asyncio.create_task(abort_soon())
    _, events = await stream_post(client, f"{server.url}/generate", body)
    assert await aborter == 200
    assert events[-1] == "[DONE]"
    reason = events[-2]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort"


async def test_flush_cache(make_sim: MakeSim, client: httpx.AsyncClient) -> None:
    server = await make_sim(profile="h100-llama3-8b")
    ids = list(range(100))
    r = await client.post(
        f"{server.url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    )
    assert r.json()["meta_info"]["cached_tokens"] == 0
    busy = asyncio.create_task(
        client.post(
            f"{server.url}/generate",
            json={"text": "z", "rid": "busy", "sampling_params": {"max_new_tokens": 100_000}},
        )
    )
    await wait_load(client, server, lambda e: e["num_running_reqs"] == 1)
    r = await client.post(f"{server.url}/flush_cache")
    assert r.status_code == 400 and r.text.startswith("Cache flushed.")
    await client.post(f"{server.url}/abort_request", json={"rid": "busy"})
    await busy
    r = await client.get(f"{server.url}/flush_cache")
    assert r.status_code == 200
    r = await client.post(
        f"{server.url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    )
    assert r.json()["meta_info"]["cached_tokens"] == 0


async def test_health_is_503_until_warm(make_sim: MakeSim, client: httpx.AsyncClient) -> None:
    server = await make_sim(startup_delay=2.0)  # time to ask before it ends, on a busy machine
    r = await client.get(f"{server.url}/health")
    assert r.status_code == 503
    deadline = time.monotonic() + 10
    while (await client.get(f"{server.url}/health")).status_code != 200:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    r = await client.get(f"{server.url}/health_generate")
    assert r.status_code == 200 and r.content == b""


async def test_info_routes(sim: SimServer, client: httpx.AsyncClient) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = (await client.get(f"{sim.url}{path}")).json()
        for key in ("model_path", "served_model_name", "page_size", "chunked_prefill_size",
                    "max_prefill_tokens", "schedule_policy", "max_running_requests",
                    "max_total_tokens", "enable_cache_report", "scheduler_info",
                    "internal_states", "version"):  # fmt: skip
            assert key in info, key
        assert info["schedule_policy"] == "fcfs" and info["page_size"] == 1
    for path in ("/model_info", "/get_model_info"):
        info = (await client.get(f"{sim.url}{path}")).json()
        assert info["is_generation"] is True and info["model_path"]


@pytest.mark.parametrize("report", [False, True])
async def test_cache_report_flag(
    make_sim: MakeSim, client: httpx.AsyncClient, report: bool
) -> None:
    server = await make_sim(enable_cache_report=report)
    body = {"prompt": "shared prefix words", "max_tokens": 2}
    first = (await client.post(f"{server.url}/v1/completions", json=body)).json()
    assert first["usage"]["prompt_tokens_details"] is None  # nothing cached yet
    second = (await client.post(f"{server.url}/v1/completions", json=body)).json()
    details = second["usage"]["prompt_tokens_details"]
    if report:
        assert details == {"cached_tokens": second["usage"]["prompt_tokens"] - 1}
    else:
        assert details is None


async def test_multi_turn_chat_hits_on_previous_turn_and_answer(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    server = await make_sim(enable_cache_report=True, natural_output_len=(6, 6))
    url = f"{server.url}/v1/chat/completions"
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    turn1 = (await client.post(url, json={"messages": messages})).json()
    assert turn1["choices"][0]["finish_reason"] == "stop"  # natural end of turn
    answer = turn1["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Another."}]
    turn2 = (await client.post(url, json={"messages": messages})).json()
    cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Turn 1's prompt and its whole answer (ending in <|eot_id|>) are reused token for token.
    assert cached == turn1["usage"]["prompt_tokens"] + turn1["usage"]["completion_tokens"]


async def test_output_is_deterministic_per_seed(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    a, b, c = await make_sim(seed=1), await make_sim(seed=1), await make_sim(seed=2)
    body = {"text": "same prompt", "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
    texts = [(await client.post(f"{s.url}/generate", json=body)).json()["text"] for s in (a, b, c)]
    assert texts[0] == texts[1] != texts[2]


async def test_prefill_time_over_http(make_sim: MakeSim, client: httpx.AsyncClient) -> None:
    # Stretch simulated time so that the gap (~1 s) dwarfs a loaded machine's scheduling noise.
    scale = 20.0
    server = await make_sim(profile="h100-llama3-8b", time_scale=scale, enable_cache_report=True)
    profile = get_profile("h100-llama3-8b")
    system = "".join(WORDS[i % len(WORDS)] for i in range(2000))
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Go"}],
        "max_tokens": 1,
        "stream": True,
    }

    async def ttft() -> float:
        start = time.perf_counter()
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            events = await sse_events(r)
        assert events[-1] == "[DONE]"
        return time.perf_counter() - start

    cold, warm = await ttft(), await ttft()
    predicted = profile.predict_ttft(2018) * scale
    assert cold >= 0.95 * predicted  # simulated compute is never skipped
    assert warm < cold / 3


async def test_keep_alive_and_idle_timeout(make_sim: MakeSim) -> None:
    server = await make_sim(timeout_keep_alive=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for _ in range(3):  # three requests on one connection
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    # Idle past the keep-alive timeout: the server closes (as uvicorn does in SGLang).
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()


async def test_disconnect_during_prefill_aborts(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    # An 8k prefill takes ~30 s scaled: only the abort can end the request within the wait.
    server = await make_sim(profile="h100-llama3-8b", time_scale=100.0)
    body = {"prompt": list(range(1000, 9000)), "max_tokens": 5, "stream": True}
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    await writer.drain()
    await wait_load(client, server, lambda e: e["num_running_reqs"] == 1)
    writer.close()  # before the first token exists
    await wait_load(client, server, lambda e: e["num_running_reqs"] == 0, timeout=10.0)


async def test_token_usage_counts_only_what_cannot_be_evicted(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    # As SGLang: used = max_total - (available + evictable). A finished request leaves its
    # tokens cached but unlocked, so an idle server with a warm cache reports no usage.
    server = await make_sim(profile="instant", max_total_tokens=10_000)
    r = await client.post(
        f"{server.url}/generate",
        json={"input_ids": list(range(500)), "sampling_params": {"max_new_tokens": 4}},
    )
    assert r.status_code == 200
    idle = await load(client, server)
    assert idle["num_running_reqs"] == 0
    assert idle["token_usage"] == 0.0 and idle["num_used_tokens"] == 0
    busy = asyncio.create_task(
        client.post(
            f"{server.url}/generate",
            json={
                "input_ids": list(range(500)),
                "rid": "busy",
                "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True},
            },
        )
    )
    running = await wait_load(client, server, lambda e: e["num_running_reqs"] == 1)
    assert running["num_used_tokens"] >= 500 and running["token_usage"] > 0
    await client.post(f"{server.url}/abort_request", json={"rid": "busy"})
    await busy
