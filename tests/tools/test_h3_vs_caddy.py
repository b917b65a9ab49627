"""`tools.h3_vs_caddy` end to end with the edge alone (Caddy is the yardstick where installed):
a stand-in, `quicedge serve`, one bench run per configuration through the RTT relay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import h3_vs_caddy


def test_caddyfile_serves_h3_with_the_given_certificate(tmp_path: Path) -> None:
    text = h3_vs_caddy.caddy_h3_config(4433, "http://127.0.0.1:31001", tmp_path / "c.pem", "k")
    assert "https://localhost:4433" in text and "protocols h1 h2 h3" in text
    assert f"tls {tmp_path / 'c.pem'} k" in text and "reverse_proxy 127.0.0.1:31001" in text
    assert "flush_interval -1" in text


def test_a_small_run_measures_the_edge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--no-caddy", "--num", "8", "--rounds", "1", "--rtt-ms", "10",
            "--configs", "h3+0rtt", "h3", "--out", str(tmp_path)]  # fmt: skip
    assert h3_vs_caddy.main(argv) == 0
    result = json.loads((tmp_path / "h3_vs_caddy.json").read_text())
    assert set(result) == {"command", "quicedge/h3+0rtt", "quicedge/h3"}
    assert result["command"] == "python -m tools.h3_vs_caddy " + " ".join(argv)
    (early,) = result["quicedge/h3+0rtt"]["runs"]
    (full,) = result["quicedge/h3"]["runs"]
    assert early["completed"] == full["completed"] == 8
    assert early["early"] == 8 and full["early"] == 0
    assert early["cpu_ms"] > 0 and full["cpu_ms"] > 0  # new QUIC connections cost ticks
    assert full["answer_p50"] >= full["ttft_p50"] > 0
    assert "| quicedge | h3+0rtt |" in capsys.readouterr().out


def test_the_json_names_the_command_that_produced_it(capsys: pytest.CaptureFixture[str]) -> None:
    run = {"ttft_p50": 20.0, "ttft_p90": 25.0, "answer_p50": 30.0, "itl_p99": 1.0,
           "cpu_ms": 2.0, "completed": 4, "early": 4, "requests": 4}  # fmt: skip
    result = h3_vs_caddy.summarize(
        {("quicedge", "h3+0rtt"): [run]}, rtt_ms=10.0, command="python -m tools.h3_vs_caddy x"
    )
    assert result["command"] == "python -m tools.h3_vs_caddy x"
    assert result["quicedge/h3+0rtt"]["ttft_p50_rtt"] == 2.0
    assert "| quicedge | h3+0rtt |" in capsys.readouterr().out
