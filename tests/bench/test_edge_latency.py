"""`python -m bench.edge_latency` against a stand-in, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.sim import SimConfig, SimServer
from bench.edge_latency import REPO, Response
from tests.bench.conftest import run_command

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'


def _token(i: int) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i


def _chunk(data: bytes, ext: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(data), ext, data)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_reports_each_target_and_the_added_latency() -> None:
    async with SimServer(SimConfig(name="el", port=0, profile="instant")) as sim:
        done = await run_command(
            "bench.edge_latency", f"a={sim.url}", f"b={sim.url}",
            "--rounds", "2", "--per-round", "3", "--warmup", "1", "--max-tokens", "4",
            "--cpu-pid", f"self={os.getpid()}",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "concurrency 1:"
    assert lines[1].strip().startswith("a: first byte p50")
    assert "| ITL p50 " in lines[1] and "CPU/request self" in lines[1]
    assert lines[2].strip().startswith("b: first byte p50")
    assert "added over a: TTFT p50" in lines[3] and "ITL p99" in lines[3]


async def test_concurrent_streams_report_itl_and_the_added_figures(tmp_path: Path) -> None:
    out = tmp_path / "el.json"
    async with SimServer(SimConfig(name="el", port=0, profile="instant")) as sim:
        done = await run_command(
            "bench.edge_latency", f"a={sim.url}", f"b={sim.url}", "--concurrency", "3",
            "--rounds", "2", "--per-round", "6", "--warmup", "1", "--max-tokens", "5",
            "--pause-ms", "0", "--json", str(out), "--no-rt",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "concurrency 3:"
    report = json.loads(out.read_text())
    assert report["config"]["concurrency"] == [3]
    assert report["config"]["client_priority"] == "normal"
    (run,) = report["runs"]
    a, b = run["targets"]
    # 2 rounds of 6 requests, 2 on each of the 3 connections.
    assert a["requests"] == b["requests"] == 12
    assert set(a["ttft_ms"]) == {"p50", "p90", "p99"} and set(a["itl_ms"]) == {"p50", "p99"}
    assert a["req_per_s"] > 0 and a["added_ms"] is None
    assert b["added_over"] == "a"
    assert set(b["added_ms"]) == {"ttft_p50", "ttft_p99", "itl_p99", "first_byte_p50"}
    assert b["added_ms"]["ttft_p50"] == b["ttft_ms"]["p50"] - a["ttft_ms"]["p50"]


async def test_legs_join_the_clients_stamps_with_the_stand_ins(tmp_path: Path) -> None:
    out = tmp_path / "el.json"
    config = SimConfig(name="el", port=0, profile="instant", record_timings=1000)
    async with SimServer(config) as sim:
        done = await run_command(
            "bench.edge_latency", f"a={sim.url}", f"b={sim.url}", "--concurrency", "2",
            "--rounds", "2", "--per-round", "4", "--warmup", "1", "--max-tokens", "3",
            "--pause-ms", "0", "--json", str(out), "--no-rt", "--sim-timings", sim.url,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "legs (8 requests): request (send → stand-in read) p50" in done.stdout
    assert "legs added over a: request p50" in done.stdout
    (run,) = json.loads(out.read_text())["runs"]
    a, b = run["targets"]
    for row in (a, b):
        legs = row["legs"]
        assert legs["joined"] == row["requests"] == 8  # every request, each rid its own
        # both clocks are one (CLOCK_MONOTONIC): each leg is short, and only the response leg
        # may be a hair negative (the stand-in stamps after its write returned; the client may
        # have read it by then)
        assert 0 <= legs["request_leg_ms"]["p50"] <= legs["request_leg_ms"]["p99"] < 1000
        assert -1 < legs["response_leg_ms"]["p50"] <= legs["response_leg_ms"]["p99"] < 1000
    assert "added_ms" not in a["legs"]
    assert b["legs"]["added_ms"]["request_p50"] == pytest.approx(
        b["legs"]["request_leg_ms"]["p50"] - a["legs"]["request_leg_ms"]["p50"]
    )


async def test_idle_connections_closed_by_the_server_are_reopened() -> None:
    # The stand-in closes idle connections after 0.1 s; each request waits 0.3 s first.
    config = SimConfig(name="el", port=0, profile="instant", timeout_keep_alive=0.1)
    async with SimServer(config) as sim:
        for concurrency in ("1", "2"):
            done = await run_command(
                "bench.edge_latency", f"a={sim.url}", "--concurrency", concurrency,
                "--rounds", "1", "--per-round", "2", "--warmup", "0", "--max-tokens", "2",
                "--pause-ms", "300",
            )  # fmt: skip
            assert done.returncode == 0, done.stderr


async def test_refused_answers_fail_the_run() -> None:
    async with SimServer(SimConfig(name="el", port=0, profile="instant")) as sim:
        done = await run_command(
            "bench.edge_latency", f"a={sim.url}", "--max-tokens", "0", "--rounds", "1",
            "--per-round", "1", "--warmup", "0",
        )  # fmt: skip
    assert done.returncode == 1 and "edge_latency: " in done.stderr


async def test_spawn_writes_both_reports_and_stops_its_processes(tmp_path: Path) -> None:
    done = await run_command(
        "bench.edge_latency", "--spawn", "--out", str(tmp_path), "--concurrency", "1", "2",
        "--rounds", "1", "--per-round", "4", "--warmup", "1", "--max-tokens", "4",
        "--pause-ms", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "edge_latency.json").read_text())
    assert [run["concurrency"] for run in report["runs"]] == [1, 2]
    for run in report["runs"]:
        direct, edge = run["targets"]
        assert direct["name"] == "direct" and edge["name"] == "edge"
        assert edge["added_ms"]["ttft_p99"] is not None
        assert set(edge["cpu_ms_per_request"]) == {"sim", "edge", "client"}
        # the edge's own histograms count exactly the measured requests (not the warm-up)
        own = run["edge_own_ms"]
        assert own["requests"] == edge["requests"] and own["chunks"] >= edge["requests"]
        assert own["added_p50"] is not None and own["relay_delay_p99"] is not None
    if len(os.sched_getaffinity(0)) >= 2:
        assert report["pinning"]["edge"] == [max(os.sched_getaffinity(0))]
    table = (tmp_path / "edge_latency.md").read_text()
    assert "| 2 | edge | 4 |" in table and "CPU pinning:" in table
    priority = report["config"]["client_priority"]
    assert priority == "SCHED_FIFO 10" or priority.startswith("normal (real-time refused")
    assert f"Client priority: {priority}" in table
    assert "The edge's own timing" in table
    assert "The legs of each request" in table
    for run in report["runs"]:
        direct, edge = run["targets"]
        assert direct["legs"]["joined"] == direct["requests"]
        assert edge["legs"]["joined"] == edge["requests"]  # the edge passed each rid on
        assert edge["legs"]["added_ms"]["request_p99"] is not None
    assert "Stand-in profile: instant (time scale 1)" in table
    for pid in (report["pids"]["sim"], report["pids"]["edge"]):
        assert not _running(pid), f"process {pid} still running"


def test_real_time_client_is_not_inherited_by_its_children() -> None:
    """The stand-in and the edge are started by the client: they must run at normal priority."""
    script = (
        "import os, subprocess, sys\n"
        "from bench.edge_latency import client_priority\n"
        "said = client_priority(True)\n"
        "child = subprocess.run([sys.executable, '-c',"
        " 'import os; print(os.sched_getscheduler(0))'], capture_output=True, text=True)\n"
        "print(said, os.sched_getscheduler(0), child.stdout.strip(), sep='|')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO
    )
    said, ours, theirs = done.stdout.strip().split("|")
    if said == "SCHED_FIFO 10":
        assert int(ours) & ~getattr(os, "SCHED_RESET_ON_FORK", 0) == os.SCHED_FIFO
    else:
        assert said.startswith("normal (real-time refused")
    assert int(theirs) == os.SCHED_OTHER


def test_chunked_answer_split_anywhere_ends_where_it_ends() -> None:
    body = ROLE + _token(0) + _token(1) + _token(2) + b"data: [DONE]\n\n"
    wire = HEAD + _chunk(body[:7], b";x=1") + _chunk(body[7:100]) + _chunk(body[100:])
    wire += b"0\r\n\r\n"
    r = Response(0.0)
    ends = [r.feed(wire[i : i + 1], i + 1.0) for i in range(len(wire))]
    assert ends.index(True) == len(wire) - 1
    assert len(r.tokens) == 3 and r.first_byte == 1.0
    assert r.tokens == sorted(r.tokens) and r.tokens[0] > wire.index(b'"t0"')


def test_tokens_read_together_arrive_together() -> None:
    r = Response(0.0)
    assert not r.feed(HEAD + _chunk(ROLE + _token(0)) + _chunk(_token(1)), 1.0)
    assert r.feed(_chunk(_token(2) + _token(3)) + b"0\r\n\r\n", 2.0)
    assert r.tokens == [1.0, 1.0, 2.0, 2.0]


def test_content_length_answers_are_framed_too() -> None:
    body = _token(0) + _token(1)
    r = Response(0.0)
    assert not r.feed(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body[:9], 1)
    assert r.feed(body[9:], 2.0) and r.tokens == [2.0, 2.0]
