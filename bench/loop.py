"""The event loop the bench commands run on.

The default selector (epoll) takes its timeout in whole milliseconds, rounded up, so every
`call_at` fires 0-1 ms late; that would skew both the RTT emulator and the timings. `select()`
takes microseconds. Its cost grows with the number of open descriptors and it stops at
FD_SETSIZE (1024), far above what a latency benchmark keeps open.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a loop with microsecond timer resolution."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
