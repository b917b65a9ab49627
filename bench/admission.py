"""Admission benchmarks: the noisy neighbour, the overload comparison, and what admission costs.

Each scenario starts its own stand-ins (`python -m backends.sim`, the H100 profile) and one edge
(`quicedge serve --http`, a TOML file with the tenants), then drives them from this process with
lean raw-socket HTTP/1.1 clients that stream `/v1/completions`. TTFT is the client's: from its
connect to the first `data:` event. Numbers go to `bench-out/admission/report.{json,md}`.

    python -m bench.admission [--duration 20] [--redis redis://127.0.0.1:6379/0]

- **noisy**: a gold tenant at a steady rate, alone and then with a bronze tenant sending 10x its
  quota (from a second client process); gold's TTFT p50/p99 in both phases, and what bronze got.
- **overload**: 100 closed-loop clients against two stand-ins with a small KV pool that retract
  when running requests outgrow it; the token bucket alone against the bucket plus the
  queue-depth throttle and the admission queue: TTFT p50/p99, statuses, retractions.
- **cost**: `Admission.admit` in-process for a limited tenant, memory store (and Redis when
  `--redis` is given): p50/p99 per call.

A benchmark, not a test: it reports numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from bench.children import free_port
from bench.summary import nearest_rank

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray"
).split()
ROOT = Path(__file__).resolve().parent.parent


def _wait_tcp(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"child exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout}s")


@dataclass
class Fleet:
    """Stand-ins and one edge, as child processes."""

    edge_port: int
    admin_port: int
    sims: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


@contextlib.contextmanager
def fleet(
    out: Path,
    toml: str,
    *,
    sims: int,
    sim_args: Sequence[str],
    tiers: Sequence[str] = (),
) -> Iterator[Fleet]:
    """`sims` stand-ins and one edge; `tiers[i]`, when given, is the tiers stand-in i serves
    (its backend URL's `#tiers=`)."""
    procs: list[subprocess.Popen[bytes]] = []
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        ports = []
        for i in range(sims):
            port = free_port()
            cmd = [sys.executable, "-m", "backends.sim", "--port", str(port), "--name", f"s{i}",
                   "--profile", "h100-llama3-8b", "--enable-metrics", *sim_args]  # fmt: skip
            log = (logs / f"sim{i}.log").open("wb")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
            ports.append(port)
        for port, proc in zip(ports, procs, strict=True):
            _wait_tcp(port, proc)
        config = out / "edge.toml"
        config.write_text(toml)
        edge, admin = free_port(), free_port()
        cmd = [sys.executable, "-m", "edge.cli", "serve", "--http", f"127.0.0.1:{edge}",
               "--admin", f"127.0.0.1:{admin}", "--tcp", "off", "--h3", f"127.0.0.1:{free_port()}",
               "--config", str(config), "--policy", "least_load", "--loads-interval", "0.1",
               *(x for i, p in enumerate(ports)
                 for x in ("--backend", f"http://127.0.0.1:{p}" + _tiers(tiers, i)))]  # fmt: skip
        log = (logs / "edge.log").open("wb")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        _wait_tcp(edge, procs[-1])
        time.sleep(0.5)  # first health checks and load polls
        yield Fleet(edge, admin, ports, procs)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _tiers(tiers: Sequence[str], i: int) -> str:
    return f"#tiers={tiers[i]}" if i < len(tiers) and tiers[i] else ""


@dataclass
class Result:
    status: int
    ttft: float | None
    total: float
    whole: bool = True
    """False for a 200 whose stream ended (closed, failed, timed out) before `[DONE]`."""


def completion_body(rng: random.Random, words: int, max_tokens: int) -> bytes:
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    return json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()  # fmt: skip


@dataclass
class Streamed:
    """What one streamed completion came back with, as far as it got."""

    status: int = 0
    ttft: float | None = None
    whole: bool = False
    """A 200 whose stream ended with `[DONE]`."""
    error: bytes = b""
    """The first 4 KiB of an answer that was not 200."""


async def stream_completion(
    port: int, body: bytes, key: str | None, into: Streamed, *, source: str | None = None
) -> None:
    """POST a streamed `/v1/completions` on a fresh connection (from `source`, an address of
    this host, when given), filling `into` as it goes so that a caller's timeout keeps what came;
    TTFT runs from the call to the first `data:` event. Raises what the socket raises."""
    t0 = time.perf_counter()
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{auth}\r\n").encode()  # fmt: skip
    local = (source, 0) if source else None
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=local)
    try:
        writer.write(head + body)
        raw = await reader.readuntil(b"\r\n\r\n")
        into.status = int(raw[9:12])
        tail = b""
        while chunk := await reader.read(65536):
            if into.status != 200:
                if len(into.error) < 4096:
                    into.error += chunk
                continue
            if into.ttft is None and b"data: " in chunk:
                into.ttft = time.perf_counter() - t0
            tail = (tail + chunk)[-64:]
            if b"[DONE]" in tail:
                into.whole = True
                return
    finally:
        writer.close()


async def request(port: int, body: bytes, key: str | None, timeout: float = 120.0) -> Result:
    """One streamed completion on a fresh connection; TTFT at the first `data:` event."""
    t0 = time.perf_counter()
    got = Streamed()
    try:
        async with asyncio.timeout(timeout):
            await stream_completion(port, body, key, got)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
        got.status = got.status or -1
    return Result(got.status, got.ttft, time.perf_counter() - t0, got.whole or got.status != 200)


async def open_loop(
    port: int, key: str | None, rate: float, duration: float, *, seed: int, words: int,
    max_tokens: int,
) -> list[Result]:  # fmt: skip
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks = []
    for i in range(int(rate * duration)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(
            asyncio.ensure_future(request(port, completion_body(rng, words, max_tokens), key))
        )
    return list(await asyncio.gather(*tasks))


def _open_loop_process(
    port: int, key: str, rate: float, duration: float, seed: int, shape: dict[str, int]
) -> tuple[list[Result], float]:
    """The results, and the CPU seconds this client process spent."""
    cpu = time.process_time()
    results = asyncio.run(open_loop(port, key, rate, duration, seed=seed, **shape))
    return results, time.process_time() - cpu


def _ready() -> None:
    """Called once in the neighbour's process, so that it has imported this module."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (`/proc/PID/stat`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def buckets(port: int, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts from the edge's `/metrics`, summed over labels."""
    import httpx

    found: dict[float, float] = {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            found[bound] = found.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket that holds quantile `q` of what was observed between two
    snapshots (seconds; inf past the last bound)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if total and count >= q * total:
            return bound
    return float("nan")


@dataclass
class Watched:
    """CPU of the fleet's processes and the edge's loop delay, between two moments."""

    edge_pid: int
    sim_pids: list[int]
    admin_port: int
    t: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    read_delay: dict[float, float] = field(default_factory=dict)
    edge_added: dict[float, float] = field(default_factory=dict)

    def mark(self) -> Watched:
        here = Watched(self.edge_pid, self.sim_pids, self.admin_port, time.perf_counter())
        here.cpu = {
            "edge": cpu_seconds(self.edge_pid),
            "stand_ins": sum(cpu_seconds(p) for p in self.sim_pids),
            "gold_client": time.process_time(),
        }
        here.read_delay = buckets(self.admin_port, "quicedge_loop_read_delay_seconds")
        here.edge_added = buckets(self.admin_port, "quicedge_edge_added_seconds")
        return here

    def add_since(self, start: Watched, into: dict[str, Any]) -> None:
        """Add what happened between `start` and this mark to a phase's totals."""
        into["seconds"] = into.get("seconds", 0.0) + self.t - start.t
        cpu = into.setdefault("cpu", {})
        for key, value in self.cpu.items():
            cpu[key] = cpu.get(key, 0.0) + value - start.cpu[key]
        for name in ("read_delay", "edge_added"):
            counts = into.setdefault(name, {})
            now, then = getattr(self, name), getattr(start, name)
            for bound, value in now.items():
                counts[bound] = counts.get(bound, 0.0) + value - then.get(bound, 0.0)


def phase_report(totals: dict[str, Any]) -> dict[str, Any]:
    seconds = totals["seconds"]
    ms = 1000.0
    return {
        "cpu_per_s": {k: round(v / seconds, 3) for k, v in totals["cpu"].items()},
        "edge_cpu_s": round(totals["cpu"]["edge"], 2),
        "loop_read_delay_p99_ms_at_most": bucket_quantile({}, totals["read_delay"], 0.99) * ms,
        "edge_added_p99_ms_at_most": bucket_quantile({}, totals["edge_added"], 0.99) * ms,
    }


async def closed_loop(
    port: int, key: str | None, clients: int, duration: float, *, words: int, max_tokens: int
) -> list[Result]:
    deadline = time.perf_counter() + duration
    results: list[Result] = []

    async def client(i: int) -> None:
        rng = random.Random(i)
        while time.perf_counter() < deadline:
            r = await request(port, completion_body(rng, words, max_tokens), key)
            results.append(r)
            if r.status != 200:
                await asyncio.sleep(0.2)  # a refused client backs off a little, then retries

    await asyncio.gather(*(client(i) for i in range(clients)))
    return results


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, q in 0..1; None for no values."""
    return nearest_rank(values, q * 100)


def summary(results: list[Result]) -> dict[str, Any]:
    ttfts = [r.ttft for r in results if r.ttft is not None]
    statuses: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.whole else f"{r.status} cut short"
        statuses[key] = statuses.get(key, 0) + 1
    ms = 1000.0
    return {
        "requests": len(results),
        "statuses": dict(sorted(statuses.items())),
        "ttft_p50_ms": None if not ttfts else round(statistics.median(ttfts) * ms, 1),
        "ttft_p99_ms": None if not ttfts else round((percentile(ttfts, 0.99) or 0) * ms, 1),
    }


def _loads(port: int) -> dict[str, Any]:
    import httpx

    return dict(httpx.get(f"http://127.0.0.1:{port}/v1/loads", timeout=5).json()["loads"][0])


TENANTS = """
[[tenants]]
name = "gold"
tier = "gold"
api_key_sha256 = ["{gold}"]

[[tenants]]
name = "bronze"
tier = "bronze"
api_key_sha256 = ["{bronze}"]
requests_per_second = {bronze_rps}
burst = {bronze_burst}
"""


def _digest(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


async def noisy(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    toml = "[admission.anonymous]\nenabled = false\n" + TENANTS.format(
        gold=_digest("sk-gold"), bronze=_digest("sk-bronze"), bronze_rps=args.bronze_rps,
        bronze_burst=int(args.bronze_rps),
    )  # fmt: skip
    shape = {"words": 40, "max_tokens": 32}
    rate = args.bronze_rps * args.bronze_times
    block = args.duration / args.blocks
    alone: list[Result] = []
    gold: list[Result] = []
    bronze: list[Result] = []
    bronze_cpu = 0.0
    totals: dict[str, dict[str, Any]] = {"alone": {}, "with_neighbour": {}}
    # With --tier-backends, the isolation domains' way: gold's two stand-ins serve gold only,
    # and bronze gets a third of its own.
    tiers = ("gold", "gold", "bronze") if args.tier_backends else ()
    with fleet(out / "noisy", toml, sims=len(tiers) or 2, sim_args=[], tiers=tiers) as f:
        mark = Watched(f.procs[-1].pid, [p.pid for p in f.procs[:-1]], f.admin_port).mark()
        # The neighbour is another client machine: its load comes from a process of its own,
        # so that its connections do not slow this process's gold clients.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            # The worker starts (a Python process importing this module: a CPU burst that
            # would land on the first gold requests beside it) before anything is measured.
            pool.apply(_ready)
            # The phases alternate in blocks (alone, neighbour, neighbour, alone, ...), so that
            # the shared machine's load, which drifts over minutes, weighs on both alike.
            for i in range(args.blocks):
                order = ("alone", "with_neighbour")[:: 1 if i % 2 == 0 else -1]
                for phase in order:
                    seed = 2 * i + (phase == "with_neighbour")
                    if phase == "alone":
                        alone += await open_loop(f.edge_port, "sk-gold", args.gold_rps, block,
                                                 seed=seed, **shape)  # fmt: skip
                    else:
                        pending = pool.apply_async(
                            _open_loop_process,
                            (f.edge_port, "sk-bronze", rate, block, 100 + i, shape),
                        )
                        gold += await open_loop(f.edge_port, "sk-gold", args.gold_rps, block,
                                                seed=seed, **shape)  # fmt: skip
                        got, cpu = await asyncio.get_running_loop().run_in_executor(
                            None, pending.get, 600
                        )
                        bronze += got
                        bronze_cpu += cpu
                    here = mark.mark()
                    here.add_since(mark, totals[phase])
                    mark = here
    phases = {name: phase_report(t) for name, t in totals.items()}
    phases["with_neighbour"]["cpu_per_s"]["bronze_client"] = round(
        bronze_cpu / totals["with_neighbour"]["seconds"], 3
    )
    refused = sum(1 for r in bronze if r.status == 429)
    extra = phases["with_neighbour"]["edge_cpu_s"] - phases["alone"]["edge_cpu_s"]
    a, g = summary(alone), summary(gold)
    ratio = None
    if a["ttft_p99_ms"] and g["ttft_p99_ms"]:
        ratio = round(g["ttft_p99_ms"] / a["ttft_p99_ms"], 3)
    return {
        "gold_alone": a,
        "gold_with_neighbour": g,
        "bronze": summary(bronze),
        "gold_p99_ratio": ratio,
        "phases": phases,
        "edge_cpu_ms_per_bronze_request": round(1000 * extra / max(1, len(bronze)), 3),
        "bronze_refused": refused,
        "gold_rps": args.gold_rps,
        "bronze_quota_rps": args.bronze_rps,
        "bronze_times": args.bronze_times,
        "blocks": args.blocks,
        "tier_backends": args.tier_backends,
    }


async def overload(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    base = (
        '[admission.anonymous]\nenabled = false\n[[tenants]]\nname = "load"\ntier = "silver"\n'
        f'api_key_sha256 = ["{_digest("sk-load")}"]\n'
        f"requests_per_second = {args.bucket_rps}\nburst = {int(args.bucket_rps)}\n"
    )
    throttle = (
        f'[admission.throttle]\nmax_queue_depth = {args.max_depth}\ndepth = "in_flight"\n'
        f"queue_size = {args.queue_size}\nqueue_timeout_s = {args.queue_timeout}\n"
    )
    sim_args = ["--kv-tokens", str(args.kv_tokens), "--new-token-ratio", "0.7"]
    shape = {"words": 60, "max_tokens": 128}
    runs: dict[str, Any] = {}
    for name, toml in (("bucket_alone", base), ("both_tracks", throttle + base)):
        with fleet(out / name, toml, sims=2, sim_args=sim_args) as f:
            results = await closed_loop(f.edge_port, "sk-load", args.clients, args.duration,
                                        **shape)  # fmt: skip
            loads = [_loads(p) for p in f.sims]
        retractions = sum(int(x.get("num_retracted_reqs", 0)) for x in loads)
        runs[name] = {**summary(results), "retractions": retractions}
    return {"clients": args.clients, "kv_tokens": args.kv_tokens, "bucket_rps": args.bucket_rps,
            "max_depth": args.max_depth, "queue_size": args.queue_size,
            "queue_timeout": args.queue_timeout, **runs}  # fmt: skip


async def cost(args: argparse.Namespace) -> dict[str, Any]:
    from backends.registry import Backend
    from edge.admission import Admission
    from edge.admission.settings import AdmissionSettings, RedisSettings, TenantSettings
    from edge.exchange import Exchange, RequestHeaders
    from edge.routing.base import RequestView
    from edge.telemetry import Metrics

    del Backend
    out: dict[str, Any] = {}
    stores = [("memory", None)] + ([("redis", args.redis)] if args.redis else [])
    for name, url in stores:
        settings = AdmissionSettings(
            redis=RedisSettings(url=url, timeout_ms=50.0, slow_ms=50.0),
            tenants=[TenantSettings(name="t", tier="gold", api_key_sha256=[_digest("k")],
                                    requests_per_second=1e9, burst=10**9,
                                    tokens_per_minute=10**12)],
        )  # fmt: skip
        admission = Admission(settings, metrics=Metrics(CollectorRegistry()))
        tenant = admission.identify(b"Bearer k")
        view = RequestView(route="/v1/completions", text="x", approx_tokens=100)
        times = []
        for _ in range(args.cost_calls):
            ex = Exchange(route="/v1/completions", t0=0.0, transport="h1", early_data=False,
                          handshake_wait=0.0, request_id="r", headers=RequestHeaders(),
                          trace=None, view=view)  # fmt: skip
            t = time.perf_counter()
            who = admission.identify(b"Bearer k")
            await admission.admit(ex, who)
            admission.finish(ex, 10)
            times.append(time.perf_counter() - t)
        await admission.aclose()
        del tenant
        us = 1e6
        out[name] = {"calls": len(times), "p50_us": round(statistics.median(times) * us, 1),
                     "p99_us": round((percentile(times, 0.99) or 0) * us, 1)}  # fmt: skip
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = ["# Admission benchmark", "", f"Command: `{report['command']}`", ""]
    n = report.get("noisy")
    if n:
        lines += ["## Noisy neighbour", "",
                  f"gold at {n['gold_rps']} req/s; bronze quota {n['bronze_quota_rps']} req/s, "
                  f"sent at {n['bronze_times']}x; the phases alternate in {n['blocks']} blocks "
                  "each" + ("; gold on two stand-ins of its own, bronze on a third"
                            if n.get("tier_backends") else "") + ".", "",
                  "| phase | requests | statuses | TTFT p50 ms | TTFT p99 ms |",
                  "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for key in ("gold_alone", "gold_with_neighbour", "bronze"):
            s = n[key]
            lines.append(f"| {key} | {s['requests']} | {s['statuses']} | {s['ttft_p50_ms']} | "
                         f"{s['ttft_p99_ms']} |")  # fmt: skip
        lines += ["", f"gold p99 with / without the neighbour: {n['gold_p99_ratio']}", "",
                  "| phase | CPU s/s per process | edge loop read delay p99 ≤ ms | "
                  "edge-added p99 ≤ ms |", "| --- | --- | --- | --- |"]  # fmt: skip
        for key, ph in n["phases"].items():
            lines.append(f"| {key} | {ph['cpu_per_s']} | {ph['loop_read_delay_p99_ms_at_most']} "
                         f"| {ph['edge_added_p99_ms_at_most']} |")  # fmt: skip
        lines += ["", "Edge CPU per bronze request (the neighbour phase's extra edge CPU over "
                  f"bronze's requests): {n['edge_cpu_ms_per_bronze_request']} ms.", ""]  # fmt: skip
    o = report.get("overload")
    if o:
        lines += ["## Overload", "",
                  f"{o['clients']} closed-loop clients, 2 stand-ins with {o['kv_tokens']} KV "
                  f"tokens each (new_token_ratio 0.7), bucket {o['bucket_rps']} req/s; "
                  f"throttle: in-flight depth max {o['max_depth']} per backend, admission queue "
                  f"{o['queue_size']} deep with a {o['queue_timeout']} s deadline.", "",
                  "| run | requests | statuses | TTFT p50 ms | TTFT p99 ms | retractions |",
                  "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for key in ("bucket_alone", "both_tracks"):
            s = o[key]
            lines.append(f"| {key} | {s['requests']} | {s['statuses']} | {s['ttft_p50_ms']} | "
                         f"{s['ttft_p99_ms']} | {s['retractions']} |")  # fmt: skip
        lines.append("")
    c = report.get("cost")
    if c:
        lines += ["## Cost of identify + admit + finish (in-process)", "",
                  "| store | calls | p50 µs | p99 µs |", "| --- | --- | --- | --- |"]  # fmt: skip
        for key, s in c.items():
            lines.append(f"| {key} | {s['calls']} | {s['p50_us']} | {s['p99_us']} |")
        lines.append("")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    command = shlex.join(["python", "-m", "bench.admission", *args.argv])
    report: dict[str, Any] = {"command": command}
    if "cost" in args.scenarios:
        report["cost"] = await cost(args)
    if "noisy" in args.scenarios:
        report["noisy"] = await noisy(args, out)
    if "overload" in args.scenarios:
        report["overload"] = await overload(args, out)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.admission", description=__doc__.split("\n")[0]
    )
    p.add_argument("--scenarios", nargs="+", default=["cost", "noisy", "overload"],
                   choices=["cost", "noisy", "overload"])  # fmt: skip
    p.add_argument("--duration", type=float, default=20.0, help="seconds per phase (20)")
    p.add_argument("--gold-rps", type=float, default=8.0)
    p.add_argument("--bronze-rps", type=float, default=5.0, help="bronze quota; it sends 10x")
    p.add_argument("--bronze-times", type=float, default=10.0,
                   help="bronze sends this many times its quota (10)")  # fmt: skip
    p.add_argument("--blocks", type=int, default=6,
                   help="noisy: alternate the two phases in this many blocks each (6)")  # fmt: skip
    p.add_argument("--tier-backends", action="store_true",
                   help="noisy: gold's two stand-ins serve gold only; bronze has one")  # fmt: skip
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--kv-tokens", type=int, default=4000)
    p.add_argument("--bucket-rps", type=float, default=60.0)
    p.add_argument("--max-depth", type=int, default=20, help="throttle depth per backend (20)")
    p.add_argument("--queue-size", type=int, default=256, help="admission queue bound (256)")
    p.add_argument("--queue-timeout", type=float, default=30.0, help="queue deadline, s (30)")
    p.add_argument("--cost-calls", type=int, default=5000)
    p.add_argument("--redis", default=os.environ.get("QUICEDGE_BENCH_REDIS_URL"))
    p.add_argument("--out", default="bench-out/admission")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = asyncio.run(main_async(args))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
