"""`quicedge bench` end to end, as a user runs it, against real servers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backends.sim import SimConfig, SimServer
from bench.cli import main as bench_main
from certs import DevCertificates
from tests.bench.conftest import Servers, run_command
from tests.helpers import free_port

RECORD_FIELDS = {
    "ttft_ms", "itl_ms", "latency_ms", "prompt_tokens", "cached_tokens", "backend", "early_data",
    "transport", "status", "error", "config", "index", "turn", "connect_ms", "cached_fraction",
    "completion_tokens", "early_data_attempted", "new_connection", "start_s",
}  # fmt: skip
SUMMARY_FIELDS = {
    "requests", "completed", "failed", "errors", "ttft_ms", "itl_ms", "latency_ms",
    "request_throughput", "output_throughput", "cache_hit_rate", "early_data_accepted",
}  # fmt: skip


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    config = SimConfig(name="b1", port=0, profile="instant", enable_cache_report=True, seed=0)
    async with SimServer(config) as server:
        yield server


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/generate"])
async def test_gsp_against_the_stand_in_over_h1(sim: SimServer, tmp_path: Path, route: str) -> None:
    out, summary = tmp_path / "runs.jsonl", tmp_path / "summary.json"
    done = await run_command(
        "bench.cli", "--url", sim.url + route, "--workload", "gsp", "--num", "6",
        "--gsp-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-len", "64",
        "--gsp-question-len", "8", "--gsp-ordered", "--output-len", "5", "--concurrency", "2",
        "--output", str(out), "--summary-json", str(summary),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "p99 TTFT (ms)" in done.stdout and "cache hit rate" in done.stdout
    records = _lines(out)
    assert len(records) == 6
    for rec in records:
        assert RECORD_FIELDS <= rec.keys()
        assert rec["status"] == 200 and rec["error"] is None
        assert rec["transport"] == "h1" and rec["early_data"] is False
        assert 0 < rec["ttft_ms"] <= rec["latency_ms"]
        assert rec["completion_tokens"] == 5
        assert len(rec["itl_ms"]) == 4  # 5 tokens: 4 gaps (split per token on /generate)
        assert rec["prompt_tokens"] > 64
    # Ordered gsp: the later prompts of each group hit the shared system prompt in the cache.
    by_group: dict[int, list[int]] = {}
    for rec in sorted(records, key=lambda r: r["index"]):
        by_group.setdefault(rec["group"], []).append(rec["cached_tokens"])
    for cached in by_group.values():
        assert max(cached[1:]) >= 64
    document = json.loads(summary.read_text())
    (only,) = document["summary"].values()
    assert SUMMARY_FIELDS <= only.keys()
    assert only["completed"] == 6 and only["failed"] == 0
    assert {"p50", "p90", "p99", "mean"} <= only["ttft_ms"].keys()
    assert 0 < only["cache_hit_rate"] < 1


async def test_chat_sessions_resend_the_conversation(sim: SimServer, tmp_path: Path) -> None:
    out = tmp_path / "runs.jsonl"
    done = await run_command(
        "bench.cli", "--url", sim.url + "/v1/chat/completions", "--workload", "chat",
        "--num", "4", "--chat-turns", "2", "--output-len", "4", "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = sorted(_lines(out), key=lambda r: (r["index"], r["turn"]))
    assert [(r["index"], r["turn"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first, second = records[0], records[1]
    assert first["session"] == second["session"] is not None
    # The second turn carries the first prompt and answer: longer, and its prefix is cached.
    assert second["prompt_tokens"] > first["prompt_tokens"] + 4
    assert second["cached_tokens"] >= first["prompt_tokens"] - 8


async def test_compare_through_the_relay_counts_round_trips(
    servers: Servers, dev_certs: DevCertificates, tmp_path: Path
) -> None:
    """Interleaved configurations through a 30 ms relay: 0-RTT is accepted, and no request can
    beat its transport's round-trip count (TLS/TCP 3, QUIC 2, QUIC 0-RTT 1)."""
    rtt = 30.0
    out, summary, plots = tmp_path / "runs.jsonl", tmp_path / "s.json", tmp_path / "plots"
    h3 = f"https://localhost:{servers.h3_port}/v1/chat/completions"
    tcp = f"https://localhost:{servers.tls_port}/v1/chat/completions"
    done = await run_command(
        "bench.cli", "--url", h3, "--cacert", str(dev_certs.ca_cert), "--workload", "random",
        "--num", "3", "--random-input-len", "8", "--rtt-ms", str(rtt),
        "--new-connection-per-request", "--output", str(out), "--summary-json", str(summary),
        "--plots", str(plots),
        "--compare", "h3+0rtt", "h3", f"h2@{tcp}", f"h1@{tcp}", f"h2reuse=h2+reuse@{tcp}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = _lines(out)
    assert len(records) == 15
    assert [r["config"] for r in records[:5]] == ["h3+0rtt", "h3", "h2", "h1", "h2reuse"]
    assert [r["config"] for r in records[5:10]] == ["h3", "h2", "h1", "h2reuse", "h3+0rtt"]
    round_trips = {"h3+0rtt": 1, "h3": 2, "h2": 3, "h1": 3, "h2reuse": 1}
    for rec in records:
        assert rec["status"] == 200 and rec["error"] is None, rec
        assert rec["ttft_ms"] >= round_trips[rec["config"]] * rtt - 1.0, rec
        assert rec["early_data"] is (rec["config"] == "h3+0rtt")
        assert rec["new_connection"] is (rec["config"] != "h2reuse")
    assert {r["transport"] for r in records if r["config"] == "h1"} == {"h1"}
    document = json.loads(summary.read_text())
    assert document["run"]["rtt_ms"] == rtt
    assert document["summary"]["h3+0rtt"]["early_data_accepted"] == 3
    assert sorted(p.name for p in plots.iterdir()) == ["ttft_cdf.png", "ttft_vs_cached.png"]
    assert all(p.stat().st_size > 1000 for p in plots.iterdir())


async def test_replay_file(sim: SimServer, tmp_path: Path) -> None:
    replay = tmp_path / "replay.jsonl"
    replay.write_text(
        json.dumps({"prompt": "one two three", "output_len": 3}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}], "session": "s"}) + "\n"
    )  # fmt: skip
    out = tmp_path / "runs.jsonl"
    done = await run_command(
        "bench.cli", "--url", sim.url + "/v1/chat/completions", "--workload", "replay",
        "--replay-file", str(replay), "--num", "2", "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = _lines(out)
    assert sorted(r["completion_tokens"] for r in records) == [3, 32]


async def test_unreachable_target_reports_errors_and_fails(tmp_path: Path) -> None:
    out = tmp_path / "runs.jsonl"
    done = await run_command(
        "bench.cli", "--url", f"http://127.0.0.1:{free_port()}/generate", "--num", "2",
        "--warmup", "0", "--timeout", "5", "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 1
    records = _lines(out)
    assert len(records) == 2 and all(r["error"] and r["ttft_ms"] is None for r in records)
    assert "errors" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "ftp://x/"], "http:// or https://"),
        (["--url", "http://x/", "--0rtt"], "--0rtt needs --transport h3"),
        (["--url", "http://x/", "--transport", "h2"], "needs an https:// URL"),
        (["--url", "http://x/", "--concurrency", "0"], "--concurrency must be >= 1"),
        (["--url", "http://x/", "--rate", "0"], "--rate must be > 0"),
        (["--url", "http://x/", "--num", "0"], "num must be >= 1"),
        (["--url", "http://x/", "--workload", "replay"], "needs --replay-file"),
        (["--url", "http://x/", "--loss", "0.1"], "need --rtt-ms"),
        (["--url", "https://x/", "--compare", "h2+0rtt"], "0-RTT needs h3"),
        (["--url", "https://x/", "--compare", "h3", "h3"], "names must be unique"),
        (["--url", "https://x/", "--compare", "quic"], "bad configuration"),
        (["--url", "https://x/", "--rtt-ms", "-5"], "RTT must be >= 0"),
    ],
)
def test_bad_input_is_a_clear_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_main(args)  # argument errors stop before any connection is made
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


async def test_quicedge_bench_relay_dispatch() -> None:
    done = await run_command("edge.cli", "bench", "relay", "--help")
    assert done.returncode == 0 and "RTT emulator" in done.stdout


async def test_poisson_arrivals_stop_at_the_duration(sim: SimServer, tmp_path: Path) -> None:
    out = tmp_path / "runs.jsonl"
    done = await run_command(
        "bench.cli", "--url", sim.url + "/generate", "--workload", "random", "--num", "200",
        "--random-input-len", "4", "--output-len", "2", "--rate", "40", "--concurrency", "8",
        "--duration", "0.5", "--progress", "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = _lines(out)
    assert 0 < len(records) < 200  # ~20 arrivals in 0.5 s at 40/s
    assert all(r["status"] == 200 for r in records)
    assert max(r["start_s"] for r in records) < 5.0
    assert "] " in done.stderr and "errors=0" in done.stderr  # the progress bar
