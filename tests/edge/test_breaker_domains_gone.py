"""A breaker's domain that no backend is in any more (a reload or discovery took its backends
out): its `quicedge_breaker_state` series goes with it, whatever state it was left in, instead
of showing a stale "open" for good. The real edge, a real config reload, stand-in backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.sim import SimConfig, SimServer
from edge.reload import Reloader
from edge.routing.breakers import BreakerConfig
from edge.serve import build_parser, load_settings
from tests.edge.conftest import (
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

MODEL = "tiny-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BREAKERS = BreakerConfig(window=4, min_requests=4, open_for=60.0, open_max=60.0, kv_interval=0.05)
"""Opens on four failures and stays open for the whole test."""


def failing(recorded: Recorded) -> Reply:
    return health_ok(recorded) or Reply(status=500, chunks=[b'{"error": "boom"}'], chunked=False)


def sim(name: str) -> SimServer:
    return SimServer(SimConfig(name=name, port=0, profile="instant", served_model_name=MODEL))


def state(edge: Edge, hardware: str) -> float | None:
    labels = {"model": MODEL, "tier": "bronze", "hardware": hardware}
    return edge.registry.get_sample_value("quicedge_breaker_state", labels)


def write(path: Path, *backends: str) -> None:
    listed = ", ".join(f'"{b}"' for b in backends)
    path.write_text(f"[proxy]\nbackends = [{listed}]\n[discovery]\ndrain_timeout = 0.2\n")


def loader(path: Path) -> Any:
    return lambda: load_settings(build_parser().parse_args(["--config", str(path)]), {})


async def open_domain_a(edge: Edge) -> None:
    async with client(edge) as http:
        for _ in range(8):  # round robin: four to group a (500s, then open), four to b
            await http.post("/v1/chat/completions", json=CHAT)
    assert state(edge, "a") == 2 and state(edge, "b") == 0


async def test_an_open_domain_a_reload_empties_loses_its_gauge_series(tmp_path: Path) -> None:
    path = tmp_path / "quicedge.toml"
    async with TinyUpstream(failing) as bad, sim("good") as good:
        a, b = f"{bad.url}#hardware=a", f"{good.url}#hardware=b"
        write(path, a, b)
        config = fast_config([a, b], eject_after_failures=1000, max_retries=0)
        async with run_edge(config, breakers=BREAKERS) as edge:
            reloader = Reloader(loader(path), loader(path)(), edge.wiring)
            await open_domain_a(edge)
            write(path, b)
            report = await reloader.reload_reported()
            assert report["changed"] == ["proxy.backends"]
            await wait_until(lambda: len(edge.wiring.registry.backends) == 1)
            await wait_until(lambda: state(edge, "a") is None, timeout=5.0)
            assert state(edge, "b") == 0
            assert edge.wiring.breakers is not None
            assert {d["hardware"] for d in edge.wiring.breakers.snapshot()} == {"b"}
            async with client(edge) as http:  # the other domain serves on
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            await reloader.aclose()
