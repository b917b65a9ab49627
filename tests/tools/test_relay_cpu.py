"""`python -m tools.relay_cpu` as a user runs it."""

from __future__ import annotations

from tests.bench.conftest import run_command


async def test_relay_cpu_reports_the_cost_per_chunk() -> None:
    done = await run_command("tools.relay_cpu", "--chunks", "4", "--streams", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("relay per chunk: ") and "as ASGI messages" in done.stdout
    assert "(3 streams of 5 chunks)" in done.stdout
