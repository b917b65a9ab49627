"""End to end over real sockets: httpx → hypercorn (H1, and H2 over TLS) → the app → pool → 2–3
`SimServer`s. Streaming and not on every route, ids, /v1/models, aborts, health, admin, metrics."""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from backends.sim import SimConfig, SimServer
from tests.edge.conftest import (
    LISTENERS,
    Edge,
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    health_ok,
    run_edge,
)
from tests.helpers import wait_until
from transport.h1_server import H1Listener

CHAT = {"messages": [{"role": "user", "content": "Say hello to the edge"}], "max_tokens": 8}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "default", **CHAT},
    "/v1/completions": {"model": "default", "prompt": "Once upon a time", "max_tokens": 8},
    "/generate": {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8}},
}


def sim_config(name: str, **overrides: Any) -> SimConfig:
    values: dict[str, Any] = {
        "name": name,
        "port": 0,
        "profile": "instant",
        "enable_metrics": True,
        "enable_cache_report": True,
        "seed": 0,
    }
    values.update(overrides)
    return SimConfig(**values)


@contextlib.asynccontextmanager
async def sims(*configs: SimConfig) -> AsyncIterator[list[SimServer]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(SimServer(c)) for c in configs]


def data_events(content: bytes) -> list[bytes]:
    return [e[len(b"data: ") :] for e in content.split(b"\n\n") if e.startswith(b"data: ")]


async def metrics_text(edge: Edge) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(edge.admin_url + "/metrics")).text


@pytest.mark.parametrize("route", list(BODIES))
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_every_route_streams_and_answers_whole(route: str, stream: bool) -> None:
    async with sims(sim_config("b1"), sim_config("b2")) as servers:
        async with (
            run_edge(fast_config([s.url for s in servers], expose_backend_names=True)) as edge,
            client(edge) as http,
        ):
            body = {**BODIES[route], "stream": stream}
            response = await http.post(route, json=body, headers={"x-request-id": "rq-1"})
            assert response.status_code == 200, response.text
            assert response.headers["x-request-id"] == "rq-1"
            assert response.headers["x-quicedge-backend"] in {
                b.name for b in edge.wiring.registry.backends
            }
            if stream:
                assert response.headers["content-type"].startswith("text/event-stream")
                events = data_events(response.content)
                assert events[-1] == b"[DONE]"
                last = json.loads(events[-2])
            else:
                last = response.json()
            if route == "/generate":
                # the backend's rid is the edge's own; the client's id is only the label
                assert last["meta_info"]["id"] not in ("rq-1", "")
                assert last["meta_info"]["completion_tokens"] == 8
            elif not stream:
                assert last["usage"]["completion_tokens"] == 8
            assert [b.in_flight for b in edge.wiring.registry.backends] == [0, 0]


async def test_a_streamed_tool_call_is_timed_from_its_first_argument_token() -> None:
    """An answer that is only a tool call has no text: its arguments are its tokens, so the
    TTFT and the gaps are measured on them."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    body = {**BODIES["/v1/chat/completions"], "stream": True, "tools": [tool],
            "tool_choice": "required"}  # fmt: skip
    async with sims(sim_config("b1")) as servers:
        async with run_edge(fast_config([s.url for s in servers])) as edge, client(edge) as http:
            response = await http.post("/v1/chat/completions", json=body)
            text = await metrics_text(edge)
    events = data_events(response.content)
    assert b'"tool_calls":[{"index":0,"id":"call_' in b"".join(events)
    assert b'"finish_reason":"tool_calls"' in b"".join(events)
    counts = {line.split("{")[0]: line.rsplit(" ", 1)[1] for line in text.splitlines()
              if line.startswith(("quicedge_ttft_seconds_count{",
                                  "quicedge_inter_token_seconds_count{"))}  # fmt: skip
    assert counts["quicedge_ttft_seconds_count"] == "1.0"
    assert float(counts["quicedge_inter_token_seconds_count"]) >= 1


async def test_a_reasoning_models_stream_is_timed_from_its_first_thinking_token() -> None:
    """A reasoning model (SGLang with `--reasoning-parser`) thinks in `reasoning_content`
    before it answers: the first thinking token is the first token."""

    def thinker(recorded: Recorded) -> Reply:
        ok = health_ok(recorded)
        if ok is not None:
            return ok
        deltas = [{"reasoning_content": t, "content": None} for t in ("Let", " me", " see")]
        chunks = [b"data: " + json.dumps({"choices": [{"index": 0, "delta": d}]}).encode()
                  + b"\n\n" for d in deltas]  # fmt: skip
        return Reply(headers=[("content-type", "text/event-stream")],
                     chunks=[*chunks, b"data: [DONE]\n\n"])  # fmt: skip

    async with TinyUpstream(thinker) as up:
        async with run_edge(fast_config([up.url])) as edge, client(edge) as http:
            body = {"messages": [{"role": "user", "content": "Think."}], "stream": True}
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            text = await metrics_text(edge)
    counts = {line.split("{")[0]: line.rsplit(" ", 1)[1] for line in text.splitlines()
              if line.startswith("quicedge_ttft_seconds_count{")}  # fmt: skip
    assert counts["quicedge_ttft_seconds_count"] == "1.0"


async def test_h2_over_tls_and_metric_labels(dev_certs: Any) -> None:
    async with sims(sim_config("b1")) as servers:
        config = fast_config([s.url for s in servers])
        async with run_edge(config, certs=dev_certs) as edge:
            async with httpx.AsyncClient(
                base_url=edge.url,
                http2=True,
                verify=ssl.create_default_context(cafile=str(dev_certs.ca_cert)),
                timeout=20,
            ) as http:
                for _ in range(2):  # the second one finds the prompt cached
                    body = {**BODIES["/generate"], "stream": True}
                    response = await http.post("/generate", json=body)
                    assert response.http_version == "HTTP/2"
                    assert response.status_code == 200
            text = await metrics_text(edge)
    name = edge.wiring.registry.backends[0].name
    assert (
        f'quicedge_ttft_seconds_count{{backend="{name}",cache="miss",early_data="1rtt",'
        f'model="default",transport="h2"}} 1.0' in text
    )
    assert 'cache="partial",early_data="1rtt",model="default",transport="h2"' in text
    assert f'quicedge_upstream_ttft_seconds_count{{backend="{name}"}} 2.0' in text
    assert 'quicedge_edge_added_seconds_count{transport="h2"} 2.0' in text
    assert f'quicedge_inter_token_seconds_count{{backend="{name}"}}' in text
    assert 'quicedge_requests_total{model="default",route="/generate",status="200"} 2.0' in text
    assert 'quicedge_routing_decisions_total{policy="round_robin"' in text
    assert 'quicedge_prefix_hit_ratio_count{kind="reported"} 2.0' in text
    assert 'quicedge_prefix_hit_ratio_count{kind="predicted"} 2.0' in text
    assert f'quicedge_upstream_requests_total{{backend="{name}",reused="true"}} 2.0' in text
    assert f'quicedge_backend_in_flight{{backend="{name}"}} 0.0' in text
    assert "quicedge_upstream_reuse_ratio 1.0" in text


def sample(text: str, name: str) -> float:
    """The value of the one sample called `name` (labels included) in an exposition."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[-1])


async def test_plain_listener_times_the_edge_from_its_socket_reads() -> None:
    """On our HTTP/1.1 listener the edge's added time starts at the read of the request and at
    the read of each token from the backend: a part of TTFT, and one relay delay per chunk."""
    async with sims(sim_config("b1")) as servers:
        async with run_edge(fast_config([s.url for s in servers])) as edge:
            listener = H1Listener(edge.wiring.app, host="127.0.0.1", port=0)
            await listener.start()
            try:
                async with httpx.AsyncClient(base_url=listener.url, timeout=20) as http:
                    for _ in range(3):
                        body = {**BODIES["/v1/chat/completions"], "stream": True}
                        response = await http.post("/v1/chat/completions", json=body)
                        assert response.status_code == 200 and "[DONE]" in response.text
            finally:
                await listener.stop()
            text = await metrics_text(edge)
    h1 = '{transport="h1"}'
    added = sample(text, f"quicedge_edge_added_seconds_sum{h1}")
    assert sample(text, f"quicedge_edge_added_seconds_count{h1}") == 3
    ttft = sum(
        float(ln.split()[-1])
        for ln in text.splitlines()
        if ln.startswith("quicedge_ttft_seconds_sum{") and 'transport="h1"' in ln
    )
    assert 0 < added < ttft
    chunks = sample(text, f"quicedge_relay_delay_seconds_count{h1}")
    assert 3 <= chunks <= 3 * 8  # one per content chunk; 8 tokens an answer
    # Each chunk's relay delay is a time on the edge, not a stamp from another clock: well under
    # a second each even on a loaded machine (their sum can pass the three TTFTs there).
    assert 0 < sample(text, f"quicedge_relay_delay_seconds_sum{h1}") / chunks < 1.0


async def test_models_are_merged_from_healthy_backends() -> None:
    configs = (
        sim_config("b1", served_model_name="model-a"),
        sim_config("b2", served_model_name="model-b"),
        sim_config("b3", served_model_name="model-a"),
    )
    async with sims(*configs) as servers:
        async with run_edge(fast_config([s.url for s in servers])) as edge, client(edge) as http:
            listing = (await http.get("/v1/models")).json()
            assert listing["object"] == "list"
            assert sorted(card["id"] for card in listing["data"]) == ["model-a", "model-b"]
            card = (await http.get("/v1/models/model-b")).json()
            assert card["id"] == "model-b"
            ok = await http.post("/v1/completions", json={"model": "model-b", "prompt": "x"})
            assert ok.status_code == 200
            unknown = await http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            assert unknown.status_code == 404
            assert unknown.json()["error"]["code"] == "model_not_found"


@LISTENERS
async def test_client_disconnect_aborts_the_upstream_request(listener: str) -> None:
    slow = sim_config("b1", profile="h100-llama3-8b", time_scale=1.0)
    async with sims(slow) as (server,):
        config = fast_config([server.url])
        async with run_edge(config, listener=listener) as edge, client(edge) as http:
            body = {**BODIES["/generate"], "stream": True}
            body["sampling_params"] = {"max_new_tokens": 5000, "ignore_eos": True}
            async with http.stream("POST", "/generate", json=body) as response:
                assert response.status_code == 200
                async for _ in response.aiter_bytes():
                    break  # the first token arrived; now the client goes away
                assert server.scheduler.num_running == 1
            await wait_until(lambda: server.scheduler.num_running == 0)
            await wait_until(lambda: edge.wiring.registry.backends[0].in_flight == 0)
            assert server.scheduler.stats.num_aborted_requests_total >= 1
            assert edge.wiring.registry.backends[0].in_flight_prefill_tokens == 0
            text = await metrics_text(edge)
            assert "quicedge_client_disconnects_total 1.0" in text


async def test_a_client_chosen_rid_cannot_abort_another_clients_request() -> None:
    """Two clients send the same `x-request-id` and body `rid`; the second goes away. Only its
    own generation is aborted: the first streams to its end."""
    slow = sim_config("b1", profile="h100-llama3-8b", time_scale=1.0)
    async with sims(slow) as (server,):
        async with run_edge(fast_config([server.url])) as edge, client(edge) as http:
            body = {**BODIES["/generate"], "stream": True, "rid": "shared"}
            body["sampling_params"] = {"max_new_tokens": 200, "ignore_eos": True}
            same = {"x-request-id": "shared"}
            async with http.stream("POST", "/generate", json=body, headers=same) as first:
                assert first.status_code == 200
                assert first.headers["x-request-id"] == "shared"
                chunks = first.aiter_bytes()
                received = await anext(chunks)
                async with http.stream("POST", "/generate", json=body, headers=same) as second:
                    assert second.status_code == 200
                    async for _ in second.aiter_bytes():
                        break  # its first token arrived; now this client goes away
                await wait_until(lambda: server.scheduler.stats.num_aborted_requests_total >= 1)
                async for chunk in chunks:
                    received += chunk
    events = data_events(received)
    assert events[-1] == b"[DONE]" and b"error" not in received
    last = json.loads(events[-2])
    assert last["meta_info"]["completion_tokens"] == 200
    assert last["meta_info"]["id"] != "shared"
    assert server.scheduler.stats.num_aborted_requests_total == 1


@pytest.mark.parametrize(
    ("bound", "says"),
    [({"pool_max_waiters": 0}, "already wait"), ({"pool_acquire_timeout": 0.3}, "within 0.3s")],
    ids=["waiters", "timeout"],
)
async def test_a_busy_pool_is_503_with_retry_after(bound: dict[str, Any], says: str) -> None:
    """One upstream connection, held by a long stream: the next request finds no waiting room,
    or waits past the acquire timeout, and is told to come back; the backend is not blamed."""
    slow = sim_config("b1", profile="h100-llama3-8b", time_scale=1.0)
    async with sims(slow) as (server,):
        config = fast_config([server.url], pool_max_connections=1, pool_warm_connections=1, **bound)
        async with run_edge(config) as edge, client(edge) as http:
            body = {**BODIES["/generate"], "stream": True}
            body["sampling_params"] = {"max_new_tokens": 5000, "ignore_eos": True}
            async with http.stream("POST", "/generate", json=body) as held:
                assert held.status_code == 200
                chunks = held.aiter_bytes()
                await anext(chunks)  # streaming (not closed): it holds the only connection
                busy = await http.post("/generate", json=BODIES["/generate"])
            assert busy.status_code == 503, busy.text
            assert busy.headers["retry-after"] == "1"
            error = busy.json()["error"]
            assert error["code"] == "pool_busy" and says in error["message"]
            (backend,) = edge.wiring.registry.backends
            assert backend.healthy and "pool_busy" not in backend.failures
            assert 'kind="pool_busy"' in await metrics_text(edge)
            # the slot comes free with the stream's end (the health loop tops the warm set up
            # again, holding the slot while it connects), and serves again
            pool = edge.wiring.pool
            await wait_until(lambda: pool.stats().backends[server.url].idle == 1)
            again = await http.post("/generate", json=BODIES["/generate"])
            assert again.status_code == 200


async def test_health_ejection_and_return() -> None:
    async with sims(sim_config("b1"), sim_config("b2")) as (one, two):
        config = fast_config([one.url, two.url], policy="round_robin", expose_backend_names=True)
        async with run_edge(config) as edge, client(edge) as http:
            first, second = edge.wiring.registry.backends
            port = two.port
            await two.stop()
            await wait_until(lambda: not second.healthy)
            ready = await httpx.AsyncClient().get(edge.admin_url + "/ready")
            assert ready.json() == {"ready": True, "healthy_backends": 1, "backends": 2}
            for _ in range(4):
                response = await http.post("/v1/completions", json=BODIES["/v1/completions"])
                assert response.status_code == 200
                assert response.headers["x-quicedge-backend"] == first.name
            async with SimServer(sim_config("b2", port=port)):
                await wait_until(lambda: second.healthy)
                served = set()
                for _ in range(4):
                    response = await http.post("/v1/completions", json=BODIES["/v1/completions"])
                    served.add(response.headers["x-quicedge-backend"])
                assert served == {first.name, second.name}
            assert [b.in_flight for b in edge.wiring.registry.backends] == [0, 0]


async def test_admin_routes() -> None:
    async with sims(sim_config("b1"), sim_config("b2")) as servers:
        async with run_edge(fast_config([s.url for s in servers])) as edge, client(edge) as http:
            for _ in range(4):
                await http.post("/v1/completions", json=BODIES["/v1/completions"])
            async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
                health = await admin.get("/health")
                assert health.status_code == 200 and health.json() == {"status": "ok"}
                ready = await admin.get("/ready")
                assert ready.status_code == 200 and ready.json()["healthy_backends"] == 2
                state = (await admin.get("/backends")).json()
                assert state["policy"] == "round_robin"
                assert [b["name"] for b in state["backends"]] == [
                    b.name for b in edge.wiring.registry.backends
                ]
                assert all(b["in_flight"] == 0 for b in state["backends"])
                assert state["pool"]["requests"] >= 4
                assert state["pool"]["reuse_ratio"] > 0
                metrics = await admin.get("/metrics")
                assert metrics.headers["content-type"].startswith("text/plain")
                assert "quicedge_requests_total" in metrics.text
                assert (await admin.get("/nope")).status_code == 404
                assert (await admin.post("/health")).status_code == 405
