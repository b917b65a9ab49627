"""`python -m tools.pool_cpu` against a stand-in, as a developer runs it."""

from __future__ import annotations

from backends.sim import SimConfig, SimServer
from tests.bench.conftest import run_command


async def test_pool_cpu_reports_cpu_and_reads_per_body() -> None:
    async with SimServer(SimConfig(name="pc", port=0, profile="instant")) as sim:
        done = await run_command(
            "tools.pool_cpu", sim.url, "--max-tokens", "4", "--requests", "2", "--repeats", "2",
            "--chunk-timeout", "30", "--loop", "asyncio",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pool CPU per request: min ")
    assert "reads per body" in done.stdout
