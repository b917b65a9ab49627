"""The overload soak: three times the stand-ins' capacity through the edge, for minutes.

It starts two stand-ins (`python -m backends.sim`, H100 profile, a few running requests each) and
one edge (`quicedge serve --http`) as child processes, as `bench.admission` does, and:

1. **calibrates**: closed-loop clients (four per running slot) for `--calibrate` seconds through
   an edge whose throttle keeps each stand-in at its running slots and no more (a stand-in with
   a waiting queue decodes slower); the completions per second are the stand-ins' capacity (or
   give `--capacity`);
2. **soaks**: fresh stand-ins and an edge with admission on (a tenant's requests bucket at
   `--bucket-times` the capacity, the queue-depth throttle and a bounded admission queue), driven
   open loop at `--times` (3) the capacity for `--duration` (300) seconds. Every request is a
   streamed `/v1/completions` on a connection of its own, from one of 64 loopback addresses (so
   that the per-address connection cap sees many clients, as it would in production), and has a
   deadline (`--deadline`, 30 s) after which the client gives up and counts it as missed;
3. **watches** the edge: its RSS and open file descriptors every `--sample-every` seconds before,
   during and for `--after` seconds after the load.

Each request ends as `2xx` (a whole stream, to `[DONE]`), `429`, `503`, `other` (another status,
a stream cut short, a connection reset) or `missed_deadline` (no end within the deadline: a hang).
The report (`bench-out/soak/report.{json,md}`) has the counts, the time each kind took (p50, p99,
max), TTFT of the 2xx, the edge's samples and its refusal counters, and how late this process
sent requests against the schedule (its own lag, which would otherwise pass for the edge's).

    python -m bench.soak [--duration 300] [--times 3] [--deadline 30]

A benchmark, not a test: it reports numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import resource
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.admission import Streamed, completion_body, fleet, percentile, stream_completion

OUTCOMES = ("2xx", "429", "503", "other", "missed_deadline")
SOURCES = [f"127.0.0.{i}" for i in range(2, 66)]
"""Client addresses: loopback, so every one reaches the edge on 127.0.0.1."""


@dataclass(slots=True)
class Ended:
    outcome: str
    seconds: float
    ttft: float | None
    status: int
    code: str | None = None
    """The error's `code` (OpenAI's shape) of an answer that was not 200."""


async def request(
    port: int, body: bytes, key: str, *, deadline: float, source: str | None = None
) -> Ended:
    """One streamed completion on its own connection, given up after `deadline` seconds."""
    t0 = time.perf_counter()
    got = Streamed()
    try:
        async with asyncio.timeout(deadline):
            await stream_completion(port, body, key, got, source=source)
    except TimeoutError:
        return Ended("missed_deadline", time.perf_counter() - t0, got.ttft, got.status)
    except (OSError, asyncio.IncompleteReadError, ValueError):
        pass
    status, whole, error, ttft = got.status, got.whole, got.error, got.ttft
    seconds = time.perf_counter() - t0
    if 200 <= status < 300:
        outcome = "2xx" if whole else "other"
    elif status in (429, 503):
        outcome = str(status)
    else:
        outcome = "other"
    return Ended(outcome, seconds, ttft, status, _code(error) if status != 200 else None)


def _code(body: bytes) -> str | None:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


async def calibrate(
    port: int, key: str, clients: int, seconds: float, shape: dict[str, int]
) -> float:
    """Completions per second of closed-loop clients that keep the stand-ins full."""
    stop = time.perf_counter() + seconds
    done: list[float] = []

    async def client(i: int) -> None:
        rng = random.Random(i)
        while time.perf_counter() < stop:
            ended = await request(port, completion_body(rng, **shape), key, deadline=120.0)
            if ended.outcome == "2xx":
                done.append(time.perf_counter())

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return len(done) / (time.perf_counter() - start)


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (a `--workers` edge forks its workers)."""
    found, pending = [], [pid]
    while pending:
        p = pending.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                pending.extend(int(c) for c in task.read_text().split())
            except OSError:
                continue
    return found


def sample(pid: int) -> dict[str, float]:
    """RSS (MiB) and open file descriptors of the edge's processes."""
    rss_kib, fds = 0, 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kib += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue
    return {"rss_mib": round(rss_kib / 1024, 1), "fds": fds}


async def watch(pid: int, every: float, into: list[dict[str, Any]], phase: list[str]) -> None:
    t0 = time.perf_counter()
    while True:
        into.append({"t": round(time.perf_counter() - t0, 1), "phase": phase[0], **sample(pid)})
        await asyncio.sleep(every)


def _stats(values: list[float]) -> dict[str, float | None]:
    ms = 1000.0
    if not values:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "p50_ms": round(statistics.median(values) * ms, 1),
        "p99_ms": round((percentile(values, 0.99) or 0.0) * ms, 1),
        "max_ms": round(max(values) * ms, 1),
    }


def _metrics(port: int) -> dict[str, float]:
    """The edge's refusal counters, summed over their labels but the reason."""
    import httpx

    wanted = (
        "quicedge_admission_rejections_total",
        "quicedge_connections_refused_total",
        "quicedge_requests_total",
    )
    found: dict[str, float] = {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(wanted):
            name, value = line.rsplit(" ", 1)
            found[name] = found.get(name, 0.0) + float(value)
    return found


def _toml(key: str, bucket_rps: float | None, args: argparse.Namespace) -> str:
    """One tenant, the queue-depth throttle and the admission queue; a requests bucket unless
    `bucket_rps` is None."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    toml = "[admission.anonymous]\nenabled = false\n"
    toml += f'[[tenants]]\nname = "load"\ntier = "silver"\napi_key_sha256 = ["{digest}"]\n'
    if bucket_rps is not None:
        toml += f"requests_per_second = {bucket_rps:.2f}\nburst = {max(1, int(bucket_rps))}\n"
    return toml + (
        f'[admission.throttle]\nmax_queue_depth = {args.max_depth}\ndepth = "in_flight"\n'
        f"queue_size = {args.queue_size}\nqueue_timeout_s = {args.queue_timeout}\n"
    )


async def soak(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    key = "sk-load"
    shape = {"words": args.words, "max_tokens": args.max_tokens}
    sim_args = ["--max-running-requests", str(args.running)]
    capacity = args.capacity
    if capacity is None:
        with fleet(out / "calibrate", _toml(key, None, args), sims=2, sim_args=sim_args) as f:
            capacity = await calibrate(
                f.edge_port, key, 4 * 2 * args.running, args.calibrate, shape
            )
    rate = args.times * capacity
    bucket = args.bucket_times * capacity
    samples: list[dict[str, Any]] = []
    phase = ["before"]
    ended: list[Ended] = []
    lag: list[float] = []
    with fleet(out / "soak", _toml(key, bucket, args), sims=2, sim_args=sim_args) as f:
        pid = f.procs[-1].pid
        watcher = asyncio.ensure_future(watch(pid, args.sample_every, samples, phase))
        await asyncio.sleep(args.before)
        phase[0] = "load"
        rng = random.Random(7)
        start = time.perf_counter()
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int) -> None:
            body = completion_body(rng, **shape)
            source = SOURCES[i % len(SOURCES)]
            ended.append(await request(f.edge_port, body, key, deadline=args.deadline,
                                       source=source))  # fmt: skip

        for i in range(int(rate * args.duration)):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lag.append(max(0.0, time.perf_counter() - due))
            task = asyncio.ensure_future(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        load_seconds = time.perf_counter() - start
        phase[0] = "after"
        await asyncio.sleep(args.after)
        watcher.cancel()
        counters = _metrics(f.admin_port)
    counts = {o: sum(1 for e in ended if e.outcome == o) for o in OUTCOMES}
    statuses: dict[str, int] = {}
    for e in ended:
        name = f"{e.status} {e.code}" if e.code else str(e.status)
        statuses[name] = statuses.get(name, 0) + 1
    by_phase = {p: [s for s in samples if s["phase"] == p] for p in ("before", "load", "after")}
    half = by_phase["load"][len(by_phase["load"]) // 2 :]
    slope = None
    if len(half) >= 2:
        dt = (half[-1]["t"] - half[0]["t"]) / 60.0
        slope = round((half[-1]["rss_mib"] - half[0]["rss_mib"]) / dt, 2) if dt else None
    return {
        "capacity_rps": round(capacity, 2),
        "rate_rps": round(rate, 2),
        "bucket_rps": round(bucket, 2),
        "duration_s": args.duration,
        "load_s": round(load_seconds, 1),
        "deadline_s": args.deadline,
        "requests": len(ended),
        "outcomes": counts,
        "statuses": dict(sorted(statuses.items())),
        "seconds": {o: _stats([e.seconds for e in ended if e.outcome == o]) for o in OUTCOMES},
        "ttft_2xx": _stats([e.ttft for e in ended if e.outcome == "2xx" and e.ttft is not None]),
        "send_lag": _stats(lag),
        "edge": {
            "before": by_phase["before"][-1] if by_phase["before"] else None,
            "load_peak": {
                "rss_mib": max((s["rss_mib"] for s in by_phase["load"]), default=None),
                "fds": max((s["fds"] for s in by_phase["load"]), default=None),
            },
            "load_end": by_phase["load"][-1] if by_phase["load"] else None,
            "after_first": by_phase["after"][0] if by_phase["after"] else None,
            "after_last": by_phase["after"][-1] if by_phase["after"] else None,
            "rss_slope_second_half_mib_per_min": slope,
        },
        "edge_counters": counters,
        "samples": samples,
        "settings": {
            "running_per_stand_in": args.running,
            "max_depth": args.max_depth,
            "queue_size": args.queue_size,
            "queue_timeout_s": args.queue_timeout,
            "words": args.words,
            "max_tokens": args.max_tokens,
        },  # fmt: skip
    }


def markdown(report: dict[str, Any]) -> str:
    r = report["soak"]
    e = r["edge"]
    lines = [
        "# Overload soak", "", f"Command: `{report['command']}`", "",
        f"Capacity {r['capacity_rps']} completions/s (two stand-ins); offered {r['rate_rps']} "
        f"req/s for {r['duration_s']} s (the last request ended {r['load_s']} s after the "
        f"first), deadline {r['deadline_s']} s, tenant bucket {r['bucket_rps']} req/s.", "",
        "| outcome | requests | p50 ms | p99 ms | max ms |", "| --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for outcome in OUTCOMES:
        s = r["seconds"][outcome]
        lines.append(f"| {outcome} | {r['outcomes'][outcome]} | {s['p50_ms']} | {s['p99_ms']} | "
                     f"{s['max_ms']} |")  # fmt: skip
    t, lag = r["ttft_2xx"], r["send_lag"]
    lines += [
        "", f"Statuses: {r['statuses']}. TTFT of the 2xx: p50 {t['p50_ms']} ms, p99 "
        f"{t['p99_ms']} ms. This process sent requests late by p99 {lag['p99_ms']} ms, max "
        f"{lag['max_ms']} ms.", "",
        "| edge | RSS MiB | open fds |", "| --- | --- | --- |",
    ]  # fmt: skip
    for name in ("before", "load_peak", "load_end", "after_first", "after_last"):
        s = e[name] or {}
        lines.append(f"| {name} | {s.get('rss_mib')} | {s.get('fds')} |")
    lines += [
        "", f"RSS slope over the load's second half: {e['rss_slope_second_half_mib_per_min']} "
        "MiB/min.", "", f"Edge counters: {r['edge_counters']}", "",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (300)")
    p.add_argument("--times", type=float, default=3.0, help="offered load / capacity (3)")
    p.add_argument("--deadline", type=float, default=30.0, help="per request, s (30)")
    p.add_argument("--capacity", type=float, default=None,
                   help="completions/s of the two stand-ins; default: measured first")  # fmt: skip
    p.add_argument("--calibrate", type=float, default=20.0, help="calibration seconds (20)")
    p.add_argument("--bucket-times", type=float, default=2.0,
                   help="the tenant's requests bucket / capacity (2)")  # fmt: skip
    p.add_argument("--running", type=int, default=4,
                   help="--max-running-requests of each stand-in (4)")  # fmt: skip
    p.add_argument("--max-depth", type=int, default=None,
                   help="throttle in-flight depth per stand-in; default --running, so that the "
                   "wait is in the edge's queue and not the stand-in's")  # fmt: skip
    p.add_argument("--queue-size", type=int, default=128, help="admission queue bound (128)")
    p.add_argument("--queue-timeout", type=float, default=5.0, help="queue deadline, s (5)")
    p.add_argument("--words", type=int, default=40, help="prompt words (40)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens out (64)")
    p.add_argument("--before", type=float, default=10.0, help="idle seconds sampled first (10)")
    p.add_argument("--after", type=float, default=30.0, help="idle seconds sampled after (30)")
    p.add_argument("--sample-every", type=float, default=5.0, help="sampling period, s (5)")
    p.add_argument("--out", default="bench-out/soak")
    args = p.parse_args(argv)
    if args.max_depth is None:
        args.max_depth = args.running
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per request in flight
    del soft
    report = {
        "command": shlex.join(
            ["python", "-m", "bench.soak", *(sys.argv[1:] if argv is None else argv)]
        ),
        "soak": asyncio.run(soak(args, out)),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
