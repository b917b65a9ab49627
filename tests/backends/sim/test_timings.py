"""`--record-timings`: each generation request's read and first-token `perf_counter()` stamps at
`/debug/timings`, on the same clock as the client's own."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from backends.sim import SimConfig, SimServer
from backends.sim.cli import build_parser, config_from
from tests.backends.sim.conftest import MakeSim

CHAT = [{"role": "user", "content": "tell me a story"}]
GENERATE = {"text": "once upon", "sampling_params": {"max_new_tokens": 8}}


async def timings(client: httpx.AsyncClient, server: SimServer) -> list[dict[str, Any]]:
    r = await client.get(f"{server.url}/debug/timings")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["clock"] == "perf_counter"
    return body["timings"]


async def stream_timed(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], is_content: Callable[[Any], bool]
) -> tuple[float, float, float]:
    """Stream a request; the client's perf_counter() before sending, when the first content
    event was read, and after the end."""
    before = time.perf_counter()
    first_seen = None
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            payload = line.removeprefix("data: ")
            if first_seen is None and line and payload != "[DONE]":
                if is_content(json.loads(payload)):
                    first_seen = time.perf_counter()
    assert first_seen is not None
    return before, first_seen, time.perf_counter()


def chat_content(event: Any) -> bool:
    return bool(event["choices"] and event["choices"][0]["delta"].get("content"))


def completion_content(event: Any) -> bool:
    return bool(event["choices"] and event["choices"][0]["text"])


def generate_content(event: Any) -> bool:
    return bool(event["text"])


async def test_off_by_default_is_404(sim: SimServer, client: httpx.AsyncClient) -> None:
    r = await client.post(f"{sim.url}/generate", json={"text": "hi", "rid": "r1"})
    assert r.status_code == 200
    r = await client.get(f"{sim.url}/debug/timings")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


@pytest.mark.parametrize(
    ("path", "body", "is_content"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8}, chat_content),
        ("/v1/completions", {"prompt": "once upon", "max_tokens": 8}, completion_content),
        ("/generate", GENERATE, generate_content),
    ],
)
async def test_stream_is_stamped_at_its_first_content(
    make_sim: MakeSim,
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    is_content: Callable[[Any], bool],
) -> None:
    # Real decode steps (ms), so that a stamp taken at the end of the stream would come
    # after the client read the first content.
    server = await make_sim(profile="h100-llama3-8b", record_timings=8)
    before, first_seen, after = await stream_timed(
        client, server.url + path, {**body, "stream": True, "rid": "s-1"}, is_content
    )
    [record] = await timings(client, server)
    assert record["rid"] == "s-1"
    assert before <= record["read_at"] <= record["first_token_at"] <= first_seen <= after


async def test_whole_answer_is_stamped_once_written(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    server = await make_sim(record_timings=8)
    before = time.perf_counter()
    r = await client.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    after = time.perf_counter()
    assert r.status_code == 200
    [record] = await timings(client, server)
    assert record["rid"] == r.json()["id"]  # no rid in the body: the generated one
    assert before <= record["read_at"] <= record["first_token_at"] <= after


async def test_a_proxys_label_keys_the_record(make_sim: MakeSim, client: httpx.AsyncClient) -> None:
    """Behind a proxy the body's rid is the proxy's own; the client's id is `x-request-id`."""
    server = await make_sim(record_timings=8)
    body = {"text": "hi", "rid": "edge-chosen"}
    r = await client.post(f"{server.url}/generate", json=body, headers={"x-request-id": "bench-1"})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "edge-chosen"
    [record] = await timings(client, server)
    assert record["rid"] == "bench-1"


async def test_only_the_last_n_are_kept_oldest_first(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    server = await make_sim(record_timings=2)
    for rid in ("a", "b", "c"):
        r = await client.post(f"{server.url}/generate", json={"text": "hi", "rid": rid})
        assert r.status_code == 200
    records = await timings(client, server)
    assert [t["rid"] for t in records] == ["b", "c"]
    assert records[0]["first_token_at"] < records[1]["read_at"]


async def test_aborted_before_its_first_token_has_no_first_token_time(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    # Scaled up, the prefill takes ~4 s: time to abort the request while it waits for it, on a
    # busy machine too; the abort ends it at once, so the test does not wait that long.
    server = await make_sim(profile="h100-llama3-8b", time_scale=500, record_timings=8)
    body = {"messages": CHAT, "max_tokens": 8, "stream": True, "rid": "gone"}
    task = asyncio.create_task(client.post(f"{server.url}/v1/chat/completions", json=body))
    assert server.scheduler is not None
    deadline = time.monotonic() + 10
    while server.scheduler.get("gone") is None:
        assert time.monotonic() < deadline, "the request was never submitted"
        await asyncio.sleep(0.005)
    r = await client.post(f"{server.url}/abort_request", json={"rid": "gone"})
    assert r.status_code == 200
    answer = await task  # SGLang's graceful abort: a stream that finishes with "abort"
    assert answer.status_code == 200 and '"finish_reason":"abort"' in answer.text
    [record] = await timings(client, server)
    assert record["rid"] == "gone" and record["first_token_at"] is None


async def test_an_answer_without_text_has_no_first_token_time(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    server = await make_sim(record_timings=8)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 0}, "stream": True, "rid": "e"}
    r = await client.post(f"{server.url}/generate", json=body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    [record] = await timings(client, server)
    assert record["rid"] == "e" and record["first_token_at"] is None


async def test_a_request_refused_by_validation_is_not_recorded(
    make_sim: MakeSim, client: httpx.AsyncClient
) -> None:
    server = await make_sim(record_timings=8)
    body = {"messages": [], "stream": True, "rid": "bad"}
    r = await client.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert await timings(client, server) == []


def test_config_and_flag() -> None:
    with pytest.raises(ValueError, match="record_timings must be >= 0"):
        SimConfig(record_timings=-1)
    assert config_from(build_parser().parse_args([])).record_timings == 0
    args = build_parser().parse_args(["--record-timings", "5"])
    assert config_from(args).record_timings == 5


def test_another_process_stamps_on_the_clients_clock() -> None:
    """What a benchmark relies on: a stand-in process's stamps fall inside this process's own
    perf_counter() window around the request (CLOCK_MONOTONIC on Linux)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends.sim", "--port", "0", "--record-timings", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[1]
        with httpx.Client(timeout=10) as client:
            before = time.perf_counter()
            r = client.post(f"{url}/generate", json={"text": "hi", "rid": "x-1"})
            after = time.perf_counter()
            assert r.status_code == 200
            body = client.get(f"{url}/debug/timings").json()
        [record] = body["timings"]
        assert record["rid"] == "x-1"
        # Another CPU's TSC may read a fraction of a millisecond apart on a VM; a clock with
        # another origin would be off by far more than this margin.
        skew = 0.005
        assert before - skew <= record["read_at"] <= record["first_token_at"] <= after + skew
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
