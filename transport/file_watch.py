"""Polling files for changes: the certificate (`[serve] cert_poll_interval`) and the config file
(`[proxy] config_poll_interval`, `edge.reload`).

A poll of `os.stat` every few seconds rather than inotify: it costs microseconds, needs no
library, and sees what inotify on the watched path misses in Kubernetes, where a ConfigMap or
Secret volume is updated by pointing a symlink (`..data`) at a new directory.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence

from transport.loop import cancelled

Stamp = tuple[int, int, int]


def file_stamp(path: str) -> Stamp | None:
    """What tells that a file changed: inode, modification time and size (a swapped symlink
    changes the inode even when the new file has the old one's size and time). None: missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class FileWatch:
    """Calls `on_change` on the loop when any of `paths` changed since the last look.

    A file that is missing at a look is not a change: the next look that finds it is (a writer
    that removes and recreates the file is seen once, when it is back)."""

    def __init__(
        self, paths: Sequence[str], interval: float, on_change: Callable[[], None]
    ) -> None:
        if interval <= 0:
            raise ValueError(f"a file poll interval must be > 0, got {interval}")
        self.paths = list(paths)
        self.interval = interval
        self._on_change = on_change
        self._stamps = self.stamps()
        self._task: asyncio.Task[None] | None = None

    def stamps(self) -> list[Stamp | None]:
        return [file_stamp(path) for path in self.paths]

    def seen(self) -> None:
        """The files as they are now count as seen (a reload that just read them)."""
        self._stamps = self.stamps()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            stamps = self.stamps()
            if None in stamps or stamps == self._stamps:
                continue
            self._stamps = stamps
            self._on_change()

    async def aclose(self) -> None:
        await cancelled(self._task)
        self._task = None


__all__ = ["FileWatch", "Stamp", "file_stamp"]
