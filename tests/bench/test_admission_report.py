"""`bench.admission`'s report names the command that produced it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import admission


def test_the_report_names_the_arguments_it_ran_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("QUICEDGE_BENCH_REDIS_URL", raising=False)
    monkeypatch.setattr("sys.argv", ["pytest", "--something-else"])
    argv = ["--scenarios", "cost", "--cost-calls", "20", "--out", str(tmp_path)]
    assert admission.main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["command"] == "python -m bench.admission " + " ".join(argv)
    assert f"Command: `{report['command']}`" in (tmp_path / "report.md").read_text()
