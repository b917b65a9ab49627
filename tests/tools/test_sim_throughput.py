"""`tools.sim_throughput`'s client against an in-process stand-in: every answer has a TTFT."""

from __future__ import annotations

import json
import time

from backends.sim import SimConfig, SimServer
from tools.sim_throughput import ClientStats, run_client


async def test_a_first_token_read_with_the_role_chunk_still_counts() -> None:
    # One token: the role chunk, the token, the finish and usage come in one read.
    body = json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip
    async with SimServer(SimConfig(name="st", port=0, profile="instant")) as sim:
        host, port = sim.url.removeprefix("http://").rsplit(":", 1)
        stats = ClientStats()
        await run_client(host, int(port), body, time.perf_counter() + 0.05, stats)
    assert stats.requests >= 1
    assert len(stats.ttfts) == stats.requests
