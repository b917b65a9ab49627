"""`quicedge bench` with stored conversations and the response cache, over HTTP/3 with 0-RTT
through the real edge in front of the stand-in."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from backends.sim import SimConfig, SimServer
from bench.runner import BenchConfig
from certs import DevCertificates
from edge.wiring import build
from tests.bench.conftest import run_command
from tests.bench.servers import edge_h3
from tests.edge.conftest import fast_config
from tests.edge.state.helpers import state


@pytest.fixture
async def edge_url(dev_certs: DevCertificates) -> AsyncIterator[str]:
    config = SimConfig(name="b1", port=0, profile="instant", enable_cache_report=True, seed=0)
    async with SimServer(config) as sim:
        settings = state(cache={"allow_tenants": ["*"]})
        wiring = await build(fast_config([sim.url], state=settings), registry=CollectorRegistry())
        await wiring.start()
        try:
            async with edge_h3(dev_certs, wiring.app) as h3:
                yield f"https://localhost:{h3.port}/v1/chat/completions"
        finally:
            await wiring.aclose()


def test_the_stored_and_cache_flags_parse() -> None:
    config = BenchConfig.parse("s=h3+0rtt+stored+cache")
    assert (config.stored, config.cache, config.zero_rtt) == (True, True, True)


async def test_stored_sessions_send_only_the_new_turn(
    edge_url: str, dev_certs: DevCertificates, tmp_path: Path
) -> None:
    out, summary = tmp_path / "runs.jsonl", tmp_path / "summary.json"
    done = await run_command(
        "bench.cli", "--url", edge_url, "--cacert", str(dev_certs.ca_cert), "--workload", "chat",
        "--num", "8", "--chat-turns", "4", "--chat-turn-len", "200", "--output-len", "4",
        "--output", str(out), "--summary-json", str(summary), "--turns", "1", "4",
        "--compare", "full=h3+0rtt", "stored=h3+0rtt+stored",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 16 and all(r["status"] == 200 for r in records)
    by = {(r["config"], r["session"], r["turn"]): r for r in records}
    for (config, session, turn), rec in by.items():
        if config == "stored" and turn > 0:
            full = by[("full", session, turn)]
            # the same prompt reached the backend, a fraction of it crossed the client's link
            assert rec["prompt_tokens"] == full["prompt_tokens"]
            assert rec["request_bytes"] < full["request_bytes"]
            assert rec["early_data"]
    last = {c: by[(c, records[0]["session"], 3)]["request_bytes"] for c in ("full", "stored")}
    assert last["full"] > 2.5 * last["stored"]
    rows = json.loads(summary.read_text())["turns"]
    assert {(r["config"], r["turn"]) for r in rows} == {
        (c, t) for c in ("full", "stored") for t in (1, 4)
    }
    assert "request bytes p50" in done.stdout


async def test_cached_requests_are_hits_after_the_first(
    edge_url: str, dev_certs: DevCertificates, tmp_path: Path
) -> None:
    out = tmp_path / "runs.jsonl"
    done = await run_command(
        "bench.cli", "--url", edge_url, "--cacert", str(dev_certs.ca_cert), "--workload", "gsp",
        "--num", "5", "--gsp-groups", "1", "--gsp-prompts-per-group", "1", "--output-len", "4",
        "--output", str(out), "--compare", "hit=h3+0rtt+cache",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["cache"] for r in records] == ["miss"] + ["hit-l1"] * 4
    assert all(r["completion_tokens"] == 4 for r in records)  # the usage chunk came back too
