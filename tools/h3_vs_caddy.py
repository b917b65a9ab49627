"""quicedge against Caddy over HTTP/3 (and HTTP/2), new connection per request, through one RTT
relay: server CPU per request, TTFT in round trips and the whole answer's time; prints a
Markdown table.

    .venv/bin/python -m tools.h3_vs_caddy [--rtt-ms 40] [--num 150] [--rounds 2] [--out DIR]
        [--output-len 4] [--sim-profile instant] [--edge-cwd OTHER_CHECKOUT]

It starts one stand-in (`instant`: no simulated compute, so TTFT is network and proxy time),
`quicedge serve` in front of it, and Caddy (`caddy run`, `GOMAXPROCS=1`, the development
certificate, HTTP/3 on the same port) in front of the same stand-in. The edge and Caddy share the
last CPU, the stand-in and the client the others. Each round runs `quicedge bench` once per
(configuration, system), rotating which system goes first, each with its own in-process RTT
relay, a new connection per request, and `--edge-pid` set to that system's process: the edge CPU
per request is that process's user + system time from /proc over the measured requests.
`--baseline-cwd` adds a second edge from another checkout (before/after in the same rounds).
TTFT is reported in round trips of the relay: expected 1 for 0-RTT, 2 for H3, 3 for H2 (TLS 1.3
over TCP); the excess over that is what the proxy, the stacks and the client add. The whole
answer's time (the client's latency to the last token, `--output-len` tokens the stand-in writes
at once) shows what a new connection's congestion window and pacing let through.
Needs Debian's `caddy` (`make bench-references`). A measurement, not a test. Writes
OUT/h3_vs_caddy.json: `command` (the command that produced it) and per `system/config` its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from backends.sim.profiles import PROFILES
from bench.children import REPO, free_port, split_cpus, start, start_stand_in, stop, wait_listening
from certs import ensure_dev_certificates

ROUTE = "/v1/chat/completions"
CONFIGS = {"h3+0rtt": 1, "h3": 2, "h2": 3}
"""Configuration → round trips before the first token with a new connection."""


def caddy_h3_config(port: int, backend: str, cert: Path, key: str | Path) -> str:
    """A Caddyfile: TLS with the given certificate on `port`, HTTP/1.1, /2 and /3 (UDP, same
    port), every response flushed as it arrives."""
    return f"""{{
\tadmin off
\tauto_https off
\tservers {{
\t\tprotocols h1 h2 h3
\t}}
}}
https://localhost:{port} {{
\tbind 127.0.0.1
\ttls {cert} {key}
\treverse_proxy {backend.removeprefix("http://")} {{
\t\tflush_interval -1
\t}}
}}
"""


def bench(
    url: str, config: str, pid: int, args: argparse.Namespace, ca: Path, tag: str
) -> dict[str, Any]:
    summary = args.out / f"{tag}.summary.json"
    command = [
        sys.executable, "-m", "bench.cli", "--url", url, "--cacert", str(ca),
        "--workload", "random", "--num", str(args.num), "--random-input-len", "32",
        "--random-range-ratio", "1", "--output-len", str(args.output_len), "--warmup", "2",
        "--no-progress", "--summary-json", str(summary), "--rtt-ms", str(args.rtt_ms),
        "--edge-pid", str(pid), "--new-connection-per-request", "--compare", config,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
    if not summary.exists():
        raise RuntimeError(f"bench {tag} failed ({done.returncode}): {done.stderr[-800:]}")
    document: dict[str, Any] = json.loads(summary.read_text())
    summary.unlink()
    return document


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.h3_vs_caddy", description=__doc__)
    p.add_argument("--rtt-ms", type=float, default=40.0)
    p.add_argument("--num", type=int, default=150, help="requests per system, config and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument(
        "--sim-profile",
        default="instant",
        choices=sorted(PROFILES),
        help="the stand-in's profile: instant (no compute) or one paced like a GPU",
    )
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", type=Path, default=Path("bench-out/h3-vs-caddy"))
    p.add_argument("--edge-cwd", default=str(REPO), help="run the edge from this checkout")
    p.add_argument("--baseline-cwd", help="also run the edge from this checkout (`baseline`)")
    p.add_argument("--no-caddy", dest="caddy", action="store_false")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    certs = ensure_dev_certificates()
    caddy = shutil.which("caddy")
    if args.caddy and caddy is None:
        raise SystemExit("caddy is not installed (make bench-references)")
    proxy_cpus, others = split_cpus(True)
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        sim, sim_url = start_stand_in(
            stack, log=args.out / "sim.log", cpus=others, profile=args.sim_profile
        )
        systems: dict[str, tuple[int, int, int]] = {}
        edges = {"quicedge": args.edge_cwd}
        if args.baseline_cwd:
            edges["baseline"] = args.baseline_cwd
        for name, where in edges.items():
            port = free_port()
            h3_port = free_port(socket.SOCK_DGRAM)
            edge_cwd = Path(where).resolve()
            edge = start(
                name,
                [sys.executable, "-m", "edge.cli", "serve", "--backend", sim_url,
                 "--h3", f"127.0.0.1:{h3_port}", "--tcp", f"127.0.0.1:{port}",
                 "--admin", "off"],
                log=args.out / f"{name}.log", cpus=proxy_cpus, cwd=edge_cwd,
                env=dict(os.environ, PYTHONPATH=str(edge_cwd)),
            )  # fmt: skip
            stack.callback(stop, edge)
            wait_listening(edge, port)
            systems[name] = (edge.proc.pid, h3_port, port)
        if args.caddy:
            assert caddy is not None
            cport = free_port()
            workdir = args.out / "caddy"
            workdir.mkdir(exist_ok=True)
            (workdir / "Caddyfile").write_text(
                caddy_h3_config(cport, sim_url, certs.cert, certs.key)
            )
            child = start(
                "caddy", [caddy, "run", "--config", str(workdir / "Caddyfile"),
                          "--adapter", "caddyfile"],
                log=args.out / "caddy.log", cpus=proxy_cpus,
                env=dict(os.environ, GOMAXPROCS="1", XDG_DATA_HOME=str(workdir),
                         XDG_CONFIG_HOME=str(workdir)),
            )  # fmt: skip
            stack.callback(stop, child)
            wait_listening(child, cport)
            systems["caddy"] = (child.proc.pid, cport, cport)
        if others:
            os.sched_setaffinity(0, others)
        print(
            f"RTT {args.rtt_ms:g} ms, {args.num} requests per system/config/round, "
            f"{args.rounds} rounds; load average {os.getloadavg()[0]:.1f} at start",
            flush=True,
        )
        for r in range(args.rounds):
            order = list(systems)[r % len(systems) :] + list(systems)[: r % len(systems)]
            for config in args.configs:
                for name in order:
                    pid, h3p, tcpp = systems[name]
                    p_ = h3p if config.startswith("h3") else tcpp
                    doc = bench(
                        f"https://localhost:{p_}{ROUTE}",
                        config,
                        pid,
                        args,
                        certs.ca_cert,
                        f"{name}-{config}-{r}",
                    )
                    s = doc["summary"][config]
                    cpu = doc.get("edge_cpu") or {}
                    rows.setdefault((name, config), []).append(
                        {"ttft_p50": s["ttft_ms"]["p50"], "ttft_p90": s["ttft_ms"]["p90"],
                         "answer_p50": s["latency_ms"]["p50"], "itl_p99": s["itl_ms"]["p99"],
                         "cpu_ms": cpu.get("cpu_ms_per_request"), "completed": s["completed"],
                         "early": s["early_data_accepted"], "requests": s["requests"]}
                    )  # fmt: skip
                    last = rows[(name, config)][-1]
                    print(f"  round {r + 1} {name:<9} {config:<8} {json.dumps(last)}", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end\n")
    command = shlex.join(["python", "-m", "tools.h3_vs_caddy",
                          *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
    result = summarize(rows, rtt_ms=args.rtt_ms, command=command)
    (args.out / "h3_vs_caddy.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


def summarize(
    rows: dict[tuple[str, str], list[dict[str, Any]]], *, rtt_ms: float, command: str
) -> dict[str, Any]:
    """Print the table of `rows` (per system and config, each round's numbers); the JSON
    document: `command` (what produced it) and per `system/config` its runs and TTFT in RTTs."""
    print("| system | config | server CPU / request (ms), per round | TTFT p50 (ms) | "
          "TTFT p50 in RTT | excess over the expected RTTs | whole answer p50 (ms) | "
          "0-RTT accepted |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    result: dict[str, Any] = {"command": command}
    for (name, config), runs in rows.items():
        cpus_ = [r["cpu_ms"] for r in runs if r["cpu_ms"] is not None]
        ttft = statistics.median(r["ttft_p50"] for r in runs if r["ttft_p50"] is not None)
        rtts = ttft / rtt_ms
        excess = rtts - CONFIGS[config]
        answer = statistics.median(r["answer_p50"] for r in runs)
        early = f"{sum(r['early'] for r in runs)}/{sum(r['requests'] for r in runs)}"
        print(
            f"| {name} | {config} | {', '.join(f'{c:.2f}' for c in cpus_)} | {ttft:.1f} | "
            f"{rtts:.3f} | {excess:+.3f} | {answer:.1f} | {early} |"
        )
        result[f"{name}/{config}"] = {"runs": runs, "ttft_p50_rtt": rtts, "excess_rtt": excess}
    return result


if __name__ == "__main__":
    sys.exit(main())
