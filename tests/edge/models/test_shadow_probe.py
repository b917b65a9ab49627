"""One waiting request on an otherwise idle canary is no overload. SGLang's `/health` sends a
one-token probe through its scheduler at every check (the edge's, a router's, another edge
replica's), and a mirror itself queues until the canary's next scheduler step: a `/v1/loads`
poll taken then shows one waiting request, gone by the next poll. Mirrors are neither skipped nor
cancelled for it; a queue that stays, or more than one waiting, still makes them give way."""

from __future__ import annotations

import asyncio
import json

import httpx

from edge.models.config import BackendModel
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.edge.models.test_pools_e2e import chat
from tests.edge.models.test_shadow_cancel import shadowed
from tests.helpers import wait_until


def answer() -> Reply:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}  # fmt: skip
    return Reply(chunks=[json.dumps(body).encode()], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip


def loads(waiting: int) -> Reply:
    rank = {"num_running_reqs": 1, "num_waiting_reqs": waiting, "num_used_tokens": 10,
            "token_usage": 0.0, "max_total_num_tokens": 100000}  # fmt: skip
    return Reply(chunks=[json.dumps({"loads": [rank]}).encode()], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip


class Canary:
    """A canary whose polls show `waiting` requests: on every other poll (a probe or the
    mirror caught in the queue once), or on every poll (a queue that stays)."""

    def __init__(self, waiting: int, every_other: bool) -> None:
        self.waiting = waiting
        self.every_other = every_other
        self.polls = 0

    async def __call__(self, recorded: Recorded) -> Reply:
        if recorded.path == "/v1/loads":
            self.polls += 1
            queued = not self.every_other or self.polls % 2 == 0
            return loads(self.waiting if queued else 0)
        known = health_ok(recorded)
        if known is not None:
            return known
        if b"-shadow-c" in recorded.body:
            await asyncio.sleep(0.5)  # the mirror generates across several polls
        return answer()


async def counted(admin_url: str, name: str) -> dict[str, float]:
    async with httpx.AsyncClient() as admin:
        text = (await admin.get(admin_url + "/metrics")).text
    out = {}
    for row in text.splitlines():
        if row.startswith(name + "{"):
            labels, value = row.rsplit(" ", 1)
            out[labels.split(",")[-1].split('"')[1]] = float(value)
    return out


async def mirror_three(canary: Canary) -> tuple[dict[str, float], dict[str, float]]:
    async def stable(recorded: Recorded) -> Reply:
        return health_ok(recorded) or answer()

    async with TinyUpstream(stable) as s1, TinyUpstream(canary) as s2:
        models = shadowed()
        models.backends = [BackendModel(s1.url, model="m", version="v1"),
                           BackendModel(s2.url, model="m", version="v2")]  # fmt: skip
        # polls slower than the mirrors' watcher looks (`WATCH_INTERVAL`), as by default (1 s)
        config = fast_config([s1.url, s2.url], loads_interval=0.15)
        async with run_edge(config, models=models) as edge, client(edge) as http:
            shadow = edge.wiring.models.shadows["m"]
            await wait_until(lambda: canary.polls >= 4, timeout=10)
            for _ in range(3):
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "0"})  # fmt: skip
                assert r.status_code == 200
                await wait_until(lambda: not shadow._tasks, timeout=10)
            cancelled = await counted(edge.admin_url, "quicedge_shadow_cancelled_total")
            results = await counted(edge.admin_url, "quicedge_shadow_requests_total")
            return cancelled, results


async def test_one_waiting_request_seen_now_and_then_does_not_strain_the_canary() -> None:
    cancelled, results = await mirror_three(Canary(1, every_other=True))
    assert cancelled.get("queue", 0.0) == 0.0 and "canary_busy" not in results
    assert results["compared"] == 3.0


async def test_one_waiting_request_that_stays_cancels_the_mirrors() -> None:
    cancelled, results = await mirror_three(Canary(1, every_other=False))
    assert results.get("compared", 0.0) == 0.0
    assert cancelled.get("queue", 0.0) + results.get("canary_busy", 0.0) == 3.0


async def test_a_queue_of_several_strains_the_canary_at_once() -> None:
    cancelled, results = await mirror_three(Canary(3, every_other=True))
    assert results.get("compared", 0.0) == 0.0
    assert cancelled.get("queue", 0.0) + results.get("canary_busy", 0.0) == 3.0
