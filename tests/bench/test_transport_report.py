"""The transport report's arithmetic: floors, expected round trips, 0-RTT savings, added latency."""

from __future__ import annotations

from typing import Any

from bench.transport_report import Endpoints, matrix_specs, render_report


def _run(rtt: float | None, medians: dict[str, float]) -> dict[str, Any]:
    summary = {
        name: {
            "ttft_ms": {"p50": value, "p90": value + 1},
            "early_data_accepted": 0,
            "early_data_attempted": 0,
            "failed": 0,
        }
        for name, value in medians.items()
    }
    return {"run": {"rtt_ms": rtt}, "summary": summary}


def test_report_subtracts_the_floor_and_checks_the_savings() -> None:
    floor = {"edge-h3+0rtt": 5.0, "edge-h3": 8.0, "edge-h2": 4.0}
    at_50 = {"edge-h3+0rtt": 56.0, "edge-h3": 109.0, "edge-h2": 156.0}
    at_20 = {"edge-h3+0rtt": 25.0, "edge-h3": 90.0, "edge-h2": 64.0}
    warm = {"edge-h3": 3.0, "stub-h3": 1.0, "edge-h1plain": 2.5, "direct-h1plain": 1.0}
    report = render_report(
        {
            "rtt0-reuse": _run(None, warm),
            "rtt0": _run(None, floor),
            "rtt50": _run(50.0, at_50),
            "rtt20": _run(20.0, at_20),
        }
    )
    # median − floor, and that − expected: 56 − 5 = 51 against 1 × 50.
    assert "| 50 | edge-h3+0rtt | 1 | 50.0 | 56.0 | 57.0 | 51.0 | +1.0 |" in report
    assert "| 50 | edge-h2 | 3 | 150.0 | 156.0 | 157.0 | 152.0 | +2.0 |" in report
    assert "| 50 | edge | 53.0 (expect 50) | 100.0 (expect 100) | yes |" in report
    assert "| 20 | edge | 65.0 (expect 20) | 39.0 (expect 40) | no |" in report
    assert "| h3 | 3.00 | stub 1.00 | +2.00 |" in report
    assert "| h1plain | 2.50 | direct 1.00 | +1.50 |" in report
    assert report.index("| 20 | edge-h3+0rtt") < report.index("| 50 | edge-h3+0rtt")


def test_configs_cover_the_matrix() -> None:
    ep = Endpoints("https://e:1/x", "https://e:2/x", "http://e:3/x", "https://s:4/x",
                   "https://s:5/x", "http://d:6/x")  # fmt: skip
    new = matrix_specs(ep, edge=True, stub=True, reuse=False)
    assert "edge-h3+0rtt=h3+0rtt@https://e:1/x" in new
    assert "stub-h2=h2+new@https://s:5/x" in new
    assert new[-2:] == ["edge-h1plain=h1+new@http://e:3/x", "direct-h1plain=h1+new@http://d:6/x"]
    warm = matrix_specs(ep, edge=False, stub=True, reuse=True)
    assert not any("0rtt" in spec or spec.startswith("edge") for spec in warm)
    assert "stub-h3=h3+reuse@https://s:4/x" in warm
