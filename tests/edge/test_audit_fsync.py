"""`fsync = true`: each batch is on the disk when it is written, and so is the file's name. A
new file's name (the log's first, or the one a rotation starts) and a rotated file's new name
are entries of the folder, which fsync of the file does not write: after a power loss the
lines fsynced into a file whose name was not could be gone, name and all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge.audit import AuditConfig, AuditLog
from tests.edge.test_audit import entry


def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths os.fsync is called on, in order (the real fsync runs)."""
    calls: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


async def test_fsync_writes_a_new_files_name_to_the_folder_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    calls = synced(monkeypatch)
    log = AuditLog(AuditConfig(path=str(path), max_bytes=4096, fsync=True))
    await log.start()
    log._write([entry(0)])  # the writer's own step: the first batch creates the file
    assert calls == [str(path), str(tmp_path)]
    calls.clear()
    log._write([entry(1)])  # a batch into the same file: its name is on the disk already
    assert calls == [str(path)]
    calls.clear()
    for i in range(2, 40):  # ~300 bytes a line: rotations
        log._write([entry(i)])
    await log.aclose()
    rotations = [
        name for name in os.listdir(tmp_path) if name.removeprefix("audit.jsonl.").isdigit()
    ]
    assert len(rotations) >= 2
    # each rotation's first batch: the new file, then the folder (both names are in it)
    assert calls.count(str(tmp_path)) == len(rotations), calls
