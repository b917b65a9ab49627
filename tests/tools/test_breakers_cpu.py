"""`python -m tools.breakers_cpu` runs and prints its report (speed is the report's, not this
test's)."""

from __future__ import annotations

from tests.bench.conftest import run_command


async def test_breakers_cpu_reports_each_call() -> None:
    done = await run_command("tools.breakers_cpu", "--number", "100")
    assert done.returncode == 0, done.stderr
    for name in ("every breaker closed", "started", "ended", "one domain open"):
        assert name in done.stdout, done.stdout


async def test_breakers_cpu_refuses_bad_arguments() -> None:
    done = await run_command("tools.breakers_cpu", "--candidates", "1")
    assert done.returncode == 2 and "--candidates must be >= 2" in done.stderr
