"""`transport.read_delay`: how long a byte waits on a socket before the loop reads it."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.transport.conftest import ServeProcess
from transport.loop import run
from transport.read_delay import ReadDelayProbe

LOOPS = ["asyncio", "uvloop"]


class Samples:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_busy_loop_shows_as_a_long_wait(loop_name: str) -> None:
    if loop_name == "uvloop":
        pytest.importorskip("uvloop")
    samples = Samples()

    async def main() -> None:
        probe = ReadDelayProbe(samples, interval=0.01)
        probe.start()
        try:
            await asyncio.sleep(0.3)  # idle: the loop reads at once
            idle = len(samples.values)
            # a callback that holds the loop, as a burst of requests does; long enough that a
            # byte is sent early in it even when the probe's thread is scheduled late
            asyncio.get_running_loop().call_soon(time.sleep, 0.6)
            await asyncio.sleep(0.8)  # the loop polls again before this ends
        finally:
            probe.stop()
            probe.stop()  # idempotent
        assert idle >= 5
        assert sorted(samples.values[:idle])[idle // 2] < 0.1
        # the bytes sent while the loop was held waited until it polled again
        assert max(samples.values[idle:]) >= 0.3
        assert probe.samples == len(samples.values)

    run(main(), loop_name)


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval must be > 0"):
        ReadDelayProbe(Samples(), interval=0)


def test_serve_exports_the_read_delay(serve_process) -> None:
    server: ServeProcess = serve_process("--demo")
    server.wait_metric("quicedge_loop_read_delay_seconds_count", 3)
    assert server.stop() == 0
