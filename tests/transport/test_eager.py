"""`transport.eager`: a task's first step in the caller's callback; a wake inside a read."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from transport.eager import resolve_now, start_task
from transport.loop import run

LOOPS = ["asyncio", "uvloop"]
_var: contextvars.ContextVar[str] = contextvars.ContextVar("_var", default="outside")


def _in_callback(fn: Callable[[], Any]) -> Coroutine[Any, Any, Any]:
    """Run ``fn`` from a plain loop callback (as a protocol's data_received runs) and return
    what it returned."""

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def callback() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to the test
                done.set_exception(exc)

        loop.call_soon(callback)
        return await done

    return main()


@pytest.fixture(params=LOOPS)
def loop_name(request: pytest.FixtureRequest) -> str:
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    return str(request.param)


def test_first_step_runs_before_start_task_returns(loop_name: str) -> None:
    steps: list[str] = []

    async def job(gate: asyncio.Future[int]) -> int:
        steps.append("first")
        assert asyncio.current_task() is not None  # the task is current during its first step
        _var.set("inside")
        value = await gate
        steps.append(f"resumed {_var.get()}")
        return value * 2

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[int] = loop.create_future()

        def start() -> asyncio.Task[int]:
            task = start_task(loop, job(gate))
            steps.append(f"returned {_var.get()}")
            return task

        task = await _in_callback(start)
        assert steps == ["first", "returned outside"]  # its context is its own
        gate.set_result(21)
        assert await task == 42
        assert steps[-1] == "resumed inside"

    run(main(), loop_name)


def test_a_first_step_that_finishes_or_raises(loop_name: str) -> None:
    async def quick() -> str:
        return "done"

    async def broken() -> None:
        raise ValueError("bad request")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert await await_in(loop, quick) == "done"
        with pytest.raises(ValueError, match="bad request"):
            await await_in(loop, broken)

    async def await_in(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> Any:
        task = await _in_callback(lambda: start_task(loop, fn()))
        return await task

    run(main(), loop_name)


@pytest.mark.parametrize("when", ["before its first turn", "while it waits"])
def test_cancelling_reaches_the_coroutine(loop_name: str, when: str) -> None:
    seen: list[str] = []

    async def job(gate: asyncio.Future[None]) -> None:
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[None] = loop.create_future()
        task = await _in_callback(lambda: start_task(loop, job(gate)))
        if when == "while it waits":
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled"]

    run(main(), loop_name)


def test_started_from_a_task_the_caller_stays_current(loop_name: str) -> None:
    async def job() -> asyncio.Task[Any] | None:
        return asyncio.current_task()

    async def main() -> None:
        me = asyncio.current_task()
        task = start_task(asyncio.get_running_loop(), job())
        assert asyncio.current_task() is me
        assert await task is task

    run(main(), loop_name)


def test_resolve_now_steps_the_waiting_task_in_place(loop_name: str) -> None:
    steps: list[str] = []

    async def waiter(fut: asyncio.Future[None]) -> None:
        await fut
        steps.append("woke")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        task = loop.create_task(waiter(fut))
        await asyncio.sleep(0)  # the task now waits on fut

        def read_callback() -> None:
            resolve_now(loop, fut)
            steps.append("callback returned")

        await _in_callback(read_callback)
        assert steps == ["woke", "callback returned"]
        await task

    run(main(), loop_name)


def test_resolve_now_from_a_task_wakes_on_the_next_turn(loop_name: str) -> None:
    steps: list[str] = []

    async def waiter(fut: asyncio.Future[None]) -> None:
        await fut
        steps.append("woke")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        task = loop.create_task(waiter(fut))
        await asyncio.sleep(0)
        resolve_now(loop, fut)  # a task can't step inside another: an ordinary wake
        steps.append("resolved")
        await task
        assert steps == ["resolved", "woke"]
        unwatched: asyncio.Future[None] = loop.create_future()
        resolve_now(loop, unwatched)
        assert unwatched.done()

    run(main(), loop_name)
