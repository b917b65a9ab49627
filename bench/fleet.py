"""Fleet benchmark: pre-warming after a restart, the shared routing view when scaling out, and
what both cost on the request path.

    python -m bench.fleet --out DIR [--parts cost,restart,scaleout] [--duration S]

- **cost**: CPU per `ttft` choice with and without the fleet hooks (hot-prefix counting, the
  shared view's lookups, three other processes' load figures), on Zipf-workload prompts and four
  backends; each hook alone; and the load channel's own work (a look at the counts, one message
  taken in).
- **restart**: four stand-ins under the Zipf workload (`bench.routing`), one restarted mid-run
  (stopped, started again empty on the same port); TTFT p99 of the requests that arrive in the
  next `--window` seconds, with and without pre-warming (`edge.routing.prewarm`).
- **scaleout**: the Zipf-hot and multi-turn workloads through 1, 2 and 4 edge instances, each
  with its own registry, pool and `ttft` policy (as separate processes have), clients spread
  over them in turn, with and without the shared view through a real Redis (`--redis URL`).
  The instances run in this one process so that the CPU they share is the same in every run;
  with `--processes` each runs in a process of its own (`bench.fleet_processes`), as separate
  edges do, the stand-ins staying here. `--views none|shared` keeps one kind of run of more
  than one instance. With `--repeat`, a last table pools every seed's requests (`pooled`).

Routing is done in-process exactly as the edge app does it (`bench.routing.Run`). Times are the
stand-ins' simulated milliseconds (`--time-scale`). Writes DIR/fleet.md and DIR/fleet.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from backends.pool import UpstreamPool
from backends.registry import BackendRegistry, HealthConfig
from backends.sim import SimConfig, SimServer
from bench.fleet_processes import ChildPlan, run_children
from bench.routing import (
    FLEET,
    HEALTH,
    INITIAL_RATE,
    PROFILE,
    WORKLOADS,
    LoadsProbe,
    RequestResult,
    Run,
    _pct,
    make_workload,
)
from edge.routing import make_policy
from edge.routing.base import POLICY_NAMES, RoutingPolicy
from edge.routing.fleet import FleetServices, build_fleet
from edge.routing.fleet_view import FleetViewConfig
from edge.routing.prewarm import PrewarmConfig
from edge.routing.ttft import TTFTPolicy
from edge.stages.view import build_view

PARTS = ("cost", "restart", "scaleout")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- cost ----------------------------------------------------------------------------------------


def measure_cost(redis_url: str | None) -> dict[str, Any]:
    """Microseconds per call, best of 5 rounds of 2000 (CPU time of this process)."""
    from backends.registry import Backend
    from edge.routing.fleet_view import FleetView
    from edge.routing.hot_prefixes import HotPrefixes
    from edge.routing.prefix_blocks import BlockHasher

    plans = make_workload("zipf", 200.0, 10.0, 1)
    texts = [p.turns[0][0] for p in plans][:2000]
    views = [build_view("/generate", {"text": t}, None) for t in texts]
    backends = [Backend(name=f"b{i}", url=f"http://127.0.0.1:{9000 + i}") for i in range(FLEET)]

    def rounds(fn: Any) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        return best / len(views) * 1e6

    def choose_all(policy: TTFTPolicy) -> Any:
        def run() -> None:
            for v in views:
                policy.choose(v, backends)

        return run

    plain = TTFTPolicy()
    choose_all(plain)()  # fill the tree as traffic would
    hooked = TTFTPolicy()
    hasher = BlockHasher()
    hot = HotPrefixes()
    view = FleetView(
        FleetViewConfig(enabled=True), url=redis_url or "redis://127.0.0.1:1/0", backends=backends
    )
    # The mirror as a busy fleet fills it: every prompt's blocks placed on some backend.
    for i, t in enumerate(texts):
        view._held.setdefault(backends[i % FLEET].url, OrderedDict()).update(
            dict.fromkeys(hasher.blocks(t).hashes, time.monotonic())
        )
    # Three other processes' load figures on every backend, as the load channel keeps them.
    peers = [
        orjson.dumps(
            {"i": f"peer{k}", "l": [[b.url, 512 * (k + 1), k + 1, 2 * k + 3] for b in backends]}
        )  # fmt: skip
        for k in range(3)
    ]
    for raw in peers:
        view._apply_load(raw)
    assert view.processes == 4
    hooked.attach(hasher, hot=hot, fleet=view)
    choose_all(hooked)()
    blocks = [BlockHasher().blocks(t) for t in texts]
    fresh_hasher = BlockHasher()

    def hash_all() -> None:
        for t in texts:
            fresh_hasher.blocks(t)

    def record_all() -> None:
        for b in blocks:
            hot.record(None, b)

    def depth_all() -> None:
        for k in blocks:
            for b in backends:
                view.depth(b.url, k.hashes)

    def apply_all() -> None:  # per message taken in
        for i in range(len(views)):
            view._apply_load(peers[i % 3])

    for b in backends:  # the counts a busy process has, looked at per `load_interval`
        b.in_flight, b.in_prefill, b.in_flight_prefill_tokens = 3, 1, 700

    def look_all() -> None:
        last = None
        for _ in views:
            state = view._load_state()
            if state != last:
                last = state

    out = {
        "prompt_chars_mean": round(statistics.fmean(len(t) for t in texts)),
        "choose_us": round(rounds(choose_all(plain)), 2),
        "choose_with_hot_and_view_us": round(rounds(choose_all(hooked)), 2),
        "block_hashes_us": round(rounds(hash_all), 2),
        "hot_record_us": round(rounds(record_all), 2),
        "view_depth_4_backends_us": round(rounds(depth_all), 2),
        "load_look_us": round(rounds(look_all), 2),
        "load_message_in_us": round(rounds(apply_all), 2),
    }
    out["added_us"] = round(out["choose_with_hot_and_view_us"] - out["choose_us"], 2)
    return out


# -- instances ----------------------------------------------------------------------------------


@dataclass(eq=False)
class Instance:
    """What one edge process holds for routing."""

    registry: BackendRegistry
    pool: UpstreamPool
    policy: RoutingPolicy
    fleet: FleetServices | None

    async def aclose(self) -> None:
        if self.fleet is not None:
            await self.fleet.aclose()
        await self.registry.aclose()
        await self.pool.aclose()


async def make_instance(
    urls: Sequence[str],
    *,
    policy_name: str = "ttft",
    health: HealthConfig = HEALTH,
    prewarm: PrewarmConfig | None = None,
    view: FleetViewConfig | None = None,
) -> Instance:
    pool = UpstreamPool(idle_timeout=4.0)
    registry = BackendRegistry(
        urls,
        pool=pool,
        names=[f"b{i}" for i in range(len(urls))],
        health=health,
        warm_connections=8,
        client_factory=LoadsProbe,
    )
    policy = make_policy(policy_name)
    fleet = build_fleet(prewarm, view, redis_url=None, registry=registry, pool=pool, policy=policy)
    await registry.start()
    if fleet is not None:
        await fleet.start()
        policy = fleet.policy
    return Instance(registry, pool, policy, fleet)


def _sims(spec_kv: int, time_scale: float) -> list[SimServer]:
    return [
        SimServer(
            SimConfig(
                name=f"b{i}",
                host="127.0.0.1",
                port=0,
                profile=PROFILE,
                time_scale=time_scale,
                max_total_tokens=spec_kv,
                enable_cache_report=True,
                enable_metrics=True,
                seed=i,
            )
        )
        for i in range(FLEET)
    ]


# -- restart ------------------------------------------------------------------------------------


@dataclass(slots=True)
class RestartResult:
    prewarm: bool
    rate: float
    restart_at_s: float
    window_s: float
    restarts: int
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_max_ms: float
    restarted_share: float
    restarted_hit_rate: float
    restarted_p99_ms: float
    baseline_p99_ms: float
    max_loop_lag_ms: float
    warm: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


class RestartRun(Run):
    """Restart `restarts` backends in turn (b3, b2, ...), one every `every` simulated seconds
    from `restart_at`; measure the arrivals of the `window` seconds after each restart."""

    def __init__(
        self,
        *,
        prewarm: bool,
        restart_at: float,
        down_s: float,
        window: float,
        restarts: int = 1,
        every: float = 8.0,
        deadline: float = 5.0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.prewarm, self.restart_at, self.down_s, self.window_s = (
            prewarm,
            restart_at,
            down_s,
            window,
        )
        self.restarts, self.every, self.deadline = restarts, every, deadline

    def schedule(self) -> list[tuple[float, int]]:
        """(simulated time, backend index) of each restart."""
        return [(self.restart_at + k * self.every, FLEET - 1 - k % FLEET)
                for k in range(self.restarts)]  # fmt: skip

    async def execute_restart(self) -> RestartResult:
        sims = _sims(self.spec.kv_tokens, self.time_scale)
        for sim in sims:
            await sim.start()
        ts = self.time_scale
        # Quick checks, so that the registry sees the restarted backend go and come back; no
        # passive ejection, whose length depends on how many requests happened to fail in a
        # row and would decide, more than warm-up, how long the backend is out.
        health = HealthConfig(
            eject_after=1_000_000,
            interval=0.1,
            failure_threshold=2,
            success_threshold=1,
            loads_interval=0.25,
            degraded_token_usage=None,
        )
        prewarm = (
            PrewarmConfig(enabled=True, deadline=self.deadline * ts, restart_check_interval=None)
            if self.prewarm
            else None
        )
        inst = await make_instance(
            [s.url for s in sims], policy_name=self.policy_name, health=health, prewarm=prewarm
        )
        t0 = time.perf_counter()

        async def restart() -> None:
            for at, i in self.schedule():
                await asyncio.sleep(max(0.0, t0 + at * ts - time.perf_counter()))
                port = sims[i].port
                await sims[i].stop()
                await asyncio.sleep(self.down_s * ts)
                fresh = _sims(self.spec.kv_tokens, ts)[i]
                fresh.config.port = port
                await fresh.start()
                sims[i] = fresh

        restarter = asyncio.create_task(restart())
        sampler = asyncio.create_task(self.sample_busy(sims))
        try:
            await asyncio.gather(
                *(self.session(p, t0, inst.registry, inst.pool, inst.policy) for p in self.plans)
            )
            await restarter
        finally:
            sampler.cancel()
            warm = inst.fleet.prewarm.snapshot()["backends"] if (
                inst.fleet is not None and inst.fleet.prewarm is not None) else {}  # fmt: skip
            await inst.aclose()
            for sim in sims:
                await sim.stop()
        after: list[RequestResult] = []
        on_restarted: list[RequestResult] = []
        for at, i in self.schedule():
            window = [r for r in self.results if at <= r.arrival < at + self.window_s]
            after += window
            on_restarted += [r for r in window if r.backend == f"b{i}" and r.error is None
                             and r.arrival >= at + self.down_s]  # fmt: skip
        first = self.schedule()[0][0]
        before = [r for r in self.results if self.warmup <= r.arrival < first]
        ok = [r for r in after if r.error is None and r.ttft is not None]
        ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
        base = [r.ttft * 1000 for r in before if r.error is None and r.ttft is not None]
        restarted = [r.ttft * 1000 for r in on_restarted if r.ttft is not None]
        return RestartResult(
            prewarm=self.prewarm,
            rate=self.rate,
            restart_at_s=first,
            window_s=self.window_s,
            restarts=self.restarts,
            requests=len(after),
            errors=sum(1 for r in after if r.error),
            ttft_p50_ms=_pct(ttfts, 0.5),
            ttft_p99_ms=_pct(ttfts, 0.99),
            ttft_max_ms=max(ttfts, default=float("nan")),
            restarted_share=len(on_restarted) / max(1, len(ok)),
            restarted_hit_rate=sum(r.cached_tokens for r in on_restarted)
            / max(1, sum(r.prompt_tokens for r in on_restarted)),
            restarted_p99_ms=_pct(restarted, 0.99),
            baseline_p99_ms=_pct(base, 0.99),
            max_loop_lag_ms=round(self.max_lag * 1000, 1),
            warm=warm,
        )


async def run_restart(args: argparse.Namespace) -> list[RestartResult]:
    """Both runs per seed, with the same arrivals; `--repeat` seeds."""
    spec = WORKLOADS["zipf"]
    rate = INITIAL_RATE["zipf"] * args.load_scale
    duration = args.restart_at + (args.restarts - 1) * args.every + args.window + 1.0
    out = []
    for seed in range(args.seed, args.seed + args.repeat):
        plans = make_workload("zipf", rate, duration, seed)
        for prewarm in (False, True):
            run = RestartRun(
                prewarm=prewarm,
                restart_at=args.restart_at,
                down_s=args.down,
                window=args.window,
                restarts=args.restarts,
                every=args.every,
                deadline=args.deadline,
                spec=spec,
                policy=args.policy,
                plans=plans,
                rate=rate,
                time_scale=args.time_scale,
                warmup=1.0,
                duration=duration,
            )
            result = await run.execute_restart()
            result.seed = seed
            _log(
                f"restart seed {seed}, prewarm {prewarm}: p99 {result.ttft_p99_ms:.0f} ms over "
                f"{result.requests} requests, restarted backend's hit rate "
                f"{result.restarted_hit_rate:.0%}"
            )
            out.append(result)
    return out


# -- scale-out ----------------------------------------------------------------------------------


@dataclass(slots=True)
class ScaleResult:
    workload: str
    instances: int
    shared: bool
    rate: float
    requests: int
    errors: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    max_loop_lag_ms: float
    seed: int = 0
    processes: bool = False
    """Each instance in a process of its own (`--processes`)."""
    misses: int = 0
    """Requests the backend had under a tenth of the prompt cached for."""
    unforeseen_misses: int = 0
    """Of those, the ones the policy had predicted half the prompt or more cached for: a whole
    prefill that the requests routed behind it did not count on."""
    ttfts_ms: list[float] = field(default_factory=list, repr=False)
    """Every measured TTFT, for the pooled figures over seeds (left out of the JSON)."""
    cached_tokens: int = 0
    prompt_tokens: int = 0


class ScaleRun(Run):
    def __init__(
        self,
        *,
        instances: int,
        view: FleetViewConfig | None,
        processes: bool = False,
        seed: int = 0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.instances, self.view, self.processes, self.seed = instances, view, processes, seed
        self.duration = float(kw["duration"])

    async def execute_scale(self) -> ScaleResult:
        sims = _sims(self.spec.kv_tokens, self.time_scale)
        for sim in sims:
            await sim.start()
        urls = [s.url for s in sims]
        sampler = asyncio.create_task(self.sample_busy(sims))
        try:
            if self.processes:
                plans = [
                    ChildPlan(urls, self.spec.name, self.rate, self.duration,
                              self.seed, i, self.instances, self.time_scale, self.view)
                    for i in range(self.instances)
                ]  # fmt: skip
                self.results, lag = await run_children(plans)
                self.max_lag = max(self.max_lag, lag)
            else:
                await self._in_process(urls)
        finally:
            sampler.cancel()
            for sim in sims:
                await sim.stop()
        measured = [r for r in self.results if r.arrival >= self.warmup]
        ok = [r for r in measured if r.error is None and r.ttft is not None]
        ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
        missed = [r for r in ok if r.cached_tokens * 10 < r.prompt_tokens]
        return ScaleResult(
            workload=self.spec.name,
            instances=self.instances,
            shared=self.view is not None,
            rate=self.rate,
            requests=len(measured),
            errors=sum(1 for r in measured if r.error),
            hit_rate=sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
            ttft_p50_ms=_pct(ttfts, 0.5),
            ttft_p99_ms=_pct(ttfts, 0.99),
            max_loop_lag_ms=round(self.max_lag * 1000, 1),
            processes=self.processes,
            misses=len(missed),
            unforeseen_misses=sum(1 for r in missed if r.predicted_cached * 2 >= r.prompt_tokens),
            ttfts_ms=ttfts,
            cached_tokens=sum(r.cached_tokens for r in ok),
            prompt_tokens=sum(r.prompt_tokens for r in ok),
        )

    async def _in_process(self, urls: list[str]) -> None:
        fleet = [await make_instance(urls, view=self.view) for _ in range(self.instances)]
        t0 = time.perf_counter()
        try:
            await asyncio.gather(
                *(
                    self.session(p, t0, i.registry, i.pool, i.policy)
                    for p, i in ((p, fleet[k % len(fleet)]) for k, p in enumerate(self.plans))
                )
            )
        finally:
            for inst in fleet:
                await inst.aclose()


async def run_scaleout(args: argparse.Namespace) -> list[ScaleResult]:
    out: list[ScaleResult] = []
    for seed, name in ((s, w) for s in range(args.seed, args.seed + args.repeat)
                       for w in args.workloads):  # fmt: skip
        spec = WORKLOADS[name]
        rate = INITIAL_RATE[name] * args.load_scale
        plans = make_workload(name, rate, args.duration, seed)
        for n in args.instances:
            for shared in (False,) if n == 1 else args.views:
                view = None
                if shared:
                    key = f"quicedge-bench:{uuid.uuid4().hex[:8]}:fv"
                    view = FleetViewConfig(
                        enabled=True,
                        redis=args.redis,
                        key=key,
                        interval=args.view_interval,
                        load_interval=args.load_interval,
                    )
                run = ScaleRun(
                    instances=n,
                    view=view,
                    processes=args.processes,
                    seed=seed,
                    spec=spec,
                    policy="ttft",
                    plans=plans,
                    rate=rate,
                    time_scale=args.time_scale,
                    warmup=args.duration * 0.2,
                    duration=args.duration,
                )
                result = await run.execute_scale()
                result.seed = seed
                _log(
                    f"scaleout {name} seed {seed} x{n} shared={shared} "
                    f"processes={args.processes}: hit "
                    f"{result.hit_rate:.1%} ({result.unforeseen_misses} of {result.misses} "
                    f"misses unforeseen), p99 {result.ttft_p99_ms:.0f} ms, loop stall "
                    f"{result.max_loop_lag_ms:.0f} ms"
                )
                out.append(result)
    return out


def pooled(results: Sequence[ScaleResult], *, resamples: int = 2000) -> list[dict[str, Any]]:
    """Each configuration's p99 and hit rate over every seed's requests together, and its p99
    against one instance's on the same seeds, with a 90 % interval from resampling the seeds.

    One run's p99 rests on its ~20 slowest requests and moves by tens of percent between runs of
    one seed (which sessions fall into step); pooling the seeds puts it on a hundred or more."""
    groups: dict[tuple[str, int, bool], dict[int, ScaleResult]] = {}
    for r in results:
        groups.setdefault((r.workload, r.instances, r.shared), {})[r.seed] = r
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    for (workload, instances, shared), by_seed in sorted(groups.items()):
        one = groups.get((workload, 1, False), {})
        seeds = sorted(set(by_seed) & set(one)) if instances > 1 or shared else sorted(by_seed)

        def p99(runs: dict[int, ScaleResult], picks: Sequence[int]) -> float:
            return _pct([t for s in picks for t in runs[s].ttfts_ms], 0.99)

        row: dict[str, Any] = {
            "workload": workload, "instances": instances, "shared": shared,
            "seeds": sorted(by_seed),
            "ttft_p99_ms": p99(by_seed, sorted(by_seed)),
            "hit_rate": sum(r.cached_tokens for r in by_seed.values())
            / max(1, sum(r.prompt_tokens for r in by_seed.values())),
        }  # fmt: skip
        if seeds and (instances > 1 or shared):
            row["ratio"] = p99(by_seed, seeds) / p99(one, seeds)
            draws = sorted(
                p99(by_seed, picks) / p99(one, picks)
                for picks in ([rng.choice(seeds) for _ in seeds] for _ in range(resamples))
            )
            row["ratio_low"] = draws[int(0.05 * resamples)]
            row["ratio_high"] = draws[int(0.95 * resamples) - 1]
        rows.append(row)
    return rows


# -- report -------------------------------------------------------------------------------------


def render(payload: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["# Fleet benchmark", "", f"`python -m bench.fleet {' '.join(args.argv)}`", ""]
    cost = payload.get("cost")
    if cost:
        lines += ["## Request-path cost (µs per request, CPU)", "", "| what | µs |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in cost.items()]
        lines.append("")
    restart = payload.get("restart")
    if restart:
        lines += [
            f"## Restarts (Zipf, {args.policy}): windows after each restart",
            "",
            "| seed | pre-warming | requests in window | errors | TTFT p50 | p99 | max | "
            "share on restarted | its hit rate | its p99 | p99 before restarts | loop stall |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in restart:
            lines.append(
                f"| {r['seed']} | {'on' if r['prewarm'] else 'off'} | {r['requests']} | "
                f"{r['errors']} | "
                f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['ttft_max_ms']:.0f} | "
                f"{r['restarted_share']:.0%} | {r['restarted_hit_rate']:.0%} | "
                f"{r['restarted_p99_ms']:.0f} | {r['baseline_p99_ms']:.0f} | "
                f"{r['max_loop_lag_ms']:.0f} |"
            )
        lines.append("")
    scale = payload.get("scaleout")
    if scale:
        lines += [
            "## Scale-out (ttft)",
            "",
            "| workload | seed | instances | shared view | hit rate | misses (unforeseen) | "
            "TTFT p50 | p99 | errors | loop stall |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in scale:
            where = ""
            if r.get("processes"):
                where = " processes" if r["instances"] > 1 else " process"
            lines.append(
                f"| {r['workload']} | {r['seed']} | {r['instances']}{where} | "
                f"{'yes' if r['shared'] else 'no'} | "
                f"{r['hit_rate']:.1%} | {r['misses']} ({r['unforeseen_misses']}) | "
                f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                f"{r['errors']} | {r['max_loop_lag_ms']:.0f} |"
            )
        lines.append("")
    pool = payload.get("scaleout_pooled")
    if pool:
        lines += [
            "## Scale-out over all seeds",
            "",
            "TTFT p99 of every seed's requests together; against one instance on the same seeds,",
            "with a 90 % interval from resampling the seeds.",
            "",
            "| workload | instances | shared view | seeds | hit rate | TTFT p99 | p99 / one | "
            "90 % interval |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in pool:
            ratio = interval = ""
            if "ratio" in r:
                ratio = f"{r['ratio']:.2f}x"
                interval = f"{r['ratio_low']:.2f}–{r['ratio_high']:.2f}x"
            lines.append(
                f"| {r['workload']} | {r['instances']} | {'yes' if r['shared'] else 'no'} | "
                f"{len(r['seeds'])} | {r['hit_rate']:.1%} | {r['ttft_p99_ms']:.0f} | "
                f"{ratio} | {interval} |"
            )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--redis", default=None, help="Redis URL (scaleout with the shared view)")
    parser.add_argument(
        "--duration", type=float, default=6.0, help="seconds of arrivals per scale-out run"
    )
    parser.add_argument("--restart-at", type=float, default=3.0, help="simulated s")
    parser.add_argument("--down", type=float, default=0.5, help="simulated s the backend is down")
    parser.add_argument(
        "--window",
        type=float,
        default=4.0,
        help="simulated s after the restart whose arrivals are measured",
    )
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--load-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="seeds to run")
    parser.add_argument(
        "--view-interval", type=float, default=0.1, help="scale-out: fleet_view.interval, s"
    )
    parser.add_argument(
        "--load-interval", type=float, default=0.01, help="scale-out: fleet_view.load_interval, s"
    )
    parser.add_argument(
        "--policy", default="ttft", choices=POLICY_NAMES, help="restart: routing policy"
    )
    parser.add_argument("--restarts", type=int, default=4, help="restart: backends restarted")
    parser.add_argument(
        "--every", type=float, default=8.0, help="restart: simulated s between restarts"
    )
    parser.add_argument(
        "--deadline", type=float, default=5.0, help="restart: pre-warming deadline, simulated s"
    )
    parser.add_argument("--workloads", default="zipf,multiturn", help="scale-out workloads")
    parser.add_argument("--instances", default="1,2,4", help="scale-out edge instance counts")
    parser.add_argument(
        "--views", default="none,shared",
        help="scale-out: runs of more than one instance without the shared view (none), with it "
        "(shared), or both",
    )  # fmt: skip
    parser.add_argument(
        "--processes", action="store_true",
        help="scale-out: each instance in a process of its own (bench/fleet_processes.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.argv = argv
    args.workloads = [w for w in args.workloads.split(",") if w]
    if not args.workloads or any(w not in WORKLOADS for w in args.workloads):
        parser.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    try:
        args.instances = [int(n) for n in args.instances.split(",")]
    except ValueError:
        parser.error("--instances: a comma-separated list of counts")
    if not args.instances or min(args.instances) < 1:
        parser.error("--instances: counts must be >= 1")
    views = {"none": False, "shared": True}
    names = [v for v in args.views.split(",") if v]
    if not names or any(v not in views for v in names):
        parser.error("--views: none, shared or both")
    args.views = [views[v] for v in names]
    args.parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in args.parts if p not in PARTS]
    if bad or not args.parts:
        parser.error(f"--parts: unknown {bad or 'empty list'}; choose from {', '.join(PARTS)}")
    if "scaleout" in args.parts and not args.redis:
        parser.error("--parts scaleout needs --redis URL")
    return args


async def run(args: argparse.Namespace) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    random.seed(args.seed)
    if "cost" in args.parts:
        payload["cost"] = measure_cost(args.redis)
        _log(f"cost: {payload['cost']}")
    if "restart" in args.parts:
        payload["restart"] = [asdict(r) for r in await run_restart(args)]
    if "scaleout" in args.parts:
        results = await run_scaleout(args)
        payload["scaleout"] = [
            {k: v for k, v in asdict(r).items() if k != "ttfts_ms"} for r in results
        ]
        payload["scaleout_pooled"] = pooled(results)
    return payload


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    payload = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fleet.md").write_text(render(payload, args))
    payload["args"] = {k: str(v) for k, v in vars(args).items()}
    payload["wall_s"] = time.perf_counter() - started
    (args.out / "fleet.json").write_text(json.dumps(payload, indent=2, default=str))
    _log(f"wrote {args.out / 'fleet.md'} in {payload['wall_s']:.0f} s")
    return 0


__all__ = ["RequestResult", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
