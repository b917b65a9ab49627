"""Each benchmark report names the command that produced it: shell-quoted, with the arguments
`main` ran with (not this process's `sys.argv`). The reports are built from small fake results
here; the benchmarks themselves are not run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import rollout, routing, transport_report
from tests.bench.test_transport_report import _run


def test_the_rollout_report_names_the_arguments_it_ran_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_spread = {"sd": 0.0}
    fake = {
        "n": 1, "pairs": 0, "side": 0, "errors": 0, "p50_ms": 1.0, "p99_ms": 2.0,
        "rounds_p50_ms": [1.0], "rounds_p99_ms": [2.0], "rounds_p50_spread": fake_spread,
        "rounds_p99_spread": fake_spread, "paired_p50_diff_ms": {"mean": 0.0, **fake_spread},
        "paired_p99_diff_ms": {"mean": 0.0, **fake_spread},
    }  # fmt: skip

    async def shadow_cost(**_: Any) -> dict[str, Any]:
        return {setting: dict(fake) for setting in rollout.SETTINGS}

    monkeypatch.setattr(rollout, "shadow_cost", shadow_cost)
    monkeypatch.setattr(rollout, "full_ramp", lambda *_, **__: {"state": "promoted"})
    monkeypatch.setattr("sys.argv", ["pytest", "--something-else"])
    out = tmp_path / "a dir"
    argv = ["--no-detection", "--requests", "3", "--out", str(out)]
    assert rollout.main(argv) == 0
    report = json.loads((out / "rollout.json").read_text())
    expected = f"python -m bench.rollout --no-detection --requests 3 --out '{out}'"
    assert report["command"] == expected
    assert f"Command: `{expected}`" in (out / "rollout.md").read_text()


def test_the_transport_report_header_names_the_arguments_it_ran_with(tmp_path: Path) -> None:
    argv = ["--rtts", "20", "--num", "2", "--out", str(tmp_path)]
    args = transport_report.build_parser().parse_args(argv)
    args.argv = argv
    path = transport_report.write_report(args, {"rtt0": _run(None, {"edge-h3": 5.0})})
    text = path.read_text()
    assert f"Command: `python -m bench.transport_report {' '.join(argv)}`" in text
    assert "2 requests per configuration and RTT" in text


def test_the_routing_report_names_the_arguments_it_ran_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sys.argv", ["pytest", "--something-else"])
    argv = ["--out", "x y", "--workloads", "uniform", "--policies", "ttft", "--seed", "3"]
    args = routing.parse_args(argv)
    result = routing.RunResult(
        workload="uniform", policy="ttft", rate=10.0, requests=5, errors=0, hit_rate=0.5,
        ttft_p50_ms=1.0, ttft_p90_ms=2.0, ttft_p99_ms=3.0, ttft_mean_ms=1.5,
        throughput_rps=9.0, output_tok_s=90.0, busy=0.5, active=0.5,
        share={f"b{i}": 0.25 for i in range(routing.FLEET)}, reasons={}, wall_s=1.0,
    )  # fmt: skip
    text = routing.render([result], [], args)
    expected = ("python -m bench.routing --out 'x y' --workloads uniform --policies ttft"
                " --seed 3")  # fmt: skip
    assert routing.command(args) == expected
    assert f"Command: `{expected}`" in text
