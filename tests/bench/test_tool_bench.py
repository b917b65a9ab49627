"""`quicedge bench` as a benchmarker drives it: mistakes caught before the run, not after."""

from __future__ import annotations

import json
import shlex
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

from backends.sim import SimConfig, SimServer
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


async def test_the_summary_names_the_command_date_and_machine(tmp_path: Path) -> None:
    """The summary JSON said which URL, workload and concurrency, but not the command (its
    timeout, output length, connection reuse...), when, or on which machine: a file found later
    could not be told apart from another run's or reproduced."""
    config = SimConfig(name="b1", port=0, profile="instant", seed=0)
    summary = tmp_path / "summary.json"
    args = [
        "--url", "", "--num", "2", "--warmup", "0", "--output-len", "3",
        "--new-connection-per-request", "--timeout", "7", "--summary-json", str(summary),
    ]  # fmt: skip
    before = datetime.now(UTC)
    async with SimServer(config) as sim:
        args[1] = sim.url + "/v1/chat/completions"
        done = await run_command("bench.cli", *args)
    assert done.returncode == 0, done.stderr
    run = json.loads(summary.read_text())["run"]
    assert run["command"] == "quicedge bench " + shlex.join(args)
    started = datetime.fromisoformat(run["started_at"])
    assert before - timedelta(seconds=1) <= started <= datetime.now(UTC)
    assert run["host"] == socket.gethostname()
