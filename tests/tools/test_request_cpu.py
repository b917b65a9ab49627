"""`python -m tools.request_cpu` as a user runs it, and its instruction count from two runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.edge_latency import Response
from tests.bench.conftest import run_command
from tests.tools.conftest import FakeValgrind


async def test_request_cpu_reports_the_cost_of_whole_requests() -> None:
    done = await run_command(
        "tools.request_cpu", "--requests", "40", "--repeats", "2", "--concurrency", "4",
        "--tokens", "3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("edge CPU per request: min ")
    assert "(2 x 40 requests, 4 connections, 3 tokens each)" in done.stdout


def test_request_cpu_stand_in_streams_as_sglang_does() -> None:
    from tools.request_cpu import stream_reads

    reads = stream_reads(2)
    assert len(reads) == 4 and reads[0].startswith(b"HTTP/1.1 200 OK\r\n")
    r = Response(0.0)
    assert [r.feed(read, float(i)) for i, read in enumerate(reads)] == [False] * 3 + [True]
    assert r.tokens == [1.0, 2.0]  # the role chunk carries no text


def test_request_cpu_counts_instructions_per_request_from_two_runs(
    fake_valgrind: FakeValgrind, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.request_cpu import main

    fake_valgrind("--repeats 3", 5_000_000, 1_000_000)  # the total grows with --repeats
    assert main(["--requests", "100", "--instructions"]) == 0
    out = capsys.readouterr().out  # (5M - 1M) over the 200 requests of the two extra repeats
    assert out.startswith("edge instructions per request: 20000 (200 requests, 32 connections")


def test_request_cpu_says_when_valgrind_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.request_cpu import main

    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["--instructions"]) == 1
    assert "needs valgrind" in capsys.readouterr().err
