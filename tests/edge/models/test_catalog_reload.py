"""The model catalog across a reload of `[proxy] backends`: real stand-ins serving one model
name, a real edge, the config file rewritten and reloaded (`edge.reload.Reloader`). The new
backends serve the model as soon as they are healthy, without anyone fetching `/v1/models`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from backends.pool import UpstreamPool
from backends.registry import BackendRegistry
from backends.sim import SimServer
from edge.models.catalog import ModelCatalog
from edge.reload import Reloader
from edge.serve import build_parser, load_settings
from tests.edge.conftest import (
    Edge,
    Recorded,
    Reply,
    TinyUpstream,
    client,
    fast_config,
    held_sse,
    run_edge,
)
from tests.edge.models.test_pools_e2e import chat, sim, sims
from tests.helpers import restartable_port, wait_until

MODEL = "tiny-model"


def write_backends(path: Path, backends: list[str]) -> None:
    path.write_text(f"[proxy]\nbackends = {json.dumps(backends)}\n")


def reloader(edge: Edge, path: Path, backends: list[str]) -> Reloader:
    """A reloader of `quicedge serve --config PATH` (no `--backend` flag: the file's list is
    live), the file holding `backends` as the edge started with them."""
    write_backends(path, backends)

    def load() -> Any:
        return load_settings(build_parser().parse_args(["--config", str(path)]), {})

    return Reloader(load, load(), edge.wiring)


async def reload_to(reloader: Reloader, path: Path, backends: list[str]) -> None:
    write_backends(path, backends)
    report = await reloader.reload_reported()
    assert (report["outcome"], report["changed"]) == ("applied", ["proxy.backends"]), report


async def gone(edge: Edge, url: str) -> None:
    """Wait until the backend at `url` has drained and left the registry."""
    await wait_until(lambda: all(b.url != url for b in edge.wiring.registry.backends))


async def served_by(http: httpx.AsyncClient, url: str) -> None:
    response = await http.post("/v1/chat/completions", json=chat(MODEL))
    assert response.status_code == 200, response.text
    assert response.headers["x-quicedge-backend"] == urlsplit(url).netloc


async def test_a_reload_that_replaces_the_backends_serves_their_model_at_once(
    tmp_path: Path,
) -> None:
    """The audit's reload: A → B, both serving `tiny-model`. The catalog's list still held A's
    model, so once A left every request got 404 `model_not_found` (`Served: ` nothing) until
    someone asked the edge for `/v1/models`."""
    async with sims(sim(MODEL), sim(MODEL)) as (a, b):
        async with run_edge(fast_config([a.url])) as edge, client(edge) as http:
            config = tmp_path / "quicedge.toml"
            reload = reloader(edge, config, [a.url])
            await served_by(http, a.url)
            await reload_to(reload, config, [b.url])
            await gone(edge, a.url)
            for _ in range(3):
                await served_by(http, b.url)
            assert [x.model for x in edge.wiring.registry.backends] == [MODEL]
            await reload.aclose()


async def test_a_backend_down_at_the_reload_serves_once_it_is_healthy(tmp_path: Path) -> None:
    """B is not up when the reload adds it: nothing is learned then. Once its checks pass it
    serves, long before the catalog's list would have gone stale (`models_ttl` 60 s)."""
    port = restartable_port()
    later = f"http://127.0.0.1:{port}"
    async with sims(sim(MODEL)) as (a,):
        config_a = fast_config([a.url], models_ttl=60.0)
        async with run_edge(config_a) as edge, client(edge) as http:
            config = tmp_path / "quicedge.toml"
            reload = reloader(edge, config, [a.url])
            await served_by(http, a.url)
            await reload_to(reload, config, [later])
            await gone(edge, a.url)
            (b_entry,) = edge.wiring.registry.backends
            await wait_until(lambda: not b_entry.healthy)  # its checks failed: marked down
            async with SimServer(dataclasses.replace(sim(MODEL), port=port)):
                await wait_until(lambda: b_entry.healthy)
                await served_by(http, later)
            await reload.aclose()


async def test_a_fetch_under_way_when_the_backends_change_runs_again() -> None:
    """A reload's `expire` while a fetch of the list is under way: that fetch chose its backends
    before the new one joined, and those who wait on it must not come away without it."""
    asked, gate = asyncio.Event(), asyncio.Event()

    async def slow(recorded: Recorded) -> Reply:
        if recorded.path != "/v1/models":
            return Reply(status=404, chunked=False)
        asked.set()
        await gate.wait()
        return Reply(chunks=[json.dumps({"data": [{"id": "old-model"}]}).encode()], chunked=False)

    async with TinyUpstream(slow) as old, sims(sim(MODEL)) as (new,):
        pool = UpstreamPool(connect_timeout=5.0)
        registry = BackendRegistry([old.url], pool=pool)
        catalog = ModelCatalog(backends=registry.backends, pool=pool, ttl=60.0, timeout=5.0)
        try:
            fetch = asyncio.ensure_future(catalog.refresh())
            await asyncio.wait_for(asked.wait(), 10)
            added = registry.add(new.url)
            catalog.expire()
            gate.set()
            await asyncio.wait_for(fetch, 10)
            assert added.model == MODEL
            assert catalog.known == {MODEL, "old-model"}
            assert not catalog.stale
        finally:
            await registry.aclose()
            await pool.aclose()


async def test_a_pool_whose_backends_are_leaving_is_not_a_second_pool(tmp_path: Path) -> None:
    """A reload drops the only backend of `tiny-model` while it still streams an answer: a
    request naming no model goes to the pool that stays (`alpha`). It got 400 `model_required`
    for as long as the drain lasted, the leaving pool counted as a second one."""
    release = asyncio.Event()
    async with sims(sim("alpha")) as (a,), TinyUpstream(held_sse(release)) as leaving:
        async with run_edge(fast_config([a.url, leaving.url])) as edge, client(edge) as http:
            config = tmp_path / "quicedge.toml"
            reload = reloader(edge, config, [a.url, leaving.url])
            await http.get("/v1/models")  # both pools learned
            nameless = await http.post("/v1/chat/completions", json=chat(None))
            assert nameless.status_code == 400, nameless.text  # two pools, no default
            held = asyncio.ensure_future(http.post("/v1/chat/completions", json=chat(MODEL)))
            await wait_until(lambda: any(b.in_flight for b in edge.wiring.registry.backends))
            await reload_to(reload, config, [a.url])
            assert [b.url for b in edge.wiring.registry.backends if b.draining] == [leaving.url]
            nameless = await http.post("/v1/chat/completions", json=chat(None))
            assert nameless.status_code == 200, nameless.text
            assert nameless.headers["x-quicedge-backend"] == urlsplit(a.url).netloc
            release.set()
            assert (await held).status_code == 200
            await gone(edge, leaving.url)
            await reload.aclose()


def _switchable(served: dict[str, str]) -> Any:
    """A backend serving `served["model"]` at `served["version"]`, which the test changes (a
    restart with other weights, or SGLang's `update_weights_from_disk`)."""

    def answer(recorded: Recorded) -> Reply:
        if recorded.path == "/v1/models":
            data = {"object": "list", "data": [{"id": served["model"], "object": "model"}]}
            return Reply(chunks=[json.dumps(data).encode()], chunked=False)
        if recorded.path == "/get_model_info":
            info = {"model_path": served["model"], "weight_version": served["version"]}
            return Reply(chunks=[json.dumps(info).encode()], chunked=False)
        if recorded.path in ("/health", "/v1/loads", "/get_load"):
            return Reply(status=200 if recorded.path == "/health" else 404, chunked=False)
        message = {"role": "assistant", "content": served["model"]}
        body = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        return Reply(chunks=[json.dumps(body).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip

    return answer


async def test_a_backend_that_now_serves_another_model_or_version_is_learned_again() -> None:
    """Discovery learned `alpha` at `v1`. The backend comes back with `beta` at `v2`: once the
    list is looked at again (older than `models_ttl`), the edge routes `beta` to it and no
    longer `alpha`, and its version is `v2`."""
    served = {"model": "alpha", "version": "v1"}
    async with TinyUpstream(_switchable(served)) as up:
        async with (
            run_edge(fast_config([up.url], models_ttl=0.2)) as edge,
            client(edge) as http,
        ):
            (backend,) = edge.wiring.registry.backends
            assert (backend.model, backend.model_version) == ("alpha", "v1")
            assert (await http.post("/v1/chat/completions", json=chat("alpha"))).status_code == 200
            served.update(model="beta", version="v2")
            await wait_until(lambda: edge.wiring.catalog.stale)  # older than `models_ttl`
            r = await http.post("/v1/chat/completions", json=chat("beta"))
            assert r.status_code == 200, r.text
            assert (backend.model, backend.model_version) == ("beta", "v2")
            assert backend.labels["model"] == "beta@v2"  # its breakers' domain follows
            r = await http.post("/v1/chat/completions", json=chat("alpha"))
            assert r.status_code == 404
