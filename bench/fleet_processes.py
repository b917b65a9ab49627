"""Scale-out with each edge instance in a process of its own (`bench.fleet --processes`).

`bench.fleet`'s scale-out runs its instances in one process, so that they share one CPU alike in
every run; separate edge processes, as `serve` runs them on several machines, each have their
own event loop, and a Redis call of one is not delayed by another's work. Here the stand-ins stay
in the benchmark's process and each instance is a child (`python -m bench.fleet_processes`): it
builds the same routing instance (`bench.fleet.make_instance`), regenerates the seeded workload,
runs the sessions dealt to it (every n-th, as the in-process runs deal them), and prints its
requests as one JSON line. All children start their clocks at one wall-clock moment, sent once
every child is ready, so their arrivals line up as in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from bench.routing import WORKLOADS, RequestResult, Run, make_workload
from edge.routing.fleet_view import FleetViewConfig

READY = b"ready\n"
START_TIMEOUT_S = 60.0
"""Longest a child may take to import, start its instance and say it is ready."""
FINISH_SLACK_S = 120.0
"""Longest a child may take past its run's own length to finish and report."""


@dataclass(slots=True)
class ChildPlan:
    """What one child runs: its share of a seeded workload against the stand-ins."""

    urls: list[str]
    workload: str
    rate: float
    duration: float
    seed: int
    index: int
    of: int
    time_scale: float
    view: FleetViewConfig | None

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "bench.fleet_processes", "--urls", ",".join(self.urls),
                "--workload", self.workload, "--rate", repr(self.rate),
                "--duration", repr(self.duration), "--seed", str(self.seed),
                "--index", str(self.index), "--of", str(self.of),
                "--time-scale", repr(self.time_scale)]  # fmt: skip
        if self.view is not None:
            assert self.view.redis is not None
            args += ["--redis", self.view.redis, "--key", self.view.key,
                     "--view-interval", repr(self.view.interval),
                     "--load-interval", repr(self.view.load_interval)]  # fmt: skip
        return args


async def run_children(plans: Sequence[ChildPlan]) -> tuple[list[RequestResult], float]:
    """Start one child per plan, start them together, and gather (their requests, the largest
    event-loop stall any of them saw, s)."""
    procs = [
        await asyncio.create_subprocess_exec(
            *p.argv(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        for p in plans
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            async with asyncio.timeout(START_TIMEOUT_S):
                line = await proc.stdout.readline()
            if line != READY:
                raise RuntimeError(f"a scale-out child did not start (said {line[:200]!r})")
        start_at = time.time() + 0.2
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(f"{start_at!r}\n".encode())
            await proc.stdin.drain()
        results: list[RequestResult] = []
        lag = 0.0
        finish = max(p.duration * p.time_scale for p in plans) + FINISH_SLACK_S
        deadline = asyncio.get_running_loop().time() + finish
        for proc in procs:
            assert proc.stdout is not None
            async with asyncio.timeout_at(deadline):  # a hung child fails the run, boundedly
                out, _ = await proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"a scale-out child exited with {proc.returncode}")
            got = json.loads(out.splitlines()[-1])
            results += [RequestResult(**r) for r in got["results"]]
            lag = max(lag, float(got["max_lag"]))
        return results, lag
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def child(args: argparse.Namespace) -> None:
    from bench.fleet import make_instance  # the parent imports this module from bench.fleet

    plans = make_workload(args.workload, args.rate, args.duration, args.seed)
    mine = [p for k, p in enumerate(plans) if k % args.of == args.index]
    view = None
    if args.redis:
        view = FleetViewConfig(
            enabled=True, redis=args.redis, key=args.key, interval=args.view_interval,
            load_interval=args.load_interval,
        )  # fmt: skip
    run = Run(spec=WORKLOADS[args.workload], policy="ttft", plans=mine, rate=args.rate,
              time_scale=args.time_scale, warmup=args.duration * 0.2,
              duration=args.duration)  # fmt: skip
    instance = await make_instance(args.urls.split(","), view=view)
    loop = asyncio.get_running_loop()
    try:
        sys.stdout.buffer.write(READY)
        sys.stdout.flush()
        start_at = float(await loop.run_in_executor(None, sys.stdin.readline))
        t0 = time.perf_counter() + (start_at - time.time())
        sampler = loop.create_task(run.sample_busy([]))  # its loop's stalls; no stand-ins here
        try:
            await asyncio.gather(
                *(
                    run.session(p, t0, instance.registry, instance.pool, instance.policy)
                    for p in mine
                )  # fmt: skip
            )
        finally:
            sampler.cancel()
    finally:
        await instance.aclose()
    payload = {"results": [asdict(r) for r in run.results], "max_lag": run.max_lag}
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_processes", description=__doc__)
    parser.add_argument("--urls", required=True)
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--of", type=int, required=True)
    parser.add_argument("--time-scale", type=float, required=True)
    parser.add_argument("--redis", default=None)
    parser.add_argument("--key", default="quicedge-bench:fv")
    parser.add_argument("--view-interval", type=float, default=0.1)
    parser.add_argument("--load-interval", type=float, default=0.01)
    asyncio.run(child(parser.parse_args(argv)))
    return 0


__all__ = ["ChildPlan", "run_children"]

if __name__ == "__main__":
    raise SystemExit(main())
