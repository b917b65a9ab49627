"""Clocks for the scheduler: the event loop's, or a virtual one for tests in simulated time."""

from __future__ import annotations

import asyncio
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep_until(self, deadline: float) -> None: ...


class LoopClock:
    """The running event loop's monotonic clock.

    Timers wake late: epoll rounds its timeout up to whole milliseconds and the kernel adds
    its own latency, 0.3-2 ms on a loaded machine, which is a large error on a 4 ms decode
    step. The clock learns the typical lateness (an exponential average) and wakes that much
    earlier, so wake-ups scatter around the deadline instead of always after it, at no CPU
    cost (no spinning).
    """

    MAX_LEAD = 0.005

    def __init__(self) -> None:
        self._lead = 0.0

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - self.now() - self._lead
        if delay <= 0:
            # sleep(0) still yields, so a zero-cost step (profile "instant") lets handlers run.
            await asyncio.sleep(0)
            return
        await asyncio.sleep(delay)
        error = self.now() - deadline  # > 0: late
        self._lead = min(self.MAX_LEAD, max(0.0, self._lead + 0.25 * error))


class VirtualClock:
    """Time that jumps: `sleep_until` moves the clock forward at once and only yields."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    async def sleep_until(self, deadline: float) -> None:
        self._now = max(self._now, deadline)
        await asyncio.sleep(0)
