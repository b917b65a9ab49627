"""Routing benchmark: the policies compared on a fleet of four stand-in backends.

    python -m bench.routing --out DIR [--workloads uniform,zipf,...] [--policies ...]

Writes DIR/routing.md (tables and the targets) and DIR/routing.json (every number).

Routing is done in-process, exactly as the edge app does it (view → `registry.candidates()` →
`policy.choose` → `registry.track` → `UpstreamPool` → `/generate` stream → `ticket.first_token()`
→ `record_success` → `policy.observe`), without the client-facing listener, so that the
comparison measures routing and not the transport. TTFT is taken at the client side of that
loop: from the request's arrival (before routing) to the first chunk with text.

Each run starts four fresh `h100-llama3-8b` stand-ins (empty caches) whose KV pools cannot hold
every prefix of the workload at once. Arrivals are sized per workload with a round_robin
calibration run so that the fleet is about 70 % busy (85 % for the Zipf workload, "high
load"); every policy then replays the same seeded arrivals. "Busy" is prefill utilization: the
prefill work the requests caused (the profile's cost model applied to each request's reported
uncached and cached tokens) divided by the fleet's time. Prefill is what requests queue behind
(SGLang schedules prefill before decode); decode steps interleave and delay a prefill by at most
one step. The share of time a backend had any request at all is reported as "active".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from backends.errors import UpstreamError
from backends.pool import UpstreamPool
from backends.registry import BackendRegistry, HealthConfig, LoadView
from backends.sim import SimConfig, SimServer
from backends.sim.profiles import get_profile
from backends.sim.textgen import WORDS
from edge.routing import Outcome, make_policy
from edge.stages.view import build_view

# No degraded marking by KV usage: the stand-in counts its evictable radix cache as used, so a
# backend with a full (but evictable) cache would read as ~100 % used.
HEALTH = HealthConfig(interval=5.0, loads_interval=0.25, degraded_token_usage=None)
POLICIES = ("round_robin", "least_load", "power_of_two", "cache_aware", "ttft")
FLEET = 4
PROFILE = "h100-llama3-8b"


# -- workloads ---------------------------------------------------------------------------------


@dataclass(slots=True)
class SessionPlan:
    start: float  # seconds after the run starts
    turns: list[tuple[str, int]]  # (new user text, output tokens)
    system: str = ""
    key: str | None = None
    think_s: float = 0.0
    group: int | None = None


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    description: str
    busy: float  # target prefill utilization of the fleet under round_robin
    kv_tokens: int  # KV pool per backend


def _words(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(WORDS, k=n))


def _arrivals(
    rng: random.Random, rate: float, duration: float, burst_shape: float | None
) -> list[float]:
    """Poisson (exponential gaps) or bursty (gamma gaps of the same mean, shape < 1)."""
    out: list[float] = []
    t = 0.0
    while True:
        if burst_shape is None:
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(burst_shape, 1.0 / (burst_shape * rate))
        if t >= duration:
            return out
        out.append(t)


def make_workload(name: str, rate: float, duration: float, seed: int) -> list[SessionPlan]:
    """The sessions of one workload at `rate` arrivals (sessions) per second."""
    rng = random.Random(seed)
    out_len = 16
    if name in ("uniform", "bursty", "zipf"):
        groups = 32
        system_len, question_len = 2048, (128 if name != "zipf" else 512)
        systems = [_words(rng, system_len) for _ in range(groups)]
        if name == "zipf":
            weights = [1 / (k + 1) ** 2.0 for k in range(groups)]
        else:
            weights = [1.0] * groups
        burst = 0.15 if name == "bursty" else None
        plans = []
        for t in _arrivals(rng, rate, duration, burst):
            g = rng.choices(range(groups), weights)[0]
            prompt = systems[g] + "\n\n" + _words(rng, question_len)
            plans.append(SessionPlan(start=t, turns=[(prompt, out_len)], group=g))
        return plans
    if name == "unique":
        return [
            SessionPlan(start=t, turns=[(_words(rng, 1024), out_len)])
            for t in _arrivals(rng, rate, duration, None)
        ]
    if name == "multiturn":
        system = _words(rng, 300)
        plans = []
        for i, t in enumerate(_arrivals(rng, rate, duration, None)):
            turns = [(_words(rng, rng.randint(150, 350)), 32) for _ in range(rng.randint(4, 6))]
            plans.append(SessionPlan(start=t, turns=turns, system=system, key=f"s{i}", think_s=0.3))
        return plans
    raise ValueError(f"unknown workload {name!r}")


WORKLOADS: dict[str, WorkloadSpec] = {
    "uniform": WorkloadSpec(
        "uniform",
        "generated shared prefix: 32 groups x 2048-token system "
        "prompt + 128-token question, uniform group choice",
        0.7,
        40_000,
    ),
    "zipf": WorkloadSpec(
        "zipf",
        "32 groups x 2048 + 512-token question, Zipf(s=2) group "
        "popularity (hottest ~62 % of traffic), high load",
        0.85,
        40_000,
    ),
    "multiturn": WorkloadSpec(
        "multiturn",
        "chat sessions sharing a 300-token system prompt, 4-6 "
        "turns of 150-350 tokens, 32-token answers, 0.3 s think time",
        0.7,
        24_000,
    ),
    "bursty": WorkloadSpec(
        "bursty", "uniform groups, gamma arrivals (shape 0.15: bursts)", 0.7, 40_000
    ),
    "unique": WorkloadSpec("unique", "1024-token prompts sharing nothing", 0.7, 40_000),
}
# Starting points found by earlier calibrations (arrivals or sessions per second).
INITIAL_RATE = {"uniform": 66.0, "zipf": 90.0, "multiturn": 15.0, "bursty": 66.0, "unique": 66.0}


# -- one run -----------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestResult:
    arrival: float
    backend: str
    reason: str
    ttft: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finished: float
    error: str | None = None
    predicted_cached: int = 0
    """The prompt tokens the policy expected the backend to have cached (its own estimate of
    the token count, so comparable with `cached_tokens` only roughly)."""


class LoadsProbe:
    """`/health` and `/v1/loads` over the upstream pool (the registry's client seam)."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.pool = UpstreamPool(connect_timeout=timeout)

    async def health(self) -> bool:
        response = await self.pool.request(self.url, "GET", "/health", headers=[], body=b"")
        await response.read()
        return response.status == 200

    async def loads(self) -> LoadView:
        response = await self.pool.request(self.url, "GET", "/v1/loads", headers=[], body=b"")
        entry = json.loads(await response.read())["loads"][0]
        return LoadView(
            entry["num_running_reqs"],
            entry["num_waiting_reqs"],
            entry["num_total_tokens"],
            entry["token_usage"],
            entry.get("max_total_num_tokens"),
        )

    async def aclose(self) -> None:
        await self.pool.aclose()


@dataclass(slots=True)
class RunResult:
    workload: str
    policy: str
    rate: float
    requests: int
    errors: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    throughput_rps: float
    output_tok_s: float
    busy: float
    active: float
    share: dict[str, float]
    reasons: dict[str, int]
    wall_s: float
    pool_reuse: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    requests_detail: list[dict[str, Any]] = field(default_factory=list)


def _prefill_s(r: RequestResult) -> float:
    """Prefill time of one request by the stand-in's cost model."""
    uncached = max(1, r.prompt_tokens - r.cached_tokens)
    return get_profile(PROFILE).prefill_time([(uncached, r.cached_tokens)])


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Run:
    def __init__(
        self,
        spec: WorkloadSpec,
        policy: str,
        plans: list[SessionPlan],
        rate: float,
        time_scale: float,
        warmup: float,
        duration: float,
    ) -> None:
        self.spec, self.policy_name, self.plans, self.rate = spec, policy, plans, rate
        self.time_scale, self.warmup = time_scale, warmup
        self.window = max(1e-3, duration - warmup)
        self.keep_detail = False
        self.max_lag = 0.0
        self.results: list[RequestResult] = []
        self.busy_samples = 0
        self.busy_hits = 0

    async def execute(self) -> RunResult:
        sims = [
            SimServer(
                SimConfig(
                    name=f"b{i}",
                    host="127.0.0.1",
                    port=0,
                    profile=PROFILE,
                    time_scale=self.time_scale,
                    max_total_tokens=self.spec.kv_tokens,
                    enable_cache_report=True,
                    seed=i,
                )
            )
            for i in range(FLEET)
        ]
        for sim in sims:
            await sim.start()
        pool = UpstreamPool(idle_timeout=4.0)
        registry = BackendRegistry(
            [s.url for s in sims],
            pool=pool,
            names=[f"b{i}" for i in range(FLEET)],
            health=HEALTH,
            warm_connections=8,
            client_factory=LoadsProbe,
        )
        policy = make_policy(
            self.policy_name,
            **({"seed": 0} if self.policy_name in ("random", "power_of_two") else {}),
        )
        await registry.start()
        sampler = asyncio.create_task(self.sample_busy(sims))
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(self.session(p, t0, registry, pool, policy) for p in self.plans))
        finally:
            wall = time.perf_counter() - t0
            sampler.cancel()
            await registry.aclose()
            stats = pool.stats()
            await pool.aclose()
            for sim in sims:
                await sim.stop()
        return self._summarize(wall, stats.reuse_ratio, policy)

    async def sample_busy(self, sims: list[SimServer]) -> None:
        """Sample whether each stand-in has work, and how late the event loop wakes us up (a
        stall of the whole process — another program taking the CPU — delays every request
        at once, whatever the routing)."""
        t0 = last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            self.max_lag = max(self.max_lag, now - last - 0.005)
            last = now
            if now - t0 < self.warmup:
                continue
            for sim in sims:
                self.busy_samples += 1
                assert sim.scheduler is not None
                self.busy_hits += not sim.scheduler.idle

    async def session(
        self,
        plan: SessionPlan,
        t0: float,
        registry: BackendRegistry,
        pool: UpstreamPool,
        policy: Any,
    ) -> None:
        delay = t0 + plan.start * self.time_scale - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        history = plan.system
        for i, (user, out_len) in enumerate(plan.turns):
            if plan.key is not None:  # chat: the conversation so far, with role markers
                prompt = history + "\n\nUser:" + user + "\n\nAssistant:"
            else:
                prompt = user
            answer = await self._request(prompt, out_len, plan.key, t0, registry, pool, policy)
            if answer is None:
                return
            history = prompt + answer
            if plan.think_s and i + 1 < len(plan.turns):
                await asyncio.sleep(plan.think_s * self.time_scale)

    async def _request(
        self,
        prompt: str,
        out_len: int,
        session: str | None,
        t0: float,
        registry: BackendRegistry,
        pool: UpstreamPool,
        policy: Any,
    ) -> str | None:
        arrival = time.perf_counter()
        body = {
            "text": prompt,
            "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0.0},
            "stream": True,
            "rid": uuid.uuid4().hex,
        }
        view = build_view("/generate", body, session)
        candidates = registry.candidates()
        decision = policy.choose(view, candidates)
        backend = decision.backend
        prefill = view.approx_tokens - decision.predicted_cached_tokens
        ttft: float | None = None
        upstream_ttft: float | None = None
        meta: dict[str, Any] = {}
        text = ""
        error: str | None = None
        with registry.track(backend, prefill_tokens=prefill) as ticket:
            t_send = time.perf_counter()
            try:
                response = await pool.request(
                    backend.url,
                    "POST",
                    "/generate",
                    headers=[(b"content-type", b"application/json")],
                    body=json.dumps(body).encode(),
                    first_byte_timeout=30.0,
                )
                buf = b""
                async for chunk in response:
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        data = event[6:]
                        if data == b"[DONE]":
                            continue
                        out = json.loads(data)
                        if ttft is None and out.get("text"):
                            now = time.perf_counter()
                            ttft, upstream_ttft = now - arrival, now - t_send
                            ticket.first_token()
                        meta, text = out.get("meta_info", {}), out.get("text", "")
                if response.status != 200:
                    error = "5xx" if response.status >= 500 else "4xx"
            except UpstreamError as exc:
                error = exc.kind
        if error is None:
            registry.record_success(backend, ttft_s=upstream_ttft)
        elif error in ("connect", "timeout", "protocol", "5xx"):
            registry.record_failure(backend, error)
        policy.observe(
            Outcome(
                backend=backend,
                view=view,
                decision=decision,
                ttft_s=upstream_ttft,
                prompt_tokens=meta.get("prompt_tokens"),
                cached_tokens=meta.get("cached_tokens"),
                completion_text=text or None,
                error=error,
            )
        )
        self.results.append(
            RequestResult(
                arrival=(arrival - t0) / self.time_scale,
                backend=backend.name,
                reason=decision.reason,
                ttft=None if ttft is None else ttft / self.time_scale,
                prompt_tokens=int(meta.get("prompt_tokens") or 0),
                cached_tokens=int(meta.get("cached_tokens") or 0),
                completion_tokens=int(meta.get("completion_tokens") or 0),
                finished=(time.perf_counter() - t0) / self.time_scale,
                error=error,
                predicted_cached=decision.predicted_cached_tokens,
            )
        )
        return None if error else text

    def _summarize(self, wall: float, reuse: float, policy: Any) -> RunResult:
        measured = [r for r in self.results if r.arrival >= self.warmup]
        ok = [r for r in measured if r.error is None and r.ttft is not None]
        ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
        prompt = sum(r.prompt_tokens for r in ok) or 1
        span = (max(r.finished for r in ok) - min(r.arrival for r in ok)) if ok else 1.0
        shares = Counter(r.backend for r in measured)
        extra: dict[str, Any] = {"max_loop_lag_ms": round(self.max_lag * 1000, 1)}
        if self.policy_name == "ttft":
            extra |= {
                "coefficients": [float(f"{c:.4g}") for c in policy.coefficients()],
                "trims": policy.trims,
                "tree_chars": policy.tree.total_chars,
            }
        return RunResult(
            workload=self.spec.name,
            policy=self.policy_name,
            rate=self.rate,
            requests=len(measured),
            errors=sum(1 for r in measured if r.error),
            hit_rate=sum(r.cached_tokens for r in ok) / prompt,
            ttft_p50_ms=_pct(ttfts, 0.5),
            ttft_p90_ms=_pct(ttfts, 0.9),
            ttft_p99_ms=_pct(ttfts, 0.99),
            ttft_mean_ms=statistics.fmean(ttfts) if ttfts else math.nan,
            throughput_rps=len(ok) / span,
            output_tok_s=sum(r.completion_tokens for r in ok) / span,
            busy=sum(_prefill_s(r) for r in ok) / (FLEET * self.window),
            active=self.busy_hits / self.busy_samples if self.busy_samples else math.nan,
            share={f"b{i}": shares.get(f"b{i}", 0) / max(1, len(measured)) for i in range(FLEET)},
            reasons=dict(Counter(r.reason for r in measured)),
            wall_s=wall,
            pool_reuse=reuse,
            extra=extra,
            requests_detail=[asdict(r) for r in self.results] if self.keep_detail else [],
        )


# -- the whole benchmark -----------------------------------------------------------------------


async def run_workload(
    name: str, policies: Sequence[str], args: argparse.Namespace
) -> list[RunResult]:
    spec = WORKLOADS[name]
    rate = args.rate or INITIAL_RATE[name] * args.load_scale
    warmup = args.duration * 0.2
    results: list[RunResult] = []

    async def run_policy(policy: str, plans: list[SessionPlan]) -> RunResult:
        attempts = 0
        while True:
            attempts += 1
            run = Run(spec, policy, plans, rate, args.time_scale, warmup, args.duration)
            run.keep_detail = args.detail
            result = await run.execute()
            lag = result.extra["max_loop_lag_ms"]
            if lag <= args.max_stall_ms or attempts == 3:
                result.extra["attempts"] = attempts
                return result
            _log(f"{name}: {policy}: the process stalled {lag:.0f} ms (CPU taken); run again")

    plans = make_workload(name, rate, args.duration, args.seed)
    rr: RunResult | None = None
    # Calibrate on round_robin: scale the arrival rate until the fleet is ~spec.busy busy.
    for attempt in range(args.calibrate + 1):
        if args.rate and "round_robin" not in policies:
            break
        plans = make_workload(name, rate, args.duration, args.seed)
        rr = await run_policy("round_robin", plans)
        _log(f"{name}: round_robin at {rate:.1f}/s: busy {rr.busy:.2f}, p99 {rr.ttft_p99_ms:.0f}")
        if args.rate or attempt == args.calibrate or abs(rr.busy - spec.busy) < 0.08:
            break
        rate *= min(2.0, max(0.5, spec.busy / max(rr.busy, 0.05)))
    for policy in policies:
        if policy == "round_robin" and rr is not None:
            results.append(rr)
            continue
        result = await run_policy(policy, plans)
        _log(
            f"{name}: {policy}: p50 {result.ttft_p50_ms:.0f} p99 {result.ttft_p99_ms:.0f} ms, "
            f"hit {result.hit_rate:.2f}, busy {result.busy:.2f}"
        )
        results.append(result)
    return results


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def targets(results: list[RunResult]) -> list[dict[str, Any]]:
    """The issue's targets for `ttft`, checked against this run's numbers."""
    by = {(r.workload, r.policy): r for r in results}
    out: list[dict[str, Any]] = []

    def check(workload: str, other: str, what: str, ok: bool, detail: str) -> None:
        out.append(
            {"workload": workload, "against": other, "target": what, "met": ok, "detail": detail}
        )

    for workload in ("zipf", "multiturn"):
        t, c = by.get((workload, "ttft")), by.get((workload, "cache_aware"))
        if t and c:
            gain = 1 - t.ttft_p99_ms / c.ttft_p99_ms
            check(
                workload,
                "cache_aware",
                "p99 >= 30 % lower",
                gain >= 0.30,
                f"{t.ttft_p99_ms:.0f} vs {c.ttft_p99_ms:.0f} ms ({gain * 100:.0f} % lower)",
            )
    for workload in ("uniform", "bursty"):
        t, c = by.get((workload, "ttft")), by.get((workload, "cache_aware"))
        if t and c:
            check(
                workload,
                "cache_aware",
                "p99 no worse",
                t.ttft_p99_ms <= c.ttft_p99_ms * 1.05,
                f"{t.ttft_p99_ms:.0f} vs {c.ttft_p99_ms:.0f} ms (5 % noise allowance)",
            )
    t, r = by.get(("unique", "ttft")), by.get(("unique", "round_robin"))
    if t and r:
        check(
            "unique",
            "round_robin",
            "p99 no worse",
            t.ttft_p99_ms <= r.ttft_p99_ms * 1.05,
            f"{t.ttft_p99_ms:.0f} vs {r.ttft_p99_ms:.0f} ms (5 % noise allowance)",
        )
    for workload in WORKLOADS:
        t, c = by.get((workload, "ttft")), by.get((workload, "cache_aware"))
        if t and c:
            check(
                workload,
                "cache_aware",
                "hit rate at most 3 points lower",
                t.hit_rate >= c.hit_rate - 0.03,
                f"{t.hit_rate:.1%} vs {c.hit_rate:.1%}",
            )
    return out


def render(results: list[RunResult], checks: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "# Routing benchmark",
        "",
        f"Command: `{command(args)}`",
        "",
        f"Fleet: {FLEET} in-process `{PROFILE}` stand-ins, time_scale {args.time_scale}, "
        f"{args.duration:g} s of arrivals per run (first 20 % excluded as warm-up), seed "
        f"{args.seed}. Routing in-process exactly as the edge app does it; TTFT measured at "
        "the client of that loop, in simulated milliseconds.",
        "",
    ]
    for name in dict.fromkeys(r.workload for r in results):
        spec = WORKLOADS[name]
        rows = [r for r in results if r.workload == name]
        lines += [
            f"## {name}",
            "",
            f"{spec.description}; KV pool {spec.kv_tokens} tokens per "
            f"backend; {rows[0].rate:.1f} arrivals/s (round_robin busy {rows[0].busy:.0%}).",
            "",
            "| policy | hit rate | TTFT p50 | p90 | p99 | mean | req/s | out tok/s | "
            "busy | active | share b0/b1/b2/b3 | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            share = "/".join(f"{r.share[f'b{i}']:.0%}" for i in range(FLEET))
            lines.append(
                f"| {r.policy} | {r.hit_rate:.1%} | {r.ttft_p50_ms:.1f} | {r.ttft_p90_ms:.1f} | "
                f"{r.ttft_p99_ms:.1f} | {r.ttft_mean_ms:.1f} | {r.throughput_rps:.1f} | "
                f"{r.output_tok_s:.0f} | {r.busy:.0%} | {r.active:.0%} | {share} | {r.errors} |"
            )
        lines.append("")
    lines += [
        "## Targets for `ttft`",
        "",
        "| workload | against | target | met | numbers |",
        "|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c['workload']} | {c['against']} | {c['target']} | "
            f"{'yes' if c['met'] else 'NO'} | {c['detail']} |"
        )
    return "\n".join(lines) + "\n"


def command(args: argparse.Namespace) -> str:
    """The command line that produced the report, shell-quoted (`args.argv`: what `main` ran
    with, not this process's)."""
    return shlex.join(["python", "-m", "bench.routing", *args.argv])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.routing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for routing.md and routing.json"
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of arrivals per run")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=2.0,
        help="stand-in time scale: 2 runs simulated time at half speed, halving the CPU the "
        "stand-ins and the client need per simulated second (TTFTs are reported in simulated "
        "time); < 1 compresses time",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="fixed arrivals/s (no calibration)"
    )
    parser.add_argument(
        "--load-scale", type=float, default=1.0, help="multiplies the initial rates"
    )
    parser.add_argument("--calibrate", type=int, default=1, help="round_robin calibration retries")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--detail", action="store_true", help="per-request rows in the JSON")
    parser.add_argument(
        "--max-stall-ms",
        type=float,
        default=150.0,
        help="rerun (up to twice) a run during which the event loop stalled longer than this",
    )
    args = parser.parse_args(argv)
    for key, known in (("workloads", WORKLOADS), ("policies", POLICIES)):
        chosen = [w for w in getattr(args, key).split(",") if w]
        bad = [w for w in chosen if w not in known]
        if bad or not chosen:
            parser.error(f"--{key}: unknown {bad or 'empty list'}; choose from {', '.join(known)}")
        setattr(args, key, chosen)
    if args.duration <= 0 or not 0 < args.time_scale <= 10 or args.calibrate < 0:
        parser.error("--duration must be > 0, --time-scale in (0, 10], --calibrate >= 0")
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be > 0")
    args.argv = list(argv)
    return args


async def run(args: argparse.Namespace) -> list[RunResult]:
    # A short discarded run first: the first run in a process pays for imports and caches.
    spec = WORKLOADS["uniform"]
    await Run(spec, "round_robin", make_workload("uniform", 20.0, 1.5, 0), 20.0,
              args.time_scale, 0.0, 1.5).execute()  # fmt: skip
    results: list[RunResult] = []
    for name in args.workloads:
        results += await run_workload(name, args.policies, args)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    results = asyncio.run(run(args))
    checks = targets(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing.md").write_text(render(results, checks, args))
    payload = {
        "command": command(args),
        "args": {k: str(v) for k, v in vars(args).items() if k != "argv"},
        "profile": PROFILE,
        "results": [asdict(r) for r in results],
        "targets": checks,
        "wall_s": time.perf_counter() - started,
    }
    (args.out / "routing.json").write_text(json.dumps(payload, indent=2, default=str))
    _log(f"wrote {args.out / 'routing.md'} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
