"""`python -m tools.pool_cpu` against a stand-in, as a developer runs it."""

from __future__ import annotations

from backends.sim import SimConfig, SimServer
from tests.bench.conftest import run_command
from tests.edge.conftest import Recorded, Reply, TinyUpstream


async def test_pool_cpu_reports_cpu_and_reads_per_body() -> None:
    async with SimServer(SimConfig(name="pc", port=0, profile="instant")) as sim:
        done = await run_command(
            "tools.pool_cpu", sim.url, "--max-tokens", "4", "--requests", "2", "--repeats", "2",
            "--chunk-timeout", "30", "--loop", "asyncio",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pool CPU per request: min ")
    assert "reads per body" in done.stdout


async def test_pool_cpu_fails_when_the_backend_does_not_answer_200() -> None:
    """An error answer is cheap: timed as a request, it would pass for the pool's cost."""

    def refuse(_recorded: Recorded) -> Reply:
        return Reply(status=503, chunks=[b'{"error": "busy"}'], chunked=False)

    async with TinyUpstream(refuse) as upstream:
        done = await run_command(
            "tools.pool_cpu", upstream.url, "--requests", "2", "--repeats", "1",
            "--loop", "asyncio",
        )  # fmt: skip
    assert done.returncode == 1, done.stdout
    assert "pool CPU per request" not in done.stdout
    assert "2 of 2 requests answered 503" in done.stderr
