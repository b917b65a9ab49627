"""`quicedge bench`: a TTFT load generator over HTTP/3 (optionally 0-RTT), HTTP/2 and HTTP/1.1.

    quicedge bench --url https://localhost:8443/v1/chat/completions --cacert certs/dev/ca.pem \\
        --transport h3 --0rtt --workload gsp --num 200 --concurrency 4 \\
        --output runs.jsonl --summary-json summary.json
    quicedge bench --url ... --rtt-ms 50 --compare h3+0rtt h3 h2 h1 --plots plots/
    quicedge bench relay --udp 4433:127.0.0.1:8443 --rtt-ms 50      (see `bench relay --help`)

TTFT is measured as sglang.bench_serving does: from just before the connection is opened (or
reused) to the first streamed event with generated text; see bench/stream.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from bench import edge_cpu, relay_cli
from bench.clients import ClientError, ClientOptions, Target
from bench.loop import run
from bench.request import cacert_problem
from bench.rtt_relay import Forward, Link, Relay, RelayError
from bench.runner import BenchConfig, Progress, Runner, RunPlan
from bench.summary import format_table, summarize
from bench.turns import by_turn, format_turns
from bench.workloads import WORKLOADS, WorkloadError, WorkloadParams, make_workload

CLIENT_BUSY_WARNING = 0.9  # of one core: above it, the client may be the bottleneck


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quicedge bench",
        description="TTFT load generator (HTTP/3 with optional 0-RTT, HTTP/2, HTTP/1.1). "
        "`quicedge bench relay --help` for the RTT emulator.",
    )
    p.add_argument("--url", required=True, help="e.g. https://localhost:8443/v1/chat/completions")
    p.add_argument("--transport", choices=("h3", "h2", "h1"), help="default: h3 for https, else h1")
    p.add_argument(
        "--0rtt", dest="zero_rtt", action="store_true",
        help="h3: resume with saved tickets so each request rides in early data",
    )  # fmt: skip
    p.add_argument(
        "--new-connection-per-request", action="store_true",
        help="open a new connection for every request (TTFT then includes the handshake)",
    )  # fmt: skip
    p.add_argument(
        "--compare", nargs="+", metavar="SPEC",
        help="several configurations in one run, interleaved: [NAME=]h3|h2|h1[+0rtt][+reuse|+new]"
        "[+stored][+cache][@URL] (+stored: the edge keeps chat sessions; +cache: ask for the "
        "response cache)",
    )  # fmt: skip
    p.add_argument("--workload", default="gsp", choices=WORKLOADS)
    p.add_argument("--num", type=int, default=16, help="requests per configuration")
    p.add_argument("--rate", type=float, help="Poisson arrivals per second (default: back to back)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at most")
    p.add_argument("--duration", type=float, help="stop starting requests after this many seconds")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded requests per configuration")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output", type=Path, help="write one JSON line per request")
    p.add_argument("--summary-json", type=Path, help="write the summary as JSON")
    p.add_argument("--plots", type=Path, metavar="DIR", help="write PNG plots (needs matplotlib)")
    p.add_argument("--cacert", help="CA certificate to verify the server with")
    p.add_argument("--insecure", action="store_true", help="do not verify certificates")
    p.add_argument("--server-name", help="TLS name when it differs from the URL host")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--rtt-ms", type=float, help="put an in-process RTT relay in front of the URL")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="relay jitter (with --rtt-ms)")
    p.add_argument("--loss", type=float, default=0.0, help="relay UDP loss (with --rtt-ms)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument(
        "--turns", type=int, nargs="+", metavar="N",
        help="also print request bytes and TTFT at these turns (from 1) of multi-turn sessions",
    )  # fmt: skip
    p.add_argument(
        "--edge-pid", type=int, action="append", metavar="PID",
        help="report the CPU per request of this edge process (repeat for workers); default: "
        "the processes holding the target's port, when the target is on this machine",
    )  # fmt: skip
    p.add_argument(
        "--edge-cpu", action=argparse.BooleanOptionalAction, default=True,
        help="read the edge's CPU time from /proc (default: on)",
    )  # fmt: skip
    w = p.add_argument_group("workload parameters (tokens are words; see bench/workloads.py)")
    defaults = WorkloadParams()
    w.add_argument("--output-len", type=int, default=defaults.output_len)
    w.add_argument("--gsp-groups", type=int, default=defaults.gsp_groups)
    w.add_argument("--gsp-prompts-per-group", type=int, default=defaults.gsp_prompts_per_group)
    w.add_argument("--gsp-system-len", type=int, default=defaults.gsp_system_len)
    w.add_argument("--gsp-question-len", type=int, default=defaults.gsp_question_len)
    w.add_argument("--gsp-ordered", action="store_true", help="do not shuffle")
    w.add_argument("--chat-turns", type=int, default=defaults.chat_turns)
    w.add_argument("--chat-system-len", type=int, default=defaults.chat_system_len)
    w.add_argument("--chat-turn-len", type=int, default=defaults.chat_turn_len)
    w.add_argument("--random-input-len", type=int, default=defaults.random_input_len)
    w.add_argument("--random-range-ratio", type=float, default=defaults.random_range_ratio)
    w.add_argument("--replay-file", type=Path, help="JSONL file for --workload replay")
    return p


def _configs(args: argparse.Namespace, scheme: str) -> list[BenchConfig]:
    if args.compare:
        new = args.new_connection_per_request
        configs = [BenchConfig.parse(spec, new_connection=new) for spec in args.compare]
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ClientError(f"--compare names must be unique, got {', '.join(names)}")
        return configs
    transport = args.transport or ("h3" if scheme == "https" else "h1")
    if args.zero_rtt and transport != "h3":
        raise ClientError("--0rtt needs --transport h3")
    name = transport + ("+0rtt" if args.zero_rtt else "")
    # Every request in early data needs a new connection each time.
    new = args.new_connection_per_request or args.zero_rtt
    return [BenchConfig(name, transport, args.zero_rtt, new)]


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be > 0")
    if args.duration is not None and args.duration <= 0:
        parser.error("--duration must be > 0")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    if args.rtt_ms is None and (args.jitter_ms or args.loss):
        parser.error("--jitter-ms and --loss need --rtt-ms")
    problem = cacert_problem(args.cacert) if args.cacert else None
    if problem is not None:
        parser.error(f"--cacert {args.cacert}: {problem}")


def _check_outputs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The files the run writes, tried before it starts: one that cannot be written ended a
    finished run (minutes of it) with a traceback and its results lost."""
    for flag, path in (("--output", args.output), ("--summary-json", args.summary_json)):
        if path is None:
            continue
        existed = path.exists()
        try:
            with path.open("a"):
                pass
        except OSError as exc:
            parser.error(f"{flag} {path}: {exc.strerror}")
        if not existed:
            path.unlink(missing_ok=True)
    if args.plots is not None:
        try:
            args.plots.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--plots {args.plots}: {exc.strerror}")


def main(argv: list[str]) -> int:
    if argv and argv[0] == "relay":
        return relay_cli.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    _check_outputs(args, parser)
    try:
        url = Target.parse(args.url, server_name=args.server_name)
        configs = _configs(args, url.scheme)
        for config in configs:
            target = Target.parse(config.url or args.url)
            if config.transport in ("h3", "h2") and target.scheme != "https":
                raise ClientError(f"{config.name}: {config.transport} needs an https:// URL")
            if config.stored and not target.path.endswith("/chat/completions"):
                # found before the run: from inside it, a traceback after the warm-up
                raise ClientError(f"{config.name}: +stored needs a /v1/chat/completions URL")
        params = WorkloadParams(
            num=args.num,
            seed=args.seed,
            output_len=args.output_len,
            gsp_groups=args.gsp_groups,
            gsp_prompts_per_group=args.gsp_prompts_per_group,
            gsp_system_len=args.gsp_system_len,
            gsp_question_len=args.gsp_question_len,
            gsp_ordered=args.gsp_ordered,
            chat_turns=args.chat_turns,
            chat_system_len=args.chat_system_len,
            chat_turn_len=args.chat_turn_len,
            random_input_len=args.random_input_len,
            random_range_ratio=args.random_range_ratio,
            replay_file=args.replay_file,
        )
        sessions = make_workload(args.workload, params)
        link = Link(args.rtt_ms, args.jitter_ms, args.loss) if args.rtt_ms is not None else None
    except (ClientError, WorkloadError, RelayError) as exc:
        parser.error(str(exc))
    plan = RunPlan(
        configs=tuple(configs),
        url=args.url,
        sessions=tuple(sessions),
        rate=args.rate,
        concurrency=args.concurrency,
        duration=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        options=ClientOptions(
            cacert=args.cacert,
            insecure=args.insecure,
            server_name=args.server_name,
            timeout=args.timeout,
        ),
        workload=args.workload,
    )
    return run(_bench(plan, args, link, "quicedge bench " + shlex.join(argv)))


async def _start_relay(plan: RunPlan, link: Link, server_name: str | None) -> tuple[Relay, RunPlan]:
    """Start one relay forward per distinct (protocol, host, port) the configurations talk to,
    and point each configuration at its forward (keeping the TLS name of the real target)."""
    targets = {
        c.name: Target.parse(c.url or plan.url, server_name=server_name) for c in plan.configs
    }
    kinds = {c.name: "udp" if c.transport == "h3" else "tcp" for c in plan.configs}
    wanted = sorted({(kinds[n], t.host, t.port) for n, t in targets.items()})
    relay = Relay(
        link,
        udp=[Forward("127.0.0.1", 0, h, p) for k, h, p in wanted if k == "udp"],
        tcp=[Forward("127.0.0.1", 0, h, p) for k, h, p in wanted if k == "tcp"],
    )
    await relay.start()
    ports = {
        ("udp", r.forward.target_host, r.forward.target_port): r.port for r in relay.udp_relays
    }
    ports |= {
        ("tcp", r.forward.target_host, r.forward.target_port): r.port for r in relay.tcp_relays
    }
    relayed = {
        name: replace(t, host="127.0.0.1", port=ports[(kinds[name], t.host, t.port)])
        for name, t in targets.items()
    }
    return relay, replace(plan, targets=relayed)


def _edge_cpu(plan: RunPlan, args: argparse.Namespace) -> edge_cpu.EdgeCpu | None:
    """The edge's processes, given or found by the targets' ports; None when not on this host."""
    if not args.edge_cpu:
        return None
    if args.edge_pid:
        return edge_cpu.EdgeCpu(sorted(set(args.edge_pid)))
    pids: set[int] = set()
    for config in plan.configs:
        target = Target.parse(config.url or plan.url)
        if not edge_cpu.is_local(target.host):
            return None
        kind = "udp" if config.transport == "h3" else "tcp"
        pids.update(edge_cpu.find_edge(target.port, [kind]))
    pids.discard(os.getpid())
    return edge_cpu.EdgeCpu(sorted(pids)) if pids else None


async def _bench(plan: RunPlan, args: argparse.Namespace, link: Link | None, command: str) -> int:
    edge = _edge_cpu(plan, args)
    relay: Relay | None = None
    if link is not None:
        relay, plan = await _start_relay(plan, link, args.server_name)
    out: TextIO | None = args.output.open("w") if args.output else None
    records: list[dict[str, Any]] = []

    def on_record(rec: dict[str, Any]) -> None:
        records.append(rec)
        if out is not None:
            out.write(json.dumps(rec) + "\n")
            out.flush()

    total = sum(len(s.turns) for s in plan.sessions) * len(plan.configs)
    progress = Progress(total, enabled=args.progress)
    runner = Runner(plan, on_record=on_record, progress=progress)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    interrupted = False
    client_cpu = 0.0  # CPU seconds of this process during the measured run
    try:
        try:
            for error in await runner.warm_up():
                print(f"warm-up failed: {error}", file=sys.stderr)
            if edge is not None:
                edge.start()
            cpu_started = time.process_time()
            try:
                await runner.run()
            finally:
                client_cpu = time.process_time() - cpu_started
            if edge is not None:
                edge.stop()
        except asyncio.CancelledError:
            # Ctrl-C (asyncio.Runner cancels this task): report the requests that finished, as
            # a traceback lost them all; a second Ctrl-C still stops at once.
            interrupted = True
    finally:
        progress.close()
        await runner.aclose()
        if relay is not None:
            await relay.stop()
        if out is not None:
            out.close()
    if interrupted:
        print(f"quicedge bench: interrupted after {len(records)} requests", file=sys.stderr)
        if not records:
            return 130
    duration = runner.ended - runner.started
    summary = summarize(records, duration_s=duration)
    # This one process sends, reads and times every request (and runs the --rtt-ms relay): near
    # a whole core, its own CPU, not the server, may have set the pace and the latencies.
    client_busy = client_cpu / duration if duration > 0 else 0.0
    header = (
        f"workload {plan.workload}: {len(records)} requests in {duration:.2f} s, "
        f"concurrency {plan.concurrency} ({runner.peak_in_flight} reached), "
        f"rate {plan.rate or 'max'}, "
        f"client CPU {client_busy:.0%} of a core"
        + (f", emulated RTT {link.rtt_ms:g} ms" if link is not None else "")
    )
    print(header)
    if client_busy >= CLIENT_BUSY_WARNING:
        print(
            f"quicedge bench: the client used {client_busy:.0%} of a core: its own CPU may have "
            "set the pace; lower --concurrency or split the load over several clients",
            file=sys.stderr,
        )
    print(format_table(summary))
    turn_rows = by_turn(records, args.turns) if args.turns else None
    if turn_rows is not None:
        print(format_turns(turn_rows))
    cpu = None if edge is None or interrupted else edge.report(len(records))
    if cpu is not None:
        print(edge_cpu.describe(cpu))
    if args.summary_json:
        document: dict[str, Any] = {
            "run": {
                "command": command,
                "started_at": started_at,
                "host": socket.gethostname(),
                "url": plan.url,
                "workload": plan.workload,
                "num": args.num,
                "rate": plan.rate,
                "concurrency": plan.concurrency,
                "concurrency_reached": runner.peak_in_flight,
                "rtt_ms": None if link is None else link.rtt_ms,
                "configs": [c.name for c in plan.configs],
                "duration_s": duration,
                "client_cpu_busy": client_busy,
                "interrupted": interrupted,
            },
            "summary": summary,
        }
        if turn_rows is not None:
            document["turns"] = turn_rows
        if cpu is not None:
            document["edge_cpu"] = cpu
        args.summary_json.write_text(json.dumps(document, indent=2) + "\n")
    if args.plots:
        from bench.plots import write_plots

        try:
            for path in await asyncio.to_thread(write_plots, records, args.plots):
                print(f"wrote {path}")
        except RuntimeError as exc:
            print(f"quicedge bench: {exc}", file=sys.stderr)
            return 2
    if interrupted:
        return 130
    ok = records and all(s["completed"] > 0 for s in summary.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
