"""Many streams at once through `quicedge serve` in its own process, in front of a stand-in in
another: what a busy edge does with bursts of requests and first tokens.

With the edge, its backend and its clients in separate processes, a burst of request starts
holds the edge's loop while first tokens arrive, so heads and first tokens are read out of the
loop's turn (`backends/urgent_reads.py`) and relayed from the read that brought them
(`StreamRelay.begin`). Every answer must still arrive whole and in order, and every count must
return to zero.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import free_port, wait_for_tcp
from tests.transport.conftest import ServeProcess

STREAMS = 32
ROUNDS = 3
TOKENS = 64


@pytest.fixture
def stand_in() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends.sim", "--port", str(port), "--name", "s1",
         "--profile", "instant"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_tcp("127.0.0.1", port, timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(15)


async def one_stream(http: httpx.AsyncClient, rid: str) -> tuple[str, int]:
    """One streamed chat answer: its `x-request-id` and its content tokens, checked whole."""
    body = {
        "model": "default", "stream": True, "max_tokens": TOKENS,
        "messages": [{"role": "user", "content": f"stream {rid}: say something long"}],
    }  # fmt: skip
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"x-request-id": rid}
    ) as response:
        assert response.status_code == 200
        events = [line async for line in response.aiter_lines() if line]
        request_id = response.headers["x-request-id"]
    assert events[-1] == "data: [DONE]", events[-3:]
    tokens = 0
    for event in events[:-1]:
        assert event.startswith("data: "), event
        chunk = json.loads(event[len("data: ") :])  # a torn or reordered event fails here
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        tokens += bool(delta.get("content"))
    return request_id, tokens


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_32_streams_in_bursts_arrive_whole(stand_in: str, loop: str) -> None:
    """uvloop is `serve`'s default; asyncio's own loop reads the same sockets differently."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    http_port = free_port()
    serve = ServeProcess(
        "--backend", stand_in, "--http", f"127.0.0.1:{http_port}", "--loop", loop
    )  # fmt: skip
    try:
        assert f"quicedge serve: loop   {loop}" in serve.lines
        limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{http_port}", limits=limits, timeout=30
        ) as http:
            for round_ in range(ROUNDS):
                rids = [f"r{round_}-{i}" for i in range(STREAMS)]
                answers = await asyncio.gather(*(one_stream(http, rid) for rid in rids))
                assert [a[0] for a in answers] == rids
                assert all(tokens == TOKENS for _, tokens in answers), answers
        served = STREAMS * ROUNDS
        requests = (
            'quicedge_requests_total{model="default",route="/v1/chat/completions",status="200"}'
        )
        assert serve.metric(requests) == served
        backend = stand_in.removeprefix("http://")  # a backend is named by its host:port
        assert serve.metric(f'quicedge_backend_in_flight{{backend="{backend}"}}') == 0
        assert "quicedge_upstream_errors_total{" not in serve.metrics()
        # how many first tokens were read between request starts: load-dependent, so only shown
        print("urgent reads:", serve.metric("quicedge_upstream_urgent_reads_total"))
    finally:
        assert serve.stop() == 0, serve.errors()
