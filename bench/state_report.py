"""Stored conversations and the response cache, measured over HTTP/3 with 0-RTT.

    python -m bench.state_report --rtt-ms 50 --sessions 6 --out bench-out/state

It starts the stand-in, `quicedge serve` in front of it (response cache allowed for every tenant)
and the instant stub app on the edge's own H3 listener (the transport's floor), then runs
`quicedge bench` twice:

1. multi-turn chats (`--workload chat`, `--chat-turns 20`, 400 words or ~2.4 kB per user turn),
   full-history resend (`full=h3+0rtt`) against stored conversations (`stored=h3+0rtt+stored`),
   interleaved, through the RTT relay; it reports request bytes and TTFT at turns 10 and 20;
2. one repeated greedy request through the edge with `+cache` (every request after the first is an
   L1 hit) against the stub over the same transport, at no added RTT and at `--rtt-ms`.

Each run's command, JSON lines and summary are written under `--out`, and `report.md` there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from bench.loop import run
from bench.transport_report import free_port, spawn_module, stand_in, stub_listener
from bench.turns import _percentile
from certs import DevCertificates, ensure_dev_certificates

ROUTE = "/v1/chat/completions"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.state_report", description=__doc__)
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--sessions", type=int, default=6, help="chats per configuration")
    p.add_argument("--turns", type=int, default=20, help="turns per chat")
    p.add_argument("--turn-words", type=int, default=400, help="words per user turn (~6 B each)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--cache-num", type=int, default=40, help="requests per cache configuration")
    p.add_argument("--sim-profile", default="instant")
    p.add_argument("--out", type=Path, default=Path("bench-out/state"))
    p.add_argument("--no-turns", action="store_true", help="skip the multi-turn run")
    p.add_argument(
        "--redis", metavar="URL",
        help="also run a second edge process sharing this Redis, and read L2 hits through it",
    )  # fmt: skip
    return p


async def _bench(tag: str, args: argparse.Namespace, certs: DevCertificates, *extra: str) -> Any:
    out, summary = args.out / f"{tag}.jsonl", args.out / f"{tag}.summary.json"
    command = [sys.executable, "-m", "bench.cli", "--cacert", str(certs.ca_cert),
               "--no-progress", "--output", str(out), "--summary-json", str(summary),
               *extra]  # fmt: skip
    shown = " ".join(command[3:]).replace(str(certs.ca_cert), "CA.pem")
    print(f"$ quicedge bench {shown}", flush=True)
    (args.out / f"{tag}.command").write_text(f"quicedge bench {shown}\n")
    proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    stdout, _ = await proc.communicate()
    print(stdout.decode(), flush=True)
    if not summary.exists():
        raise RuntimeError(f"bench run {tag} failed (exit {proc.returncode})")
    return json.loads(summary.read_text())


async def _main(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    certs = ensure_dev_certificates(Path(tempfile.mkdtemp(prefix="quicedge-state-")))
    toml = args.out / "edge.toml"
    table = '[state.cache]\nallow_tenants = ["*"]\n'
    if args.redis:
        prefix = f"quicedge-bench:{os.getpid()}:"
        table = (
            f'[state]\nstore = "redis"\nredis_url = "{args.redis}"\nkey_prefix = "{prefix}"\n\n'
            + table
        )
    toml.write_text(table)
    async with AsyncExitStack() as stack:
        sim_url = await stand_in(stack, args.sim_profile)
        edges = []
        for _ in range(2 if args.redis else 1):
            h3, tcp, admin = free_port(), free_port(), free_port()
            serve = ["edge.cli", "serve", "--h3", f"127.0.0.1:{h3}", "--tcp", f"127.0.0.1:{tcp}",
                     "--admin", f"127.0.0.1:{admin}", "--backend", sim_url, "--cert",
                     str(certs.cert), "--key", str(certs.key), "--config", str(toml)]  # fmt: skip
            await stack.enter_async_context(spawn_module(serve, "the edge"))
            edges.append(f"https://localhost:{h3}{ROUTE}")
        stub_h3, _ = await stack.enter_async_context(stub_listener(certs))
        edge = edges[0]
        stub = f"https://localhost:{stub_h3}{ROUTE}"
        turns = None if args.no_turns else await _bench(
            "turns", args, certs, "--url", edge, "--rtt-ms", str(args.rtt_ms),
            "--workload", "chat", "--chat-turns", str(args.turns), "--chat-system-len", "0",
            "--chat-turn-len", str(args.turn_words), "--output-len", str(args.output_len),
            "--num", str(args.sessions * args.turns), "--warmup", "2",
            "--turns", "10", str(args.turns), "--compare", "full=h3+0rtt", "stored=h3+0rtt+stored",
        )  # fmt: skip
        cache = {}
        # new 0-RTT connections at no RTT and at --rtt-ms; then one reused connection at no RTT,
        # where no handshake hides what the edge itself adds
        for rtt, mode in ((None, "0rtt"), (args.rtt_ms, "0rtt"), (None, "reuse")):
            extra = ["--rtt-ms", str(rtt)] if rtt else []
            tag = f"cache-{mode}-rtt{rtt or 0:g}"
            cache[tag] = await _bench(
                tag, args, certs, "--url", edge, *extra, "--workload", "gsp",
                "--gsp-groups", "1", "--gsp-prompts-per-group", "1", "--gsp-system-len", "64",
                "--output-len", "8", "--num", str(args.cache_num), "--warmup", "2",
                "--compare", f"hit=h3+{mode}+cache@{edge}", f"floor=h3+{mode}@{stub}",
            )  # fmt: skip
        if args.redis:
            # distinct prompts stored through the first edge, then read through the second
            for tag, url in (("l2-fill", edges[0]), ("l2-read", edges[1])):
                cache[tag] = await _bench(
                    tag, args, certs, "--url", url, "--workload", "gsp", "--gsp-groups", "1",
                    "--gsp-prompts-per-group", str(args.cache_num), "--gsp-system-len", "64",
                    "--output-len", "8", "--num", str(args.cache_num), "--warmup", "2",
                    "--compare", f"hit=h3+reuse+cache@{url}", f"floor=h3+reuse@{stub}",
                )  # fmt: skip
    report = render(turns, cache, args)
    (args.out / "report.md").write_text(report + "\n")
    print(report)
    return 0


def render(turns: Any, cache: dict[str, Any], args: argparse.Namespace) -> str:
    lines: list[str] = []
    if turns is not None:
        lines += _turn_lines(turns, args)
    lines += ["A cache hit against the stub on the same H3 listener (the transport's floor):",
              "", "| connection | RTT | config | n | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms |",
              "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    lines += _cache_lines(cache, args)
    return "\n".join(lines)


def _turn_lines(turns: Any, args: argparse.Namespace) -> list[str]:
    lines = [f"Multi-turn chats over h3+0rtt at RTT {args.rtt_ms:g} ms, {args.sessions} chats per "
             f"configuration, {args.turn_words} words per user turn:", "",
             "| config | turn | n | request bytes p50 | TTFT p50 ms | TTFT p99 ms |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in turns["turns"]:
        lines.append(f"| {row['config']} | {row['turn']} | {row['n']} | "
                     f"{row['request_bytes_p50']} | {row['ttft_p50_ms']:.1f} | "
                     f"{row['ttft_p99_ms']:.1f} |")  # fmt: skip
    return [*lines, ""]


def _cache_lines(cache: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = []
    for tag in cache:
        records = [json.loads(line) for line in (args.out / f"{tag}.jsonl").open()]
        if tag == "l2-fill":
            continue
        wanted = "hit-l2" if tag == "l2-read" else "hit-l1"
        for config in ("hit", "floor"):
            # the hit row counts hits only (the run's first request is the miss that stored it)
            ttft = [
                r["ttft_ms"] for r in records
                if r["config"] == config and r["ttft_ms"] and r["error"] is None
                and (config == "floor" or r["cache"] == wanted)
            ]  # fmt: skip
            p50, p90, p99 = (_percentile(ttft, q) or 0.0 for q in (50, 90, 99))
            if tag == "l2-read":
                connection, rtt = "reused, second edge", "0"
                name = f"hit ({wanted})" if config == "hit" else config
            else:
                _, mode, rtt = tag.split("-")
                connection = "new, 0-RTT" if mode == "0rtt" else "reused"
                rtt, name = rtt.removeprefix("rtt"), config
            row = [connection, rtt, name, str(len(ttft)), f"{p50:.2f}", f"{p90:.2f}", f"{p99:.2f}"]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def main(argv: list[str]) -> int:
    return run(_main(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
