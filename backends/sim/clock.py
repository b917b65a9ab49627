"""Clocks for the scheduler: the event loop's, or a virtual one for tests in simulated time."""

from __future__ import annotations

import asyncio
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep_until(self, deadline: float) -> None: ...


class LoopClock:
    """The running event loop's monotonic clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep_until(self, deadline: float) -> None:
        # sleep(0) still yields, so a zero-cost step (profile "instant") lets handlers run.
        await asyncio.sleep(max(0.0, deadline - self.now()))


class VirtualClock:
    """Time that jumps: `sleep_until` moves the clock forward at once and only yields."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    async def sleep_until(self, deadline: float) -> None:
        self._now = max(self._now, deadline)
        await asyncio.sleep(0)
