"""Gray-release benchmark: drift detection power, false alarms, and what shadowing costs.

    python -m bench.rollout --out bench-out/rollout [--trials 200] [--requests 400]

Writes OUT/rollout.md and OUT/rollout.json.

1. **Detection**: stable and canary answers are drawn from the stand-in's logprob model
   (`backends.sim.logprobs`: per-answer confidence uniform in [0.45, 0.95], per-token wobble,
   top-5 alternatives), the canary's confidence lowered by `shift`; the pairs go through the real
   `Ramp` (drift windows, Welch tests, Bonferroni) until it pauses. Reported: pairs until the
   pause (median, p90, max) for a 0.08 shift, per window size.
2. **False alarms**: 10,000 identical pairs per trial through the same ramp, counting every pause
   or hold; and a full ramp 1 → 5 → 25 → 50 → 100 % with identical versions, which must end
   promoted.
3. **Shadow cost**: a real edge (our HTTP/1.1 listener, in this process with the client) in
   front of a stable and a canary stand-in (each its own process, `h100-llama3-8b` timing at
   `--time-scale`), streamed chat requests one after another, TTFT measured at the client:
   shadowing off, shadowing 10 %, and two controls with shadowing off: the canary, or the
   stable stand-in, given the mirrors' load by the benchmark itself; in rounds whose order
   rotates, with paired per-round differences against "off".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import re
import shlex
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from edge.config import ProxyConfig
from edge.models.config import DriftConfig, ModelsConfig, RolloutConfig
from edge.models.drift import Sample
from edge.models.ramp import Ramp
from edge.routing.breakers import BreakerConfig
from edge.wiring import build
from transport.h1_server import H1Listener

TOP_K = 5
_CONTENT = re.compile(rb'"content":"[^"]')
_WEIGHTS = [0.5**i for i in range(TOP_K - 1)]
_TOTAL = sum(_WEIGHTS)


def synthetic(rng: random.Random, *, shift: float = 0.0, tokens: int = 16) -> Sample:
    """One answer's summary drawn from the stand-in's logprob model, confidence - `shift`."""
    c = 0.45 + 0.5 * rng.random() - shift
    top1 = entropy = 0.0
    for _ in range(tokens):
        p1 = min(0.99, max(0.05, c + 0.2 * (rng.random() - 0.5)))
        rest = (1 - p1) * 0.9
        probs = [p1, *(rest * w / _TOTAL for w in _WEIGHTS)]
        total = sum(probs)
        top1 += p1
        entropy -= sum(p / total * math.log(p / total) for p in probs)
    length = rng.randint(64, 512)
    return Sample(length=length, stopped=rng.random() < 0.9, top1=top1 / tokens,
                  entropy=entropy / tokens)  # fmt: skip


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _ramp(window: int, *, steps: list[float] | None = None, step_requests: int = 10**9,
          clock: Callable[[], float] | None = None) -> Ramp:  # fmt: skip
    config = RolloutConfig(
        model="m", stable="v1", canary="v2", steps=steps or [1.0, 5.0, 25.0, 50.0, 100.0],
        step_requests=step_requests, step_seconds=0.0, drift=DriftConfig(window=window),
    )  # fmt: skip
    return Ramp(config, clock=clock or FakeClock())


def pairs_until_pause(rng: random.Random, *, shift: float, window: int, limit: int) -> int | None:
    """Shadow pairs fed to a ramp until it pauses (None: not within `limit`)."""
    ramp = _ramp(window)
    for n in range(1, limit + 1):
        ramp.add_pair(synthetic(rng), synthetic(rng, shift=shift))
        if ramp.rollout.state == "paused":
            return n
    return None


def false_alarms(rng: random.Random, *, pairs: int, window: int) -> int:
    """Pauses and holds raised over `pairs` identical pairs (the ramp is resumed after each)."""
    ramp = _ramp(window)
    alarms = 0
    for _ in range(pairs):
        ramp.add_pair(synthetic(rng), synthetic(rng))
        if ramp.rollout.state in ("paused", "held"):
            alarms += 1
            ramp.promote("bench: resume")
    return alarms


def full_ramp(rng: random.Random, *, window: int, step_requests: int) -> dict[str, Any]:
    """A whole ramp with identical versions: each canary request also yields a shadow pair."""
    ramp = _ramp(window, step_requests=step_requests)
    served = 0
    while ramp.rollout.state == "ramping" and served < 100 * step_requests:
        ramp.add_pair(synthetic(rng), synthetic(rng))
        ramp.observe(canary=True, error=False, ttft_s=0.05)
        served += 1
    return {"state": ramp.rollout.state, "pairs": served,
            "actions": [t.action for t in ramp.history]}  # fmt: skip


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


# -- shadow cost ----------------------------------------------------------------------------


SETTINGS = ("0", "0.1", "busy", "stable-busy")
"""Shadowing off; shadowing 10 %; off with the canary kept as busy by the benchmark itself (the
same share of requests sent to it directly: the control that tells the edge's mirrors apart
from what a busier machine does); off with the *stable* stand-in given that load (what mirrors
cost when each asked the stable version again)."""


def _body(tag: str, i: int) -> dict[str, Any]:
    prompt = f"question {tag}-{i} " + "context " * 40  # unique per round, setting and request
    return {"model": "m", "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip


async def _ttfts(
    url: str, n: int, tag: str, side: Callable[[dict[str, Any]], None] | None = None
) -> tuple[list[float], int]:
    out: list[float] = []
    errors = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for i in range(n):
            body = _body(tag, i)
            t0 = time.perf_counter()
            first = None
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    errors += 1
                    await r.aread()
                    continue
                async for chunk in r.aiter_bytes():
                    if first is None and _CONTENT.search(chunk):
                        first = time.perf_counter() - t0
            if first is not None:
                out.append(first)
            if side is not None:
                side(body)
    return out, errors


class _SideLoad:
    """A control's load on one stand-in: after a request, with probability `fraction`, the
    same request, not streamed and with logprobs, sent there by the benchmark (at most `limit`
    at once, as the shadow's concurrency), never waited for."""

    def __init__(self, canary_url: str, fraction: float, seed: int, limit: int = 4) -> None:
        self.http = httpx.AsyncClient(base_url=canary_url, timeout=30)
        self.fraction = fraction
        self.rng = random.Random(seed)
        self.limit = limit
        self.tasks: set[asyncio.Task[None]] = set()
        self.sent = 0

    def __call__(self, body: dict[str, Any]) -> None:
        if self.rng.random() >= self.fraction or len(self.tasks) >= self.limit:
            return
        side = {**body, "stream": False, "logprobs": True, "top_logprobs": 5}
        task = asyncio.ensure_future(self._send(side))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(self, body: dict[str, Any]) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post("/v1/chat/completions", json=body)
            self.sent += 1

    async def aclose(self) -> None:
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=30)
        await self.http.aclose()


@contextlib.asynccontextmanager
async def _sim_process(version: str, time_scale: float) -> AsyncIterator[str]:
    """A stand-in in a process of its own (the edge's loop is not the backends'); its URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backends.sim", "--port", "0", "--profile", "h100-llama3-8b",
        "--time-scale", str(time_scale), "--model-name", "m", "--model-version", version,
        "--natural-output-len", "16:32", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if not line.startswith(b"ready "):
            raise RuntimeError(f"the stand-in did not start: {line!r}")
        yield line.split()[1].decode()
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


async def _one_run(
    setting: str, stable_url: str, canary_url: str, requests: int, tag: str, seed: int
) -> dict[str, Any]:
    """One setting's requests through a fresh edge; TTFTs and what reached the canary."""
    proxy = ProxyConfig.from_mapping(
        {"backends": [stable_url, canary_url], "policy": "round_robin"}
    ).validate()
    fraction = 0.1 if setting == "0.1" else 0.0
    # canary share 0 % (steps below any real share): only shadows reach the canary
    rollout = RolloutConfig(model="m", stable="v1", canary="v2", steps=[1e-9], auto=False,
                            shadow_fraction=fraction, shadow_rate=1000.0)  # fmt: skip
    # no breakers: one stall on this loaded machine can open a domain on its TTFT p99, and
    # this measures the mirrors, not what a breaker does with a stall
    wiring = await build(proxy, registry=CollectorRegistry(), breakers=BreakerConfig(enabled=False),
                         models=ModelsConfig(rollouts=[rollout]))  # fmt: skip
    await wiring.start()
    listener = H1Listener(wiring.app, host="127.0.0.1", port=0)
    await listener.start()
    side = None
    if setting in ("busy", "stable-busy"):
        side = _SideLoad(canary_url if setting == "busy" else stable_url, 0.1, seed)
    try:
        ttfts, errors = await _ttfts(listener.url, requests, tag, side)
        shadow = wiring.models.shadows["m"]
        await asyncio.sleep(0)
        if shadow._tasks:
            await asyncio.wait(set(shadow._tasks), timeout=30)
        return {"ttfts": ttfts, "errors": errors, "pairs": shadow.compared,
                "side": side.sent if side is not None else 0}  # fmt: skip
    finally:
        if side is not None:
            await side.aclose()
        await listener.stop()
        await wiring.aclose()


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 3), "max": round(max(values), 3),
            "sd": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0}  # fmt: skip


async def shadow_cost(*, requests: int, rounds: int, time_scale: float) -> dict[str, Any]:
    """`rounds` rounds; in each, every setting once, their order rotated round by round (a
    Latin square: each setting runs first, second and third equally often), prompts new in
    every run. Per setting: pooled p50/p99, each round's, and the paired per-round difference
    against shadowing off (same round, same machine state), with the rounds' spread."""
    ttfts: dict[str, list[float]] = {s: [] for s in SETTINGS}
    per_round: dict[str, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
    counts: dict[str, dict[str, int]] = {s: {"pairs": 0, "side": 0, "errors": 0}
                                         for s in SETTINGS}  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        stable_url = await stack.enter_async_context(_sim_process("v1", time_scale))
        canary_url = await stack.enter_async_context(_sim_process("v2", time_scale))
        await _one_run("0", stable_url, canary_url, 20, "warm", 0)  # warm the stand-ins
        for r in range(rounds):
            k = r % len(SETTINGS)
            for setting in SETTINGS[k:] + SETTINGS[:k]:
                run = await _one_run(setting, stable_url, canary_url, requests,
                                     f"{r}-{setting}", seed=r)  # fmt: skip
                values = run["ttfts"]
                ttfts[setting].extend(values)
                per_round[setting].append(
                    (statistics.median(values) * 1000, _quantile(values, 0.99) * 1000)
                )
                for key in ("pairs", "side", "errors"):
                    counts[setting][key] += run[key]
    out: dict[str, Any] = {}
    base = per_round["0"]
    for setting in SETTINGS:
        values = ttfts[setting]
        rows = per_round[setting]
        d50 = [a[0] - b[0] for a, b in zip(rows, base, strict=True)]
        d99 = [a[1] - b[1] for a, b in zip(rows, base, strict=True)]
        out[setting] = {
            "n": len(values), **counts[setting],
            "p50_ms": round(statistics.median(values) * 1000, 3),
            "p99_ms": round(_quantile(values, 0.99) * 1000, 3),
            "rounds_p50_ms": [round(p50, 3) for p50, _ in rows],
            "rounds_p99_ms": [round(p99, 3) for _, p99 in rows],
            "rounds_p50_spread": _spread([p50 for p50, _ in rows]),
            "rounds_p99_spread": _spread([p99 for _, p99 in rows]),
            "paired_p50_diff_ms": {"mean": round(statistics.mean(d50), 3), **_spread(d50)},
            "paired_p99_diff_ms": {"mean": round(statistics.mean(d99), 3), **_spread(d99)},
        }  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rollout", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-out/rollout"))
    parser.add_argument("--trials", type=int, default=200, help="detection trials per window")
    parser.add_argument("--alarm-trials", type=int, default=5, help="10,000-pair runs")
    parser.add_argument("--requests", type=int, default=200, help="requests per shadow run")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved shadow rounds")
    parser.add_argument("--time-scale", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-detection", action="store_true", help="only the shadow cost")
    args = parser.parse_args(argv)
    logging.getLogger("edge.models.ramp").setLevel(logging.ERROR)  # one line per transition
    rng = random.Random(args.seed)
    command = shlex.join(["python", "-m", "bench.rollout",
                          *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
    report: dict[str, Any] = {"command": command, "detection": {}, "false_alarms": {}}
    for window in () if args.no_detection else (100, 200, 400):
        runs = [pairs_until_pause(rng, shift=0.08, window=window, limit=20 * window)
                for _ in range(args.trials)]  # fmt: skip
        found = [float(r) for r in runs if r is not None]
        report["detection"][window] = {
            "trials": args.trials, "paused": len(found),
            "median_pairs": statistics.median(found) if found else None,
            "p90_pairs": _quantile(found, 0.9) if found else None,
            "max_pairs": max(found) if found else None,
        }  # fmt: skip
    trials = 0 if args.no_detection else args.alarm_trials
    alarms = [false_alarms(rng, pairs=10_000, window=200) for _ in range(trials)]
    report["false_alarms"] = {"pairs_per_trial": 10_000, "window": 200, "alpha": 0.001,
                              "trials": trials, "alarms": alarms}  # fmt: skip
    report["full_ramp"] = full_ramp(rng, window=200, step_requests=500)
    report["shadow"] = asyncio.run(
        shadow_cost(requests=args.requests, rounds=args.rounds, time_scale=args.time_scale)
    )
    report["shadow"]["time_scale"] = args.time_scale
    print(write_report(args.out, report))
    return 0


def write_report(out: Path, report: dict[str, Any]) -> str:
    """Write OUT/rollout.json and OUT/rollout.md (which names `report["command"]`); the
    markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout.json").write_text(json.dumps(report, indent=2))
    lines = ["# Gray release", "", f"Command: `{report['command']}`", "",
             "| window | trials | paused | median pairs | p90 | max |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for window, d in report["detection"].items():
        lines.append(f"| {window} | {d['trials']} | {d['paused']} | {d['median_pairs']} | "
                     f"{d['p90_pairs']} | {d['max_pairs']} |")  # fmt: skip
    fa = report["false_alarms"]
    lines += ["", f"False alarms in {fa['pairs_per_trial']} identical pairs (window 200, alpha "
              f"0.001), per trial: {fa['alarms']}", "",
              f"Full ramp, identical versions: {report['full_ramp']}", "",
              "| setting | n | pairs | side requests | TTFT p50 ms | p99 ms | p50 per round (sd) | "
              "p99 per round (sd) | p50 − off, paired (mean ± sd) | p99 − off, paired |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for setting in SETTINGS:
        d = report["shadow"][setting]
        p50d, p99d = d["paired_p50_diff_ms"], d["paired_p99_diff_ms"]
        lines.append(
            f"| {setting} | {d['n']} | {d['pairs']} | {d['side']} | {d['p50_ms']} | "
            f"{d['p99_ms']} | {d['rounds_p50_ms']} ({d['rounds_p50_spread']['sd']}) | "
            f"{d['rounds_p99_ms']} ({d['rounds_p99_spread']['sd']}) | "
            f"{p50d['mean']} ± {p50d['sd']} | {p99d['mean']} ± {p99d['sd']} |"
        )
    lines += ["", f"load average at the end: {os.getloadavg()}"]
    text = "\n".join(lines)
    (out / "rollout.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    raise SystemExit(main())
