"""Start a request's task in the callback that read the request, not one loop turn later.

``loop.create_task`` runs a coroutine's first step on the loop's next turn, after every other
callback already queued. On a busy edge that turn is long: the I/O callbacks of up to 32 other
streams come first, and the request waited for its first step 1.3–1.8 ms (p50) and 6–9 ms (p99)
after its socket read (docs/benchmarks.md, "Edge-added latency"). Until then, nothing has gone
to a backend. Its first step is short (~0.1 ms: parse, admit, route, write upstream), so it runs
now, inside the read callback, up to its first real wait: the backend's answer.

Python 3.12 does this itself (``Task(..., eager_start=True)``). On 3.11 the first step runs
here, as the task's own step would: in the task's context and with the task as the current task
(``asyncio.current_task()``, ``asyncio.timeout()`` and cancellation see it). The task then takes
over the suspended coroutine through `_Resumed`, which hands it the future the first step is
waiting on.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import sys
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")

_NATIVE = sys.version_info >= (3, 12)


def start_task(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task for ``coro`` whose first step has already run when this returns.

    Call it from a callback of ``loop`` (or a task on it). When the first step finishes the
    coroutine, the task holds the result (3.12) or does on its first turn (3.11).
    """
    if _NATIVE:
        return asyncio.Task(coro, loop=loop, eager_start=True)  # type: ignore[call-arg]
    context = contextvars.copy_context()
    resumed = _Resumed(coro)
    task = loop.create_task(resumed, context=context)
    current = asyncio.current_task(loop)
    if current is not None:
        asyncio.tasks._leave_task(loop, current)  # type: ignore[attr-defined]
    asyncio.tasks._enter_task(loop, task)  # type: ignore[attr-defined]
    try:
        context.run(resumed.first_step)
    finally:
        asyncio.tasks._leave_task(loop, task)  # type: ignore[attr-defined]
        if current is not None:
            asyncio.tasks._enter_task(loop, current)  # type: ignore[attr-defined]
    return task


def resolve_now(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    """``fut.set_result(None)``, and run what waits on it now instead of on the next turn.

    For a wait that stands between a request and its first token, such as the response head
    from a backend: the task waiting on it takes its next step inside this callback, not after
    every callback already queued. Call it from a protocol callback, not from a task (a task
    can't step inside another); from a task it falls back to ``set_result``. The futures' own
    callback list is read (``_callbacks``, in both asyncio's C and Python futures): there is
    no public way to take a callback off a future and run it in place.
    """
    callbacks = fut._callbacks if asyncio.current_task(loop) is None else None  # type: ignore[attr-defined]
    if not callbacks:
        fut.set_result(None)
        return
    for callback, _ in callbacks:
        fut.remove_done_callback(callback)
    fut.set_result(None)
    for callback, context in callbacks:
        if context is None:
            callback(fut)
        else:
            context.run(callback, fut)


_FORWARD, _YIELDED, _RETURNED, _RAISED = range(4)


class _Resumed(collections.abc.Coroutine):  # type: ignore[type-arg]
    """A coroutine whose first step ran already; the task drives the rest of it.

    The task's first ``send`` gets what that step left: the future it waits on, its result
    (``StopIteration``) or its exception. Every later call is passed straight to ``coro``.
    """

    __slots__ = ("_coro", "_state", "_value")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self._state = _FORWARD
        self._value: Any = None

    def first_step(self) -> None:
        try:
            self._value = self._coro.send(None)
            self._state = _YIELDED
        except StopIteration as stop:
            self._value, self._state = stop.value, _RETURNED
        except (Exception, asyncio.CancelledError) as exc:
            self._value, self._state = exc, _RAISED
        # KeyboardInterrupt and SystemExit propagate, as they do from a task's step

    def send(self, value: Any) -> Any:
        state = self._state
        if state == _FORWARD:
            return self._coro.send(value)
        left, self._value, self._state = self._value, None, _FORWARD
        if state == _YIELDED:
            return left
        if state == _RETURNED:
            raise StopIteration(left)
        raise left

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._value, self._state = None, _FORWARD  # e.g. cancelled before its first turn
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        raise TypeError("a started task's coroutine is driven by its task, not awaited")

    def __repr__(self) -> str:
        return f"<started {self._coro!r}>"


__all__ = ["resolve_now", "start_task"]
