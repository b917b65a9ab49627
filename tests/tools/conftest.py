"""Tool test fixtures: a stand-in `valgrind` for the tools that count instructions."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

FakeValgrind = Callable[[str, int, int], None]


@pytest.fixture
def fake_valgrind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeValgrind:
    """`install(pattern, matched, other)` puts a `valgrind` first on PATH that reports `matched`
    instructions for a run whose arguments contain `pattern`, and `other` for any other run."""

    def install(pattern: str, matched: int, other: int) -> None:
        fake = tmp_path / "valgrind"
        fake.write_text(
            "#!/bin/sh\n"
            f'case "$*" in\n'
            f'  *"{pattern}"*) echo "==1== I   refs:      {matched:,}" >&2 ;;\n'
            f'  *) echo "==1== I   refs:      {other:,}" >&2 ;;\n'
            "esac\n"
        )
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    return install
