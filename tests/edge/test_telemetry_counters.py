"""Counters never go down: a backend that reports a negative count (a bug, or a hostile backend)
must not turn a counter back, which Prometheus takes for a restart (`rate()` then counts the
whole remaining total as new)."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)


def completion_tokens_counted(registry: CollectorRegistry) -> float:
    text = generate_latest(registry).decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "quicedge_tenant_tokens_total" and s.labels["kind"] == "completion"
    )


def answer(completion: int) -> Reply:
    usage = {"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion}
    event = {"choices": [{"index": 0, "text": "hi"}], "usage": usage}
    return Reply(
        headers=[("content-type", "text/event-stream")],
        chunks=[b"data: " + json.dumps(event).encode() + b"\n\n", b"data: [DONE]\n\n"],
    )


async def test_a_negative_token_count_from_the_backend_does_not_turn_the_counter_back() -> None:
    reported = iter([40, -1000, 5])

    def script(recorded: Recorded) -> Reply:
        return health_ok(recorded) or answer(next(reported))

    async with TinyUpstream(script) as upstream, run_edge(fast_config([upstream.url])) as edge:
        seen = []
        async with client(edge) as http:
            for _ in range(3):
                body = {"model": "default", "prompt": "Hello", "max_tokens": 4, "stream": True}
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200
                seen.append(completion_tokens_counted(edge.registry))
        assert seen == sorted(seen), seen  # never down
        # the negative count is unknown, so the answer is charged what it relayed, one content
        # chunk (`edge.sse`): 40, then 41, then 46
        assert seen == [40, 41, 46], seen
