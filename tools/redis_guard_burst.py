"""How the Redis guard times calls made in bursts by requests that hold the loop between awaits.

    python -m tools.redis_guard_burst redis://127.0.0.1:6379/0 --requests 32 --work-ms 0.1 \\
        [--bursts 10] [--timeout-ms 5] [--slow-ms 2]

Each burst starts `--requests` tasks at once; each makes one guarded PING (as admission's take
does) and then holds the loop `--work-ms`, as a request's own Python does before its next await.
Prints the calls' wall time and free time (`edge.free_time`) at p50/p99/max, the calls refused,
and the breaker's trips, with the deadline and slow mark of the guard's settings.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from edge.admission.redis_guard import RedisGuard, RedisUnavailable
from edge.admission.settings import RedisSettings
from edge.free_time import FreeClock
from transport.loop import LOOPS
from transport.loop import run as run_on_loop


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] * 1000 if ordered else float("nan")


async def measure(args: argparse.Namespace) -> str:
    settings = RedisSettings(url=args.url, timeout_ms=args.timeout_ms, slow_ms=args.slow_ms)
    guard = RedisGuard(settings)
    walls: list[float] = []
    frees: list[float] = []
    refused = 0

    async def request() -> None:
        nonlocal refused
        start, clock = time.perf_counter(), FreeClock()
        try:
            await guard.run(guard.client.ping)
        except RedisUnavailable:
            refused += 1
        walls.append(time.perf_counter() - start)
        frees.append(clock.free())
        end = time.perf_counter() + args.work_ms / 1000
        while time.perf_counter() < end:
            pass

    try:
        await guard.client.ping()  # connect outside the measured bursts
        for _ in range(args.bursts):
            await asyncio.gather(*(request() for _ in range(args.requests)))
            await asyncio.sleep(args.gap_s)
    finally:
        await guard.aclose()
    return (
        f"{args.requests} requests x {args.work_ms} ms, {args.bursts} bursts: "
        f"wall p50 {_quantile(walls, 0.5):.2f} p99 {_quantile(walls, 0.99):.2f} "
        f"max {_quantile(walls, 1):.2f} ms; free p50 {_quantile(frees, 0.5):.2f} "
        f"p99 {_quantile(frees, 0.99):.2f} max {_quantile(frees, 1):.2f} ms; "
        f"refused {refused}, trips {guard.trips} "
        f"(timeout_ms {args.timeout_ms}, slow_ms {args.slow_ms})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url", help="redis://HOST:PORT/DB")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--work-ms", type=float, default=0.1)
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--gap-s", type=float, default=0.3, help="pause between bursts")
    parser.add_argument("--timeout-ms", type=float, default=5.0)
    parser.add_argument("--slow-ms", type=float, default=2.0)
    parser.add_argument("--loop", choices=LOOPS, default="auto")
    args = parser.parse_args()
    print(run_on_loop(measure(args), args.loop))


if __name__ == "__main__":
    main()
