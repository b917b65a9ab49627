"""The event loop the bench commands run on.

The default selector (epoll) takes its timeout in whole milliseconds, rounded up, so every
`call_at` fires 0-1 ms late; that would skew both the RTT emulator and the timings. `select()`
takes microseconds, but stops at FD_SETSIZE (1024): `PreciseSelector` waits in `select()` while
every descriptor is below it, and in `poll()` (millisecond timeouts) once one is not, as at a
concurrency near 1000, where `select()` ended the run with "filedescriptor out of range".
"""

from __future__ import annotations

import asyncio
import math
import select
import selectors
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

T = TypeVar("T")

FD_SETSIZE = 1024  # glibc's; select() refuses any descriptor at or above it


class PreciseSelector(selectors.SelectSelector):
    """select() for its microsecond timeout; poll() while a descriptor is past FD_SETSIZE."""

    def __init__(self) -> None:
        super().__init__()
        self._poll = select.poll()
        self._large = 0  # registered descriptors >= FD_SETSIZE

    def register(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        key = super().register(fileobj, events, data)
        mask = (select.POLLIN if events & selectors.EVENT_READ else 0) | (
            select.POLLOUT if events & selectors.EVENT_WRITE else 0
        )
        self._poll.register(key.fd, mask)
        if key.fd >= FD_SETSIZE:
            self._large += 1
        return key

    def unregister(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        key = super().unregister(fileobj)
        self._poll.unregister(key.fd)
        if key.fd >= FD_SETSIZE:
            self._large -= 1
        return key

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if not self._large:
            return super().select(timeout)
        wait = None if timeout is None else max(0, math.ceil(timeout * 1000))
        try:
            events = self._poll.poll(wait)
        except InterruptedError:
            return []
        ready = []
        for fd, event in events:  # as selectors.PollSelector reads them
            mask = selectors.EVENT_WRITE if event & ~select.POLLIN else 0
            if event & ~select.POLLOUT:
                mask |= selectors.EVENT_READ
            key = self.get_map().get(fd)
            if key is not None:
                ready.append((key, mask & key.events))
        return ready


def new_event_loop() -> asyncio.AbstractEventLoop:
    return asyncio.SelectorEventLoop(PreciseSelector())


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a loop with microsecond timer resolution."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
