"""How long a call waited with its event loop free: wall time less the loop thread's CPU time.

A call timed from the edge's side (a Redis round trip) includes the time the loop spent running
other callbacks before it read the answer and resumed the caller. On a busy edge that can be
most of it: 32 requests in one burst, each a fraction of a millisecond of Python, leave the last
of them several milliseconds behind a Redis that answered in 0.1 ms. While the loop thread runs,
it is the edge's own work that delays the answer; while it waits in the poller with nothing to
run, it is the other side's. So a call's *free time* is its wall time less the CPU time its
thread used meanwhile (docs/admission.md, "Redis trouble"). Time the thread was runnable but
not given a core counts as free: an edge starved of CPU blames the call.
"""

from __future__ import annotations

import asyncio
import time


class FreeClock:
    """Free time since it was made, on the thread that made it (the loop's)."""

    __slots__ = ("_cpu", "_wall")

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()

    def free(self) -> float:
        """Seconds since the start that this thread did not run (read it on the same thread)."""
        return (time.perf_counter() - self._wall) - (time.thread_time() - self._cpu)


class FreeDeadline:
    """Expires `timeout` once the call it bounds has had `limit_s` of free time: a loop busy
    with other work moves the deadline on by as long, so an answer already waiting in the socket
    is read rather than refused. Made and checked on the loop's thread."""

    __slots__ = ("_clock", "_handle", "_limit", "_loop", "_timeout")

    def __init__(self, timeout: asyncio.Timeout, limit_s: float) -> None:
        self._clock = FreeClock()
        self._timeout, self._limit = timeout, limit_s
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(limit_s, self._check)

    def free(self) -> float:
        return self._clock.free()

    def _check(self) -> None:
        left = self._limit - self._clock.free()
        if left <= 0:
            self._handle = None
            self._timeout.reschedule(self._loop.time())  # expire: the call is cancelled
        else:
            self._handle = self._loop.call_later(left, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


__all__ = ["FreeClock", "FreeDeadline"]
