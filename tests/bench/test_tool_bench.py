"""`quicedge bench` as a benchmarker drives it: mistakes caught before the run, not after."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from backends.sim import SimConfig, SimServer
from bench.stub_app import stub_app
from certs import DevCertificates
from tests.bench.conftest import REPO, run_command
from tests.bench.servers import edge_tcp
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


async def test_ctrl_c_reports_the_requests_that_finished(tmp_path: Path) -> None:
    """Ctrl-C in a long run ended it with a traceback: no table and no summary JSON for the
    requests already measured."""
    config = SimConfig(name="b1", port=0, profile="h100-llama3-8b", seed=0)
    out, summary = tmp_path / "runs.jsonl", tmp_path / "summary.json"
    async with SimServer(config) as sim:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.cli", "--url", sim.url + "/v1/chat/completions",
            "--num", "50", "--warmup", "0", "--output-len", "100", "--output", str(out),
            "--summary-json", str(summary), cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            for _ in range(200):  # the first request recorded, 20 s at most
                if out.exists() and out.read_text().count("\n") >= 1:
                    break
                await asyncio.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 20)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 130, stderr.decode()
    assert b"Traceback" not in stderr
    assert b"interrupted" in stderr
    recorded = out.read_text().count("\n")
    assert 1 <= recorded < 50
    assert f"completed / requests           {recorded}/{recorded}" in stdout.decode()
    document = json.loads(summary.read_text())
    assert document["run"]["interrupted"] is True
    assert document["summary"]["h1"]["completed"] == recorded


async def _slow_stub(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The stub's answer after 0.3 s, so that every request of a burst is in flight at once."""
    if scope["type"] == "http":
        await asyncio.sleep(0.3)
    await stub_app(scope, receive, send)


async def test_h2_reuse_beyond_the_servers_stream_limit_waits_for_a_stream(
    dev_certs: DevCertificates,
) -> None:
    """At a concurrency above the server's SETTINGS_MAX_CONCURRENT_STREAMS (100 here) on one
    reused HTTP/2 connection, the requests over it failed at once in the client
    (TooManyStreamsError) and were counted as the server's errors; HTTP/3 waits for a stream."""
    async with edge_tcp(dev_certs, _slow_stub) as server:
        done = await run_command(
            "bench.cli", "--url", f"https://localhost:{server.port}/v1/chat/completions",
            "--cacert", str(dev_certs.ca_cert), "--compare", "h2+reuse", "--num", "110",
            "--concurrency", "110", "--warmup", "1", "--timeout", "20", "--no-edge-cpu",
            "--gsp-system-len", "8", "--gsp-question-len", "4",
        )  # fmt: skip
    assert "TooManyStreams" not in done.stdout
    assert "completed / requests         110/110" in done.stdout, done.stdout
    assert done.returncode == 0, done.stderr


async def test_the_report_says_how_busy_the_client_itself_was(tmp_path: Path) -> None:
    """Nothing told a benchmarker whether the client's own CPU, not the server, set the pace
    (one Python process drives every request): the run now reports the share of a core the
    client used while it ran, and warns when it was near a whole core."""
    config = SimConfig(name="b1", port=0, profile="instant", seed=0)
    summary = tmp_path / "summary.json"
    async with SimServer(config) as sim:
        done = await run_command(
            "bench.cli", "--url", sim.url + "/v1/chat/completions", "--num", "4",
            "--warmup", "0", "--output-len", "3", "--no-edge-cpu",
            "--summary-json", str(summary),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    busy = json.loads(summary.read_text())["run"]["client_cpu_busy"]
    assert isinstance(busy, float) and busy >= 0
    assert f"client CPU {busy:.0%} of a core" in done.stdout


async def test_the_report_gives_the_concurrency_reached(tmp_path: Path) -> None:
    """`--concurrency 8` over 3 sessions printed "concurrency 8" though never more than 3
    requests were in flight: the report now gives the most it reached."""
    config = SimConfig(name="b1", port=0, profile="instant", seed=0)
    summary = tmp_path / "summary.json"
    async with SimServer(config) as sim:
        done = await run_command(
            "bench.cli", "--url", sim.url + "/v1/chat/completions", "--num", "3",
            "--concurrency", "8", "--warmup", "0", "--output-len", "3", "--no-edge-cpu",
            "--summary-json", str(summary),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "concurrency 8 (3 reached)" in done.stdout
    assert json.loads(summary.read_text())["run"]["concurrency_reached"] == 3


_MANY_FDS = """
import os, sys
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # as ~1000 open connections
from bench.cli import main
sys.exit(main(sys.argv[1:]))
"""


async def test_a_run_past_fd_setsize_does_not_crash(tmp_path: Path) -> None:
    """The bench loop waits in select() (microsecond timeouts), which stops at FD_SETSIZE
    (1024): once the process held that many descriptors (a concurrency near 1000), every run
    ended in "ValueError: filedescriptor out of range in select()" and a traceback."""
    config = SimConfig(name="b1", port=0, profile="instant", seed=0)
    async with SimServer(config) as sim:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _MANY_FDS, "--url", sim.url + "/v1/chat/completions",
            "--num", "2", "--warmup", "1", "--output-len", "3", "--no-edge-cpu", "--rate", "50",
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    (row,) = [line for line in stdout.decode().splitlines() if line.startswith("completed")]
    assert row.split()[-1] == "2/2"
