"""The audit log rotated by logrotate, whose numbering is the reverse of the edge's own: its
newest rotated file is `PATH.1` (each run moves `PATH.N` to `PATH.N+1`, then `PATH` to
`PATH.1`, and `create` leaves an empty `PATH`). An edge restarted after a run (a `postrotate`
restart, or any restart before the next request) must continue the chain from the newest
file's last line, not from the oldest file's, which would fork the chain."""

from __future__ import annotations

import gzip
import os
import time
from pathlib import Path

import pytest

from edge.audit import GENESIS, AuditConfig, AuditLog, verify
from edge.cli import main as cli
from tests.edge.test_audit import entry, gzip_away


def logrotate(path: Path, keep: int = 7, compress: bool = False) -> None:
    """One logrotate run (`rotate KEEP`, `create`; `compress` with `delaycompress`: the file
    rotated the run before is compressed now)."""
    for n in range(keep - 1, 0, -1):
        for suffix in ("", ".gz"):
            older = Path(f"{path}.{n}{suffix}")
            if older.exists():
                os.replace(older, f"{path}.{n + 1}{suffix}")
    os.replace(path, f"{path}.1")
    path.touch()
    if compress and Path(f"{path}.2").exists():
        gzip_away(Path(f"{path}.2"))


def decompress(archived: Path) -> None:
    """The archived file back beside itself, plain (to verify the whole chain)."""
    archived.with_suffix("").write_bytes(gzip.decompress(archived.read_bytes()))


async def write(log: AuditLog, first: int, n: int) -> None:
    for i in range(first, first + n):  # each record's `ts` first, as the edge writes them
        log.record({"ts": time.time(), **entry(i)})
    await log.flush()


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "compress"])
async def test_a_restart_after_logrotate_continues_the_chain(
    tmp_path: Path, compress: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditConfig(path=str(path)))
    await log.start()
    await write(log, 0, 3)
    logrotate(path, compress=compress)
    await write(log, 3, 3)  # the running writer opens PATH for each batch: the new one
    logrotate(path, compress=compress)
    await log.aclose()
    restarted = AuditLog(AuditConfig(path=str(path)))
    await restarted.start()  # PATH is empty: the chain's end is in PATH.1, the newest file
    await write(restarted, 6, 2)
    await restarted.aclose()
    if compress:
        decompress(Path(f"{path}.2.gz"))
    result = verify([f"{path}.2", f"{path}.1", str(path)], start=GENESIS)
    assert result.ok and result.lines == 8, result.error
    # and `verify PATH` reads the rotated files oldest first, whichever way they are numbered
    assert cli(["audit", "verify", "--from-genesis", str(path)]) == 0, capsys.readouterr().out
    assert "OK 8 lines in 3 file(s)" in capsys.readouterr().out
