"""`transport.file_watch`: what counts as a changed file, on a real filesystem and a real loop."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.helpers import wait_until
from transport.file_watch import FileWatch, file_stamp


def swap_link(link: Path, target: Path) -> None:
    """Point `link` at `target` in one rename, as Kubernetes updates a mounted volume."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.symlink_to(target)
    os.replace(tmp, link)


def test_a_swapped_symlink_is_a_change_even_with_the_same_size_and_time(tmp_path: Path) -> None:
    first, second, link = tmp_path / "a", tmp_path / "b", tmp_path / "config.toml"
    first.write_text("x = 1")
    second.write_text("x = 2")
    st = first.stat()
    os.utime(second, ns=(st.st_atime_ns, st.st_mtime_ns))
    link.symlink_to(first)
    before = file_stamp(str(link))
    swap_link(link, second)
    assert before is not None and file_stamp(str(link)) not in (None, before)
    assert file_stamp(str(tmp_path / "missing")) is None


async def test_changes_are_reported_once_and_a_missing_file_waits_until_it_is_back(
    tmp_path: Path,
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("one")
    key.write_text("one")
    changes: list[int] = []
    watch = FileWatch([str(cert), str(key)], 0.02, lambda: changes.append(1))
    watch.start()
    try:
        await asyncio.sleep(0.1)
        assert changes == []  # nothing changed: nothing reported
        key.write_text("two, longer")
        await wait_until(lambda: len(changes) == 1)
        await asyncio.sleep(0.1)
        assert len(changes) == 1  # one change, one call
        cert.unlink()
        await asyncio.sleep(0.1)
        assert len(changes) == 1  # half a renewal (a file missing) is not acted on
        cert.write_text("three")
        await wait_until(lambda: len(changes) == 2)
        key.write_text("seen already")
        watch.seen()  # a reload that read the files itself
        await asyncio.sleep(0.1)
        assert len(changes) == 2
    finally:
        await watch.aclose()


def test_the_interval_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        FileWatch([str(tmp_path)], 0, lambda: None)
