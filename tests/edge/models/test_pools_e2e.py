"""Model pools end to end: httpx → hypercorn → the app → real stand-ins with different model
names and versions. Pool selection, aliases, `/v1/models`, unknown models, a pool with no
healthy backend, per-pool metrics and spans."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from backends.sim import SimConfig, SimServer
from edge.models import ModelsConfig
from edge.models.config import Alias, BackendModel, RolloutConfig
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


def sim(model: str, **overrides: Any) -> SimConfig:
    values: dict[str, Any] = {"port": 0, "profile": "instant", "served_model_name": model}
    values.update(overrides)
    return SimConfig(**values)


@contextlib.asynccontextmanager
async def sims(*configs: SimConfig) -> AsyncIterator[list[SimServer]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(SimServer(c)) for c in configs]


def chat(model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi there"}],
                            "max_tokens": 4}  # fmt: skip
    if model is not None:
        body["model"] = model
    return body


def netloc(server: SimServer | Any) -> str:
    return urlsplit(server.url).netloc


async def test_the_model_selects_the_pool_aliases_work_and_the_listing_shows_both() -> None:
    async with sims(sim("alpha"), sim("alpha"), sim("beta")) as (a1, a2, b1):
        models = ModelsConfig(default="beta", aliases=[Alias("gpt-small", "alpha")])
        config = fast_config([a1.url, a2.url, b1.url])
        async with run_edge(config, models=models, trace=True) as edge, client(edge) as http:
            seen: dict[str, Counter[str]] = {}
            for model in ("alpha", "beta", "gpt-small"):
                for _ in range(6):
                    r = await http.post("/v1/chat/completions", json=chat(model))
                    assert r.status_code == 200, r.text
                    seen.setdefault(model, Counter())[r.headers["x-quicedge-backend"]] += 1
            assert set(seen["alpha"]) == {netloc(a1), netloc(a2)}  # round robin inside the pool
            assert set(seen["beta"]) == {netloc(b1)}
            assert set(seen["gpt-small"]) <= {netloc(a1), netloc(a2)}
            # /generate has no model field: the default pool
            r = await http.post(
                "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
            )
            assert r.status_code == 200 and r.headers["x-quicedge-backend"] == netloc(b1)
            listing = (await http.get("/v1/models")).json()
            ids = {card["id"]: card for card in listing["data"]}
            assert {"alpha", "beta", "gpt-small"} <= set(ids)
            assert ids["gpt-small"]["root"] == "alpha"
            card = await http.get("/v1/models/gpt-small")
            assert card.status_code == 200 and card.json()["root"] == "alpha"
            async with httpx.AsyncClient() as admin:
                metrics = (await admin.get(edge.admin_url + "/metrics")).text
                rollouts = (await admin.get(edge.admin_url + "/rollouts")).json()
            assert 'quicedge_model_requests_total{model="beta",outcome="ok",version="default"}' in (
                metrics
            )
            assert sorted(rollouts["pools"]) == ["alpha", "beta"]
            assert edge.spans is not None
            routes = [s for s in edge.spans.get_finished_spans() if s.name == "route"]
            assert {s.attributes["quicedge.model"] for s in routes if s.attributes} == {
                "alpha", "beta",
            }  # fmt: skip


async def test_an_unknown_model_is_a_404_in_openai_shape_and_reaches_no_backend() -> None:
    async with sims(sim("alpha")) as (a1,):
        async with run_edge(fast_config([a1.url])) as edge, client(edge) as http:
            r = await http.post("/v1/chat/completions", json=chat("nope"))
            assert r.status_code == 404
            error = r.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert "alpha" in error["message"] and error["type"] == "invalid_request_error"
            assert r.headers.get("x-request-id")
            async with httpx.AsyncClient() as admin:
                metrics = (await admin.get(edge.admin_url + "/metrics")).text
            assert "quicedge_model_requests_total{" not in metrics  # no attempt was made


async def test_a_pool_with_no_healthy_backend_is_a_clear_503_and_others_still_serve() -> None:
    async with sims(sim("alpha")) as (a1,):
        beta = SimServer(sim("beta"))
        await beta.__aenter__()
        try:
            config = fast_config([a1.url, beta.url])
            async with run_edge(config) as edge, client(edge) as http:
                r = await http.post("/v1/chat/completions", json=chat("beta"))
                assert r.status_code == 200
                await beta.__aexit__(None, None, None)
                b = edge.wiring.registry.get(netloc(beta))
                assert b is not None
                await wait_until(lambda: not b.healthy, timeout=20)
                r = await http.post("/v1/chat/completions", json=chat("beta"))
                assert r.status_code == 503, r.text
                error = r.json()["error"]
                assert error["code"] == "no_healthy_backend"
                assert "model pool beta" in error["message"]
                ok = await http.post("/v1/chat/completions", json=chat("alpha"))
                assert ok.status_code == 200
        finally:
            with contextlib.suppress(Exception):
                await beta.__aexit__(None, None, None)


async def test_versions_are_discovered_and_config_pins_model_version_and_group() -> None:
    async with sims(sim("alpha", model_version="v1"), sim("alpha", model_version="v2")) as (
        one,
        two,
    ):
        models = ModelsConfig(
            backends=[BackendModel(two.url, model="alpha", version="v9", hardware_group="a100")]
        )
        async with run_edge(fast_config([one.url, two.url]), models=models) as edge:
            b1 = edge.wiring.registry.get(netloc(one))
            b2 = edge.wiring.registry.get(netloc(two))
            assert b1 is not None and b2 is not None
            assert (b1.model, b1.model_version, b1.hw_group) == ("alpha", "v1", "default")
            assert (b2.model, b2.model_version, b2.hw_group) == ("alpha", "v9", "a100")


async def test_an_alias_is_forwarded_as_its_pools_name() -> None:
    """SGLang echoes the request's `model` (the stand-in does too), and reads `base:adapter` as
    a LoRA adapter: the backend gets the pool's name, never the alias."""
    async with sims(sim("alpha"), sim("beta")) as (a1, b1):
        models = ModelsConfig(default="beta", aliases=[Alias("team:small", "alpha")])
        async with (
            run_edge(fast_config([a1.url, b1.url]), models=models) as edge,
            client(edge) as http,
        ):
            r = await http.post("/v1/chat/completions", json={**chat("team:small"), "rid": "x1"})
            assert r.status_code == 200 and r.json()["model"] == "alpha"
            assert r.headers["x-request-id"] == "x1"  # the client's rid stays its label
            streamed = await http.post(
                "/v1/completions",
                json={"model": "team:small", "prompt": "hi", "max_tokens": 3, "stream": True},
            )
            assert streamed.status_code == 200
            chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                      if line.startswith("data: {")]  # fmt: skip
            assert chunks and {c["model"] for c in chunks} == {"alpha"}
            r = await http.post("/v1/chat/completions", json=chat("alpha"))  # not an alias
            assert r.json()["model"] == "alpha"
            r = await http.post("/v1/chat/completions", json=chat("default"))  # SGLang's own
            assert r.json()["model"] == "default" and r.headers["x-quicedge-backend"] == netloc(b1)


async def test_no_model_and_several_pools_without_a_default_is_a_400_listing_them() -> None:
    async with sims(sim("alpha"), sim("beta")) as (a1, b1):
        models = ModelsConfig(aliases=[Alias("small", "alpha")])
        async with (
            run_edge(fast_config([a1.url, b1.url]), models=models) as edge,
            client(edge) as http,
        ):
            for body in (chat(None), chat("default")):
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["code"] == "model_required" and error["param"] == "model"
                assert error["type"] == "invalid_request_error"
                assert "alpha, beta, small" in error["message"]
            r = await http.post(
                "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
            )
            assert r.status_code == 400 and r.json()["error"]["code"] == "model_required"
            assert (await http.post("/v1/chat/completions", json=chat("beta"))).status_code == 200
            assert a1.scheduler is not None and a1.scheduler.stats.num_requests_total == 0
            async with httpx.AsyncClient() as admin:
                assert (await admin.get(edge.admin_url + "/rollouts")).json()["default"] is None


async def test_with_one_pool_a_request_without_a_model_goes_to_it() -> None:
    async with sims(sim("alpha"), sim("alpha")) as (a1, a2):
        async with run_edge(fast_config([a1.url, a2.url])) as edge, client(edge) as http:
            for body in (chat(None), chat("default")):
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200
            r = await http.post(
                "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
            )
            assert r.status_code == 200
            async with httpx.AsyncClient() as admin:
                assert (await admin.get(edge.admin_url + "/rollouts")).json()["default"] == "alpha"


async def test_a_default_that_names_no_served_pool_says_so() -> None:
    """`[models] default` naming a pool no backend serves (a typo, or a reload ahead of the
    fleet): requests that name no model get a 503 that says so, not "no healthy backend"."""
    async with sims(sim("alpha")) as (a1,):
        models = ModelsConfig(default="alpah")
        async with run_edge(fast_config([a1.url]), models=models) as edge, client(edge) as http:
            r = await http.post("/v1/chat/completions", json=chat(None))
            assert r.status_code == 503, r.text
            assert r.json()["error"]["message"] == "no backend serves model pool alpah"
            assert (await http.post("/v1/chat/completions", json=chat("alpha"))).status_code == 200


def test_an_empty_default_is_refused_when_the_config_loads() -> None:
    with pytest.raises(ValueError, match="models.default: must name a model pool"):
        ModelsConfig.from_mapping({"default": " "}).validate()


async def test_every_model_the_listing_names_is_served() -> None:
    """`[[models.backends]]` names the pool `llama` for a backend whose served name is the
    checkpoint's: the listing names the pools and aliases a request may ask for, each of which
    is answered, and not the backend's own name, which would be a 404."""
    async with sims(sim("meta-llama/Llama-3-8B"), sim("beta")) as (a, b):
        models = ModelsConfig(
            backends=[BackendModel(a.url, model="llama", version="v1")],
            aliases=[Alias("small", "llama")],
        )
        config = fast_config([a.url, b.url])
        async with run_edge(config, models=models) as edge, client(edge) as http:
            listing = (await http.get("/v1/models")).json()
            ids = [card["id"] for card in listing["data"]]
            assert sorted(ids) == ["beta", "llama", "small"]
            for model in ids:
                r = await http.post("/v1/chat/completions", json=chat(model))
                assert r.status_code == 200, (model, r.text)
                assert (await http.get(f"/v1/models/{model}")).status_code == 200


async def test_without_discovery_a_request_naming_the_served_model_is_served() -> None:
    """`discover = false` and no `[[models.backends]]`: the edge learns no backend's model, so
    it has no pools; the backends decide, as before the edge knew any model, and what they list
    is what a client may name."""
    async with sims(sim("alpha")) as (a,):
        models = ModelsConfig(discover=False)
        async with run_edge(fast_config([a.url]), models=models) as edge, client(edge) as http:
            listing = (await http.get("/v1/models")).json()
            assert [card["id"] for card in listing["data"]] == ["alpha"]
            for model in ("alpha", None, "default"):
                r = await http.post("/v1/chat/completions", json=chat(model))
                assert r.status_code == 200, (model, r.text)


def full(recorded: Recorded) -> Reply:
    """A scripted backend whose KV cache is full (`token_usage` 0.99: degraded) and answers."""
    if recorded.path in ("/v1/loads", "/get_load"):
        load = {"num_running_reqs": 8, "num_waiting_reqs": 0, "num_used_tokens": 99000,
                "token_usage": 0.99, "max_total_num_tokens": 100000}  # fmt: skip
        return Reply(chunks=[json.dumps({"loads": [load]}).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip
    known = health_ok(recorded)
    if known is not None:
        return known
    message = {"role": "assistant", "content": "ok"}
    answer = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
              "usage": {"completion_tokens": 1}}  # fmt: skip
    return Reply(chunks=[json.dumps(answer).encode()], chunked=False,
                 headers=[("content-type", "application/json")])  # fmt: skip


async def test_a_pool_whose_backends_are_all_degraded_is_served_by_them() -> None:
    """Alpha's one backend is degraded (its KV cache is full); beta's is not. A degraded
    backend takes work when nothing else can, and for alpha's requests nothing else can: beta's
    backend does not serve alpha, so it must not make alpha's a 503."""
    async with TinyUpstream(full) as alpha, sims(sim("beta")) as (beta,):
        models = ModelsConfig(backends=[BackendModel(alpha.url, model="alpha", version="v1")])
        config = fast_config([alpha.url, beta.url])
        async with run_edge(config, models=models) as edge, client(edge) as http:
            backend = edge.wiring.registry.get(netloc(alpha))
            assert backend is not None
            await wait_until(lambda: backend.degraded and backend.healthy)
            for model in ("alpha", "beta", "alpha"):
                r = await http.post("/v1/chat/completions", json=chat(model))
                assert r.status_code == 200, (model, r.text)
            assert r.headers["x-quicedge-backend"] == netloc(alpha)


async def test_a_degraded_stable_version_serves_while_its_canary_is_idle() -> None:
    """Stable takes nearly all of a rollout's traffic and its KV cache is full (degraded); the
    canary, at a share of almost nothing, is idle. The canary cannot take stable's requests,
    so it must not turn them into 503s."""
    async with TinyUpstream(full) as stable, sims(sim("m", model_version="v2")) as (canary,):
        models = ModelsConfig(
            backends=[BackendModel(stable.url, model="m", version="v1")],
            rollouts=[RolloutConfig(model="m", stable="v1", canary="v2", steps=[1e-6])],
        )
        config = fast_config([stable.url, canary.url])
        async with run_edge(config, models=models) as edge, client(edge) as http:
            backend = edge.wiring.registry.get(netloc(stable))
            assert backend is not None
            await wait_until(lambda: backend.degraded and backend.healthy)
            for _ in range(3):
                r = await http.post("/v1/chat/completions", json=chat("m"),
                                    headers={"x-canary": "0"})  # fmt: skip
                assert r.status_code == 200, r.text
                assert r.headers["x-quicedge-backend"] == netloc(stable)
