"""`tools.h3_handshake_instructions`: its serve runs, is driven and stopped, and its count read
(with a stand-in valgrind that runs the command as it is and reports a count of its own)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools import h3_handshake_instructions


def test_a_small_run_drives_serve_and_reads_the_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = tmp_path / "valgrind"
    # Drop valgrind's own options, run the command, then report like cachegrind: a count that
    # grows with the datagrams served, which the fake cannot know, so a fixed one.
    fake.write_text(
        "#!/bin/sh\n"
        'while [ "${1#--}" != "$1" ]; do shift; done\n'
        '"$@" & child=$!\n'
        "trap 'kill -TERM $child' TERM\n"
        "wait $child; wait $child\n"
        "echo '==1== I   refs:      1,000,000' >&2\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    argv = ["--few", "1", "--many", "3", "--kinds", "0-RTT"]
    assert h3_handshake_instructions.main(argv) == 0
    printed = capsys.readouterr().out
    assert "0-RTT     0.000 M instructions per connection (1: 1,000,000, 3: 1,000,000;" in printed
    assert "accepted in 0-RTT: 1/1, 3/3" in printed
