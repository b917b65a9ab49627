"""The measurement tools run end to end on small inputs and print their reports.

They assert nothing about speed (that belongs in their reports); these tests keep them runnable
as `python -m tools.NAME` from the repository root, which is how a developer runs them.
"""

from __future__ import annotations

import re

from tests.bench.conftest import run_command


async def test_sim_throughput_streams_and_reports_tokens_per_second() -> None:
    done = await run_command(
        "tools.sim_throughput", "--clients", "2", "--duration", "2", "--max-tokens", "4",
        "--server-cpu", "-1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    completed = re.search(r"requests completed\s+(\d+)", done.stdout)
    assert completed is not None and int(completed.group(1)) >= 1, done.stdout
    assert "streamed tokens/s" in done.stdout


async def test_tracing_overhead_reports_both_modes_and_the_span_work() -> None:
    done = await run_command(
        "tools.tracing_overhead", "--requests", "5", "--rounds", "1", "--tokens", "2"
    )
    assert done.returncode == 0, done.stderr
    assert "span work alone" in done.stdout and "tracing off" in done.stdout


async def test_tracing_overhead_refuses_bad_arguments() -> None:
    done = await run_command("tools.tracing_overhead", "--requests", "0")
    assert done.returncode == 2 and "must be >= 1" in done.stderr


async def test_handshakes_reports_each_store_and_handshake_kind(redis_url: str) -> None:
    done = await run_command(
        "tools.handshakes", "--duration", "0.5", "--concurrency", "2", "--redis", redis_url,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for store in ("memory", "redis"):
        for kind in ("full", "0-RTT"):
            row = re.search(rf"^{store}\s+{re.escape(kind)}\s+(\d+)\s+(\d+)", done.stdout, re.M)
            assert row is not None, done.stdout
            assert int(row.group(1)) > 0  # connections per second
    assert "store cost per put + take" in done.stdout


async def test_pending_bodies_reports_memory_and_refusals_per_budget() -> None:
    """Four uploads of 500 kB that never end: a 1 MB budget holds two and refuses two."""
    done = await run_command(
        "tools.pending_bodies", "--uploads", "4", "--size", "500000",
        "--budget", "0", "--budget", "1000000",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = re.findall(r"^\s*(no cap|\d+ B)\s+\d+ MiB\s+\d+ MiB\s+(\d+)$", done.stdout, re.M)
    assert rows == [("no cap", "0"), ("1000000 B", "2")], done.stdout
