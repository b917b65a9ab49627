"""`quicedge bench` output files it cannot write are refused before the run: a
`--summary-json` in a missing folder used to end a finished run (minutes of it) with a
traceback, its results lost (so did a `--plots` folder that cannot be made); an `--output` one,
with a traceback after the relay started."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.conftest import run_command
from tests.helpers import free_port


@pytest.mark.parametrize("flag", ["--summary-json", "--output", "--plots"])
async def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, flag: str
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    target = a_file / "out.json"  # under a file: neither written nor made
    done = await run_command(
        "bench.cli", "--url", f"http://127.0.0.1:{free_port()}/generate", "--num", "1",
        "--warmup", "0", "--timeout", "5", flag, str(target),
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "workload" not in done.stdout  # nothing was run
    assert done.stderr.splitlines()[-1] == (
        f"quicedge bench: error: {flag} {target}: Not a directory"
    ), done.stderr
    assert "Traceback" not in done.stderr
