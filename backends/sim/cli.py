"""`quicedge sim` / `python -m backends.sim`: run one stand-in server until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable

import zmq

from backends.sim.config import SimConfig
from backends.sim.profiles import PROFILES
from backends.sim.server import SimServer


def _output_len(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        return (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError("expected N or LO:HI") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quicedge sim",
        description="A CPU stand-in for an SGLang server (same HTTP API, radix cache, scheduler).",
    )
    d = SimConfig()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port (default 30000)")
    p.add_argument("--name", default=d.name, help="instance name")
    p.add_argument("--profile", default=d.profile, choices=sorted(PROFILES))
    p.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="multiply every simulated duration (0.01: 100x faster)",
    )
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument(
        "--max-total-tokens", "--kv-tokens", dest="max_total_tokens", type=int, default=None,
        help="KV pool size in tokens",
    )  # fmt: skip
    p.add_argument(
        "--new-token-ratio", type=float, default=None,
        help="share of max_new_tokens reserved at admission (SGLang starts at 0.7); requests "
        "that outgrow the KV pool are then retracted and re-queued (default: reserve all)",
    )  # fmt: skip
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument(
        "--served-model-name", "--model-name", dest="served_model_name", default=None,
        help="the model's name on the OpenAI routes (default: the profile's model path)",
    )  # fmt: skip
    p.add_argument(
        "--model-version", default=d.model_version,
        help="reported as weight_version (default: default)",
    )  # fmt: skip
    p.add_argument(
        "--variant", choices=("none", "text", "long", "flat"), default=d.variant,
        help="change the outputs in a controlled way: another text stream, answers twice as long,"
        " or a mean top-1 probability 0.08 lower (default: none)",
    )  # fmt: skip
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--enable-cache-report", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--natural-output-len",
        type=_output_len,
        default=d.natural_output_len,
        metavar="LO:HI",
        help="answer length range when ignore_eos is off",
    )
    p.add_argument(
        "--startup-delay",
        type=float,
        default=d.startup_delay,
        help="simulated warmup seconds during which /health is 503",
    )
    p.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument(
        "--api-key",
        default=None,
        help="as SGLang: require 'Authorization: Bearer KEY' on every route but /health*, "
        "/metrics and OPTIONS (401 otherwise)",
    )
    p.add_argument(
        "--record-timings",
        type=int,
        default=d.record_timings,
        metavar="N",
        help="for benchmarks: keep the perf_counter() times of the request read and of the first"
        " token's write for the last N generation requests, at GET /debug/timings (0: off)",
    )
    p.add_argument(
        "--kv-events-config", default=None, metavar="JSON",
        help="as SGLang: publish the radix cache's changes as KV-cache events, e.g."
        ' \'{"publisher":"zmq","endpoint":"tcp://*:5557"}\'',
    )  # fmt: skip
    p.add_argument(
        "--guard", action="store_true",
        help="answer /v1/chat/completions as a Llama-Guard-style safety classifier: 'safe', or"
        " 'unsafe\\nS<n>' when the messages match a --guard-unsafe pattern",
    )  # fmt: skip
    p.add_argument(
        "--guard-unsafe", action="append", default=[], metavar="PATTERN",
        help="guard mode: S<n>=REGEX or REGEX; a conversation matching REGEX (case-insensitive)"
        " is unsafe, category S<n> (S1 without one); repeatable, the first match decides",
    )  # fmt: skip
    p.add_argument(
        "--reasoning-tokens", type=int, default=d.reasoning_tokens, metavar="N",
        help="think N tokens before each chat answer, sent as reasoning_content (as SGLang with"
        " --reasoning-parser); 0: none",
    )  # fmt: skip
    p.add_argument(
        "--log-level", type=str.lower, default="warning",
        choices=("debug", "info", "warning", "error", "critical"),
    )  # fmt: skip
    p.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="event loop; auto: uvloop when installed, else asyncio (auto)",
    )
    return p


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The chosen event loop (the stand-in imports nothing of the proxy, so not
    transport.loop). uvloop keeps the stand-in's own per-request cost low, which matters
    when it stands in for a GPU server that answers in microseconds (profile "instant")."""
    if name != "asyncio":
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise ValueError("--loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def config_from(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        name=args.name,
        host=args.host,
        port=args.port,
        profile=args.profile,
        time_scale=args.time_scale,
        max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
        new_token_ratio=args.new_token_ratio,
        page_size=args.page_size,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_metrics=args.enable_metrics,
        enable_cache_report=args.enable_cache_report,
        seed=args.seed,
        served_model_name=args.served_model_name,
        model_version=args.model_version,
        variant=args.variant,
        context_length=args.context_length,
        disable_radix_cache=args.disable_radix_cache,
        natural_output_len=args.natural_output_len,
        startup_delay=args.startup_delay,
        timeout_keep_alive=args.timeout_keep_alive,
        max_body_bytes=args.max_body_bytes,
        record_timings=args.record_timings,
        api_key=args.api_key,
        guard=args.guard,
        guard_unsafe=tuple(args.guard_unsafe),
        reasoning_tokens=args.reasoning_tokens,
        kv_events_config=args.kv_events_config,
    )


async def serve(config: SimConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with SimServer(config) as server:
        # One line on stdout once listening: scripts and tests wait for it.
        print(f"ready {server.url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        config = config_from(args)
        factory = _loop_factory(args.loop)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(config))
    except OSError as exc:
        print(f"quicedge sim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except zmq.ZMQError as exc:  # the KV-event publisher's endpoint: taken, or not one
        print(f"quicedge sim: --kv-events-config: {exc}", file=sys.stderr)
        return 1
    return 0
