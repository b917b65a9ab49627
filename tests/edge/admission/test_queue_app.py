"""The throttle and the admission queue in the app, against a stand-in whose single running slot
makes a queue: the backend's own queue stays at the configured depth while the rest wait at the
edge, gold leaves the edge's queue first, and the throttle lets go once the load is gone."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from backends.sim import SimServer
from edge.admission.settings import AdmissionSettings, AnonymousSettings, ThrottleSettings
from tests.edge.admission.test_app_admission import bearer, tenant
from tests.edge.conftest import (
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.edge.test_app_sim import metrics_text, sim_config
from tests.helpers import wait_until


def chat(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "default", "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
    }  # fmt: skip


def slow_sim(name: str) -> Any:
    # one running request at a time, ~4.5 ms per token
    return sim_config(name, profile="h100-llama3-8b", max_running_requests=1)


def settings(depth: int, **throttle: Any) -> AdmissionSettings:
    return AdmissionSettings(
        anonymous=AnonymousSettings(tier="bronze"),
        throttle=ThrottleSettings(max_queue_depth=depth, queue_timeout_s=60.0, **throttle),
        tenants=[tenant("vip", "gold", "sk-vip"), tenant("mid", "silver", "sk-mid")],
    )


async def test_backend_queue_stays_bounded_and_the_edge_queue_drains() -> None:
    async with SimServer(slow_sim("b1")) as sim:
        config = fast_config([sim.url])
        config.admission = settings(2)
        async with run_edge(config) as edge, client(edge) as http:
            deepest = 0
            edge_queue = edge.wiring.admission.queue
            assert edge_queue is not None

            async def watch() -> None:
                nonlocal deepest
                while True:
                    deepest = max(deepest, sim.scheduler.num_waiting)
                    await asyncio.sleep(0.002)

            watcher = asyncio.ensure_future(watch())
            try:
                answers = await asyncio.gather(
                    *(http.post("/v1/chat/completions", json=chat(20)) for _ in range(12))
                )
            finally:
                watcher.cancel()
            assert [a.status_code for a in answers] == [200] * 12
            # the edge never let more than max_queue_depth requests wait on the backend
            assert deepest <= 2
            text = await metrics_text(edge)
            placed = [
                line for line in text.splitlines()
                if line.startswith("quicedge_admission_queue_wait_seconds_count")
                and 'outcome="placed"' in line
            ]  # fmt: skip
            assert placed and float(placed[0].split()[-1]) >= 1  # some had to wait at the edge
            # recovered: with the load gone a new request is placed at once
            assert edge_queue.waiting == 0
            backend = edge.wiring.registry.backends[0]
            await wait_until(lambda: edge.wiring.admission.queue.throttle.share(backend) == 1.0)  # type: ignore[union-attr]
            r = await http.post("/v1/chat/completions", json=chat(2))
            assert r.status_code == 200


async def test_gold_leaves_the_queue_before_silver_and_bronze() -> None:
    async with SimServer(slow_sim("b1")) as sim:
        config = fast_config([sim.url], loads_interval=60.0)
        config.admission = settings(1, recheck_s=0.02)
        async with run_edge(config) as edge, client(edge) as http:
            queue = edge.wiring.admission.queue
            backend = edge.wiring.registry.backends[0]
            assert queue is not None
            done: list[str] = []

            async def send(name: str, key: str | None, tokens: int) -> httpx.Response:
                headers = bearer(key) if key else {}
                body = chat(tokens, stream=True)  # a stream: its first token frees its place
                r = await http.post("/v1/chat/completions", json=body, headers=headers)
                done.append(name)
                return r

            # a long request runs; one more waits on the backend (depth 1 = the maximum)
            long = asyncio.ensure_future(send("long", None, 400))
            await wait_until(lambda: backend.in_flight == 1 and backend.in_prefill == 0)
            second = asyncio.ensure_future(send("second", None, 5))
            await wait_until(lambda: backend.in_prefill == 1)
            order = [
                ("bronze-1", None),
                ("silver", "sk-mid"),
                ("bronze-2", None),
                ("gold", "sk-vip"),
            ]
            tasks = []
            for name, key in order:
                tasks.append(asyncio.ensure_future(send(name, key, 5)))
                await wait_until(lambda n=len(tasks): queue.waiting == n)  # type: ignore[misc]
            assert not long.done(), "the long request must outlast the queueing"
            answers = await asyncio.gather(long, second, *tasks)
            assert [a.status_code for a in answers] == [200] * 6
            assert done == ["long", "second", "gold", "silver", "bronze-1", "bronze-2"]


async def test_a_request_no_backend_takes_in_time_gets_503_with_retry_after() -> None:
    async with SimServer(slow_sim("b1")) as sim:
        config = fast_config([sim.url])
        config.admission = AdmissionSettings(
            throttle=ThrottleSettings(max_queue_depth=1, depth="in_flight", queue_timeout_s=0.5)
        )
        async with run_edge(config) as edge, client(edge) as http:
            backend = edge.wiring.registry.backends[0]
            long = asyncio.ensure_future(http.post("/v1/chat/completions", json=chat(400, True)))
            await wait_until(lambda: backend.in_flight == 1)
            r = await http.post("/v1/chat/completions", json=chat(5))
            assert r.status_code == 503
            error = r.json()["error"]
            assert error["code"] == "overloaded" and error["type"] == "server_error"
            assert r.headers["retry-after"] == "1"
            assert r.headers["retry-after-ms"] == "500"  # the queue's timeout, exactly
            assert not long.done(), "the long request must outlast the refused one"
            assert (await long).status_code == 200
            text = await metrics_text(edge)
            refused = 'model="default",route="/v1/chat/completions",status="503"'
            assert f"quicedge_requests_total{{{refused}}} 1.0" in text


async def test_a_backend_whose_load_polls_fail_is_throttled_by_the_edges_own_count() -> None:
    """A backend that reported a deep queue once and whose `/v1/loads` then fails (its
    `/health` fine) is not held at that report: the edge's own count, 0 here, lets it serve."""
    busy = True

    def answer(recorded: Recorded) -> Reply:
        if recorded.path in ("/v1/loads", "/get_load") and not busy:
            return Reply(status=500, chunked=False)
        if recorded.path in ("/v1/loads", "/get_load"):
            rank = {"num_running_reqs": 0, "num_waiting_reqs": 50, "num_used_tokens": 0,
                    "token_usage": 0.0, "max_total_num_tokens": 100000}  # fmt: skip
            return Reply(chunks=[json.dumps({"loads": [rank]}).encode()], chunked=False,
                         headers=[("content-type", "application/json")])  # fmt: skip
        reply = health_ok(recorded)
        if reply is not None:
            return reply
        body = {"id": "x", "object": "text_completion",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}  # fmt: skip
        return Reply(chunks=[json.dumps(body).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    async with TinyUpstream(answer) as up:
        config = fast_config([up.url], loads_interval=0.05)
        config.admission = AdmissionSettings(
            throttle=ThrottleSettings(max_queue_depth=8, queue_timeout_s=0.3, recheck_s=0.02)
        )
        body = {"model": "tiny-model", "prompt": "Hello"}
        async with run_edge(config) as edge, client(edge) as http:
            backend = edge.wiring.registry.backends[0]
            await wait_until(lambda: backend.load is not None)
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
            busy = False
            await wait_until(lambda: backend.load_polls_failing >= 1)
            assert backend.load.num_waiting_reqs == 50  # kept, for routing
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
