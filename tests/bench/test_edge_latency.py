"""`python -m bench.edge_latency` against a stand-in, as a user runs it."""

from __future__ import annotations

import os

from backends.sim import SimConfig, SimServer
from tests.bench.conftest import run_command


async def test_reports_each_target_and_the_added_latency() -> None:
    async with SimServer(SimConfig(name="el", port=0, profile="instant")) as sim:
        done = await run_command(
            "bench.edge_latency", f"a={sim.url}", f"b={sim.url}",
            "--rounds", "2", "--per-round", "3", "--warmup", "1", "--max-tokens", "4",
            "--cpu-pid", f"self={os.getpid()}",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].strip().startswith("a: first byte p50")
    assert "CPU/request self" in lines[0]
    assert lines[1].strip().startswith("b: first byte p50")
    assert "added over a: TTFT p50" in lines[2]


async def test_bad_target_is_refused() -> None:
    done = await run_command("bench.edge_latency", "https://example.com")
    assert done.returncode == 2 and "expected NAME=http://host:port" in done.stderr


async def test_pool_cpu_reports_cpu_and_reads_per_body() -> None:
    async with SimServer(SimConfig(name="pc", port=0, profile="instant")) as sim:
        done = await run_command(
            "bench.pool_cpu", sim.url, "--max-tokens", "4", "--requests", "2", "--repeats", "2",
            "--chunk-timeout", "30", "--loop", "asyncio",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pool CPU per request: min ")
    assert "reads per body" in done.stdout
