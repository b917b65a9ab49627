"""The event loop a server process runs on: asyncio's own, or uvloop when it is installed.

Every request crosses the loop several times (socket readable, a task step, a write), and the
edge's TTFT on a small machine is mostly that CPU work. uvloop runs the loop, the transports
and their writes in C (libuv): on the benchmark VM it took a few hundred microseconds off the
edge's per-request CPU (docs/benchmarks.md, "Edge-added latency"). ``auto`` picks it when it can
be imported and falls back to asyncio's loop otherwise (Windows, or an install without it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

LOOPS = ("auto", "asyncio", "uvloop")


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(name: str) -> str:
    """``auto`` → ``uvloop`` or ``asyncio``; a loop that cannot be had is a ValueError."""
    if name not in LOOPS:
        raise ValueError(f"loop must be one of {', '.join(LOOPS)}, got {name!r}")
    if name == "auto":
        return "uvloop" if uvloop_available() else "asyncio"
    if name == "uvloop" and not uvloop_available():
        raise ValueError("loop uvloop: uvloop is not installed (pip install uvloop)")
    return name


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if resolve(name) == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def running_loop_name() -> str:
    """``uvloop`` or ``asyncio``: the loop this coroutine actually runs on."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


def run(main: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """``asyncio.run(main)`` on the chosen loop."""
    try:
        factory = loop_factory(loop)
    except ValueError:
        main.close()  # never awaited: close it rather than leave a warning behind
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


async def cancelled(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it has ended (None, or one already done:
    nothing to do)."""
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


__all__ = [
    "LOOPS",
    "cancelled",
    "loop_factory",
    "resolve",
    "run",
    "running_loop_name",
    "uvloop_available",
]
