"""`quicedge bench` as a benchmarker drives it: mistakes caught before the run, not after."""

from __future__ import annotations

from pathlib import Path

from tests.bench.conftest import run_command
from tests.helpers import free_port


async def test_stored_on_a_route_without_chat_sessions_is_a_usage_error(tmp_path: Path) -> None:
    """`+stored` against /v1/completions raised from inside the run: a traceback, exit 1, and
    the (empty) output file left behind, instead of a usage error before anything was sent."""
    out = tmp_path / "runs.jsonl"
    url = f"http://127.0.0.1:{free_port()}/v1/completions"
    done = await run_command(
        "bench.cli", "--url", url, "--compare", "h1+stored", "--num", "1", "--warmup", "0",
        "--timeout", "5", "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "+stored needs a /v1/chat/completions URL" in done.stderr
    assert not out.exists()
