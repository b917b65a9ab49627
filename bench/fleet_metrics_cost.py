"""What one metric update costs: the edge's lock-free metrics against prometheus-client's own,
in one process and in multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, values in mmap'd files).

A request of the edge makes about a dozen updates (counters and histograms with labels), so the
figure that matters is the cost of `labels(...).inc()` and `labels(...).observe(v)`. Each mode
runs in a fresh interpreter, because prometheus-client picks its value class at import, from the
environment; the modes run round after round, interleaved, so machine noise hits them alike.
Also timed: one `/metrics` merge of N workers' expositions (`edge.fleet_metrics`), scrape-time
work that no request waits on.

    python -m bench.fleet_metrics_cost [--updates 200000] [--rounds 5] [--workers 4]

Writes bench-out/fleet_metrics_cost.json and prints a table; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("light", "client", "multiprocess")
LABELS = ("h3", "false", "hit", "127.0.0.1:30000")
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
           0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)  # fmt: skip


def _time_updates(mode: str, updates: int) -> dict[str, float]:
    """Nanoseconds per counter inc and per histogram observe, labels looked up each time."""
    from prometheus_client import CollectorRegistry, Counter, Histogram

    from edge.light_metrics import LightCounter, LightHistogram

    registry = CollectorRegistry()
    counter: Any
    histogram: Any
    if mode == "light":
        counter = LightCounter("c", "c", ["route", "status"], registry=registry)
        histogram = LightHistogram("h", "h", list("abcd"), buckets=BUCKETS, registry=registry)
    else:
        counter = Counter("c", "c", ["route", "status"], registry=registry)
        histogram = Histogram("h", "h", list("abcd"), buckets=BUCKETS, registry=registry)
    values = [0.001 * (i % 97) for i in range(1000)]
    out: dict[str, float] = {}
    start = time.perf_counter_ns()
    for _ in range(updates):
        counter.labels("/v1/chat/completions", "200").inc()
    out["counter_inc_ns"] = (time.perf_counter_ns() - start) / updates
    start = time.perf_counter_ns()
    for i in range(updates):
        histogram.labels(*LABELS).observe(values[i % 1000])
    out["histogram_observe_ns"] = (time.perf_counter_ns() - start) / updates
    return out


def _one_round(mode: str, updates: int) -> dict[str, float]:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as directory:
        if mode == "multiprocess":
            env["PROMETHEUS_MULTIPROC_DIR"] = directory
        else:
            env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        code = (
            "import json, sys; from bench.fleet_metrics_cost import _time_updates; "
            f"print(json.dumps(_time_updates({mode!r}, {updates})))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def _merge_ms(workers: int) -> float:
    """Milliseconds to merge `workers` expositions of a worker that served a varied load."""
    from prometheus_client import CollectorRegistry, generate_latest

    from edge.fleet_metrics import merge_expositions
    from edge.telemetry import Metrics

    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for backend in range(8):
        for transport in ("h3", "h2", "h1"):
            for cache in ("hit", "partial", "miss"):
                child = metrics.ttft.labels(
                    transport, "false", cache, f"10.0.0.{backend}:30000", "default"
                )
                child.observe(0.05)
        metrics.upstream_ttft.labels(f"10.0.0.{backend}:30000").observe(0.04)
        metrics.itl.labels(f"10.0.0.{backend}:30000").observe(0.01)
    text = generate_latest(registry)
    texts: dict[int, bytes | None] = dict.fromkeys(range(workers), text)
    runs = []
    for _ in range(20):
        start = time.perf_counter()
        merge_expositions(texts)
        runs.append((time.perf_counter() - start) * 1000)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_metrics_cost")
    parser.add_argument("--updates", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default="bench-out/fleet_metrics_cost.json")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(_one_round(mode, args.updates))
    report: dict[str, Any] = {"updates": args.updates, "rounds": args.rounds, "modes": {}}
    print(f"{'mode':<14}{'counter inc':>14}{'histogram observe':>20}   (ns, median of rounds)")
    for mode, results in runs.items():
        medians = {k: statistics.median(r[k] for r in results) for k in results[0]}
        report["modes"][mode] = medians
        print(
            f"{mode:<14}{medians['counter_inc_ns']:>14.0f}{medians['histogram_observe_ns']:>20.0f}"
        )
    report["merge_ms"] = {"workers": args.workers, "median_ms": _merge_ms(args.workers)}
    print(f"merge of {args.workers} workers' expositions: {report['merge_ms']['median_ms']:.2f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
