"""One waiting request on an otherwise idle backend is SGLang's `/health` probe (sent through
the scheduler at every check, by the edge, a router or another replica), not a queue: the
throttle at `max_queue_depth = 1` still takes requests while the loads report it; two waiting
still shut the backend."""

from __future__ import annotations

import json

from edge.admission.settings import AdmissionSettings, AnonymousSettings, ThrottleSettings
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.helpers import wait_until


def loads(waiting: int) -> Reply:
    rank = {"num_running_reqs": 0, "num_waiting_reqs": waiting, "num_used_tokens": 0,
            "token_usage": 0.0, "max_total_num_tokens": 100000}  # fmt: skip
    return Reply(chunks=[json.dumps({"loads": [rank]}).encode()], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip


def answer() -> Reply:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}  # fmt: skip
    return Reply(chunks=[json.dumps(body).encode()], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip


async def status_with(waiting: int) -> int:
    async def upstream(recorded: Recorded) -> Reply:
        if recorded.path == "/v1/loads":
            return loads(waiting)  # the probe caught by every poll: the worst case
        return health_ok(recorded) or answer()

    async with TinyUpstream(upstream) as s1:
        config = fast_config([s1.url])
        config.admission = AdmissionSettings(
            anonymous=AnonymousSettings(tier="bronze"),
            throttle=ThrottleSettings(max_queue_depth=1, queue_timeout_s=0.3),
        )
        async with run_edge(config) as edge, client(edge) as http:
            backend = edge.wiring.registry.backends[0]
            await wait_until(lambda: backend.load is not None, timeout=5.0)
            body = {"model": "default", "messages": [{"role": "user", "content": "go"}],
                    "max_tokens": 1}  # fmt: skip
            reply = await http.post("/v1/chat/completions", json=body)
            return reply.status_code


async def test_a_lone_waiting_request_on_an_idle_backend_does_not_shut_it() -> None:
    assert await status_with(1) == 200


async def test_two_waiting_still_shut_it_at_depth_one() -> None:
    assert await status_with(2) == 503
