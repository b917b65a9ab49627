"""`quicedge bench` through the real edge (its wiring and listeners) in front of the stand-in."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from backends.sim import SimConfig, SimServer
from certs import DevCertificates
from edge.wiring import build
from tests.bench.conftest import run_command
from tests.bench.servers import edge_h3, edge_tcp
from tests.edge.conftest import fast_config


@pytest.fixture
async def edge_urls(dev_certs: DevCertificates) -> AsyncIterator[tuple[str, str, str]]:
    """(H3 URL, TLS TCP URL, backend name) of an edge in front of one stand-in."""
    config = SimConfig(name="b1", port=0, profile="instant", enable_cache_report=True, seed=0)
    async with SimServer(config) as sim:
        proxy = fast_config([sim.url], expose_backend_names=True)  # the records name it
        wiring = await build(proxy, registry=CollectorRegistry())
        await wiring.start()
        try:
            async with edge_h3(dev_certs, wiring.app) as h3, edge_tcp(dev_certs, wiring.app) as tcp:
                route = "/v1/chat/completions"
                yield (
                    f"https://localhost:{h3.port}{route}",
                    f"https://localhost:{tcp.port}{route}",
                    f"127.0.0.1:{sim.port}",
                )
        finally:
            await wiring.aclose()


async def test_bench_through_the_edge_over_every_transport(
    edge_urls: tuple[str, str, str], dev_certs: DevCertificates, tmp_path: Path
) -> None:
    h3, tcp, backend = edge_urls
    out = tmp_path / "runs.jsonl"
    done = await run_command(
        "bench.cli", "--url", h3, "--cacert", str(dev_certs.ca_cert), "--workload", "gsp",
        "--num", "4", "--gsp-groups", "1", "--gsp-prompts-per-group", "4",
        "--gsp-system-len", "48", "--gsp-question-len", "4", "--output-len", "4",
        "--output", str(out), "--compare", "h3+0rtt", "h3", f"h2@{tcp}", f"h1@{tcp}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 16
    for rec in records:
        assert rec["status"] == 200 and rec["error"] is None, rec
        assert rec["backend"] == backend  # the edge names the backend it chose
        assert rec["completion_tokens"] == 4 and rec["prompt_tokens"] > 48
        assert rec["early_data"] is (rec["config"] == "h3+0rtt")
    # One group per configuration (each has its own salt): after its first request, the shared
    # system prompt is served from the stand-in's prefix cache.
    for config in ("h3+0rtt", "h3", "h2", "h1"):
        cached = [r["cached_tokens"] for r in records if r["config"] == config]
        assert max(cached[1:]) >= 48, (config, cached)
