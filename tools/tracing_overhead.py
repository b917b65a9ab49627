"""What tracing costs the edge: per-request time with tracing off and on, and the span work alone.

Runs the proxy app in-process (ASGI calls, no client socket) in front of one in-process stand-in
(`--profile instant`, so the backend adds almost nothing) and sends the same streamed request
through an app built without a tracer and one with the OpenTelemetry SDK (batch processor, an
exporter that drops spans). The two are interleaved round by round so machine noise hits both.

    python -m tools.tracing_overhead [--requests 2000] [--rounds 10] [--tokens 16]

Prints a report; it asserts nothing (speed belongs in reports, not in tests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

from backends.sim import SimConfig, SimServer
from bench.summary import nearest_rank
from edge.config import ProxyConfig
from edge.tracing import RequestTrace
from edge.wiring import Wiring, build


class _DropExporter(SpanExporter):
    """Exports nowhere: measures span creation and processing, not an exporter's I/O."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def _one(app: Any, body: bytes) -> float:
    """One streamed request through the ASGI app; returns its wall time in seconds."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "http_version": "1.1",
        "headers": [(b"content-type", b"application/json")],
        "extensions": {"transport": "h1", "early_data": False, "handshake_wait_s": 0.0},
    }
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    never = asyncio.get_running_loop().create_future()

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await never
        raise AssertionError("unreachable")

    status = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    start = time.perf_counter()
    await app(scope, receive, send)
    elapsed = time.perf_counter() - start
    never.cancel()
    if status != 200:
        raise RuntimeError(f"request failed with {status}")
    return elapsed


def _micro(tracer: Any, n: int) -> tuple[float, float]:
    """(µs per request for the off-path check, µs per traced request's spans alone)."""
    off = None
    t = time.perf_counter()
    for _ in range(n):
        if off is not None:  # what the app does per request when tracing is off
            pass
    off_us = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n):
        now = time.perf_counter()
        trace = RequestTrace(tracer, start=now, traceparent=None, tracestate=None,
                             attributes={"quicedge.transport": "h1"})  # fmt: skip
        trace.upstream_context()
        for name in ("parse", "admit", "route", "upstream_connect", "upstream_first_byte",
                     "first_byte_to_client", "stream_end"):  # fmt: skip
            trace.stage(name, now, now)
        trace.set("quicedge.backend", "b1")
        trace.end(now)
    on_us = (time.perf_counter() - t) / n * 1e6
    return off_us, on_us


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in 0..1."""
    found = nearest_rank(values, q * 100)
    if found is None:
        raise ValueError("no values")
    return found


async def _run(args: argparse.Namespace) -> int:
    sim = SimServer(SimConfig(name="b1", port=0, profile="instant", enable_cache_report=True))
    await sim.start()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_DropExporter()))
    tracer = provider.get_tracer("bench")
    config = ProxyConfig(backends=[sim.url], policy="round_robin", pool_warm_connections=4)
    wirings: dict[str, Wiring] = {
        "off": await build(config, registry=CollectorRegistry()),
        "on": await build(config, registry=CollectorRegistry(), tracer=tracer),
    }
    for wiring in wirings.values():
        await wiring.start()
    body = json.dumps({"prompt": "measure the edge", "max_tokens": args.tokens, "stream": True,
                       "ignore_eos": True}).encode()  # fmt: skip
    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, float] = {"off": 0.0, "on": 0.0}
    try:
        for name in wirings:  # warm-up
            for _ in range(50):
                await _one(wirings[name].app, body)
        per_round = max(1, args.requests // args.rounds)
        for _ in range(args.rounds):
            for name, wiring in wirings.items():
                c0 = time.process_time()
                for _ in range(per_round):
                    times[name].append(await _one(wiring.app, body))
                cpu[name] += time.process_time() - c0
    finally:
        for wiring in wirings.values():
            await wiring.aclose()
        provider.shutdown()
        await sim.stop()
    off_check_us, spans_us = _micro(tracer, 20_000)
    n = len(times["off"])
    print("quicedge tracing overhead (in-process ASGI, one instant stand-in, "
          f"{n} streamed requests of {args.tokens} tokens per mode, interleaved)")  # fmt: skip
    print(f"{'tracing':<8} {'mean µs':>9} {'p50 µs':>9} {'p99 µs':>9} {'CPU µs/req':>11}")
    for name in ("off", "on"):
        values = times[name]
        print(
            f"{name:<8} {statistics.fmean(values) * 1e6:>9.1f} {_pct(values, 0.5) * 1e6:>9.1f} "
            f"{_pct(values, 0.99) * 1e6:>9.1f} {cpu[name] / len(values) * 1e6:>11.1f}"
        )
    delta = statistics.fmean(times["on"]) - statistics.fmean(times["off"])
    print(f"tracing on adds {delta * 1e6:.1f} µs per request (mean wall time)")
    print(f"span work alone (root + 7 stages, SDK, batch processor): {spans_us:.1f} µs/request")
    print(f"tracing off: one `is not None` check per request: {off_check_us * 1000:.1f} ns")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.tracing_overhead", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000, help="requests per mode")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per streamed answer")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or args.tokens < 1:
        parser.error("--requests, --rounds and --tokens must be >= 1")
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
