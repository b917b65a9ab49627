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
   shadowing 0 % and 10 % of stable traffic, runs interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import re
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


async def _ttfts(url: str, n: int, seed: int) -> tuple[list[float], int]:
    out: list[float] = []
    errors = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for i in range(n):
            prompt = f"question {seed}-{i} " + "context " * 40
            body = {"model": "m", "stream": True, "max_tokens": 16,
                    "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
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
    return out, errors


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


async def shadow_cost(*, requests: int, rounds: int, time_scale: float) -> dict[str, Any]:
    results: dict[str, list[float]] = {"0": [], "0.1": []}
    shadowed: dict[str, float] = {}
    per_round: dict[str, list[tuple[float, float]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        stable_url = await stack.enter_async_context(_sim_process("v1", time_scale))
        canary_url = await stack.enter_async_context(_sim_process("v2", time_scale))
        for r in range(rounds):
            for fraction in ("0", "0.1") if r % 2 == 0 else ("0.1", "0"):
                proxy = ProxyConfig.from_mapping(
                    {"backends": [stable_url, canary_url], "policy": "round_robin"}
                ).validate()
                # canary share 0 % (steps below any real share): only shadows reach the canary
                rollout = RolloutConfig(model="m", stable="v1", canary="v2", steps=[1e-9],
                                        auto=False, shadow_fraction=float(fraction),
                                        shadow_rate=1000.0)  # fmt: skip
                wiring = await build(proxy, registry=CollectorRegistry(),
                                     models=ModelsConfig(rollouts=[rollout]))  # fmt: skip
                await wiring.start()
                listener = H1Listener(wiring.app, host="127.0.0.1", port=0)
                await listener.start()
                try:
                    ttfts, _ = await _ttfts(listener.url, requests, seed=r)
                    results[fraction].extend(ttfts)
                    per_round.setdefault(fraction, []).append(
                        (statistics.median(ttfts) * 1000, _quantile(ttfts, 0.99) * 1000)
                    )
                    shadow = wiring.models.shadows["m"]
                    shadowed[fraction] = shadowed.get(fraction, 0) + shadow.compared
                finally:
                    await listener.stop()
                    await wiring.aclose()
    out: dict[str, Any] = {}
    for fraction, values in results.items():
        out[fraction] = {
            "n": len(values), "pairs_compared": shadowed.get(fraction, 0),
            "p50_ms": round(statistics.median(values) * 1000, 3),
            "p99_ms": round(_quantile(values, 0.99) * 1000, 3),
            "rounds_p50_ms": [round(p50, 3) for p50, _ in per_round[fraction]],
            "rounds_p99_ms": [round(p99, 3) for _, p99 in per_round[fraction]],
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
    report: dict[str, Any] = {"detection": {}, "false_alarms": {}}
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rollout.json").write_text(json.dumps(report, indent=2))
    lines = ["# Gray release", "", "| window | trials | paused | median pairs | p90 | max |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for window, d in report["detection"].items():
        lines.append(f"| {window} | {d['trials']} | {d['paused']} | {d['median_pairs']} | "
                     f"{d['p90_pairs']} | {d['max_pairs']} |")  # fmt: skip
    fa = report["false_alarms"]
    lines += ["", f"False alarms in {fa['pairs_per_trial']} identical pairs (window 200, alpha "
              f"0.001), per trial: {fa['alarms']}", "",
              f"Full ramp, identical versions: {report['full_ramp']}", "",
              "| shadow | n | pairs | TTFT p50 ms | p99 ms | p50 per round | p99 per round |",
              "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for fraction in ("0", "0.1"):
        d = report["shadow"][fraction]
        lines.append(f"| {fraction} | {d['n']} | {d['pairs_compared']} | {d['p50_ms']} | "
                     f"{d['p99_ms']} | {d['rounds_p50_ms']} | {d['rounds_p99_ms']} |")  # fmt: skip
    (args.out / "rollout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
