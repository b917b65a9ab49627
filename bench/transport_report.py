"""The transport matrix: TTFT over H3 0-RTT, H3, H2 and H1 (TLS over TCP) at emulated RTTs,
through the edge, against the bare protocol floor, and direct to the backend; plus the proxy's
added latency. Writes the raw runs and a Markdown report.

    python -m bench.transport_report --rtts 20 50 100 --num 30 --out bench-out/transport

It starts everything itself: one CPU stand-in (`instant` profile: no simulated compute, so TTFT
is network and proxy time), the edge (`quicedge serve`) in front of it, and an in-process "stub"
(the edge's own H3 and TLS listeners serving an instant answer, no proxy, no backend). Each RTT
is one `quicedge bench --compare` run, so all configurations are interleaved request by request
and share the machine's noise. Expected TTFT with a new connection per request, in round trips:
H3 0-RTT 1, H3 2, TLS 1.3 over TCP (H2 or H1) 3, plain HTTP/1.1 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.children import free_port
from bench.loop import run
from bench.stub_app import stub_app as _stub_app
from certs import DevCertificates, ensure_dev_certificates

ROUTE = "/v1/chat/completions"
# Round trips before the first token, with a new connection per request.
ROUND_TRIPS = {"h3+0rtt": 1, "h3": 2, "h2": 3, "h1": 3, "h1plain": 2}
TOLERANCE_MS = 10.0  # the acceptance criterion's window around the expected count


@dataclass(frozen=True)
class Endpoints:
    edge_h3: str
    edge_tcp: str
    edge_http: str
    stub_h3: str
    stub_tcp: str
    direct: str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.transport_report", description=__doc__)
    p.add_argument("--rtts", type=float, nargs="+", default=[20.0, 50.0, 100.0])
    p.add_argument("--num", type=int, default=30, help="requests per configuration and RTT")
    p.add_argument("--out", type=Path, default=Path("bench-out/transport"), help="output folder")
    p.add_argument("--no-edge", action="store_true", help="skip the edge (stub and direct only)")
    p.add_argument("--no-stub", action="store_true", help="skip the protocol-floor stub")
    p.add_argument("--sim-profile", default="instant", help="stand-in timing profile")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    if args.num < 1 or any(r < 0 for r in args.rtts):
        print("--num must be >= 1 and RTTs >= 0", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    return run(_main(args))


async def _read_ready(proc: asyncio.subprocess.Process, what: str, timeout: float = 30.0) -> str:
    """The first stdout line starting with "ready" (the stand-in prints its URL on it)."""
    assert proc.stdout is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), max(0.1, deadline - loop.time()))
        if not line:
            raise RuntimeError(f"{what} exited before it was ready")
        text = line.decode().strip()
        if text.startswith("ready"):
            return text


@asynccontextmanager
async def spawn_module(args: list[str], what: str) -> AsyncIterator[tuple[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        ready = await _read_ready(proc, what)
        # Keep reading stdout so the child never blocks on a full pipe.
        drain = asyncio.create_task(_drain(proc))
        yield ready, proc
        drain.cancel()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while await proc.stdout.readline():
        pass


async def stand_in(stack: AsyncExitStack, profile: str, *extra: str) -> str:
    """A `quicedge sim` process with its cache report on, stopped with `stack`: its base URL."""
    ready, _ = await stack.enter_async_context(
        spawn_module(
            ["backends.sim", "--port", "0", "--name", "b1", "--profile", profile,
             "--enable-cache-report", *extra],
            "the stand-in",
        )
    )  # fmt: skip
    return str(ready.split()[1])


@asynccontextmanager
async def stub_listener(certs: DevCertificates) -> AsyncIterator[tuple[int, int]]:
    """The edge's listeners serving the instant stub app: H3 port and TLS TCP port."""
    from transport.h3_server import H3Server
    from transport.tcp import TcpListener
    from transport.tickets import MemoryTicketStore
    from transport.tls import CertificateFiles, TlsMaterial

    tls = TlsMaterial(CertificateFiles(certs.cert, certs.key))
    stub_app: Any = _stub_app  # an ASGI 3 callable; its dict-typed signature is narrower
    h3 = H3Server(stub_app, tls=tls, tickets=MemoryTicketStore())
    await h3.start("127.0.0.1", 0)
    tcp = TcpListener(stub_app, host="127.0.0.1", port=0, tls=tls)
    await tcp.start()
    try:
        yield h3.port, tcp.port
    finally:
        await tcp.stop()
        await h3.aclose()


def matrix_specs(ep: Endpoints, *, edge: bool, stub: bool, reuse: bool) -> list[str]:
    flag = "+reuse" if reuse else "+new"
    specs = []
    for name, base, enabled in (("edge", ep, edge), ("stub", ep, stub)):
        if not enabled:
            continue
        h3 = base.edge_h3 if name == "edge" else base.stub_h3
        tcp = base.edge_tcp if name == "edge" else base.stub_tcp
        if not reuse:
            specs.append(f"{name}-h3+0rtt=h3+0rtt@{h3}")
        specs += [f"{name}-h3=h3{flag}@{h3}", f"{name}-h2=h2{flag}@{tcp}"]
        specs.append(f"{name}-h1=h1{flag}@{tcp}")
    if edge:
        specs.append(f"edge-h1plain=h1{flag}@{ep.edge_http}")
    specs.append(f"direct-h1plain=h1{flag}@{ep.direct}")
    return specs


async def _bench(
    specs: list[str], rtt: float | None, args: argparse.Namespace, certs: DevCertificates, tag: str
) -> dict[str, Any]:
    out = args.out / f"{tag}.jsonl"
    summary = args.out / f"{tag}.summary.json"
    command = [
        sys.executable, "-m", "bench.cli", "--url", specs[0].split("@", 1)[1],
        "--cacert", str(certs.ca_cert), "--workload", "random", "--num", str(args.num),
        "--random-input-len", str(args.input_len), "--random-range-ratio", "1",
        "--output-len", str(args.output_len), "--warmup", "2", "--no-progress",
        "--output", str(out), "--summary-json", str(summary), "--plots", str(args.out / tag),
        "--compare", *specs,
    ]  # fmt: skip
    if rtt is not None:
        command += ["--rtt-ms", str(rtt)]
    print(f"$ quicedge bench {' '.join(command[3:])}", flush=True)
    proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    stdout, _ = await proc.communicate()
    print(stdout.decode(), flush=True)
    if not summary.exists():
        raise RuntimeError(f"bench run {tag} failed (exit {proc.returncode})")
    document: dict[str, Any] = json.loads(summary.read_text())
    return document


def _kind(config: str) -> str:
    return config.split("-", 1)[1]


def _median(document: dict[str, Any] | None, config: str) -> float | None:
    if document is None:
        return None
    value = document["summary"].get(config, {}).get("ttft_ms", {}).get("p50")
    return None if value is None else float(value)


def render_report(results: dict[str, dict[str, Any]]) -> str:
    """Markdown tables. `results`: "rtt0-reuse" (warm connections, no RTT), and "rtt<N>" runs
    with new connections; "rtt0" is the floor: handshake CPU and loopback, with no RTT."""
    floor = results.get("rtt0")
    lines = [
        "| RTT (ms) | configuration | round trips | expected (ms) | median TTFT (ms) "
        "| p90 TTFT (ms) | median − RTT-0 floor (ms) | that − expected (ms) | 0-RTT accepted "
        "| errors |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    checks = []
    runs = sorted(
        ((d["run"]["rtt_ms"] or 0.0, tag, d) for tag, d in results.items() if tag != "rtt0-reuse"),
        key=lambda item: item[0],
    )
    for rtt, _, document in runs:
        for name, s in document["summary"].items():
            trips = ROUND_TRIPS.get(_kind(name))
            median = _median(document, name)
            base = _median(floor, name)
            expected = None if trips is None else trips * rtt
            over = None if median is None or base is None else median - base
            miss = None if over is None or expected is None else over - expected
            lines.append(
                f"| {rtt:g} | {name} | {trips} | {_f(expected)} | {_f(median)} "
                f"| {_f(s['ttft_ms']['p90'])} | {_f(over)} | {_f(miss, signed=True)} "
                f"| {s['early_data_accepted']}/{s['early_data_attempted']} | {s['failed']} |"
            )
        if not rtt:
            continue
        for target in ("edge", "stub"):
            zero = _median(document, f"{target}-h3+0rtt")
            full = _median(document, f"{target}-h3")
            tls = _median(document, f"{target}-h2")
            if zero is None or full is None or tls is None:
                continue
            one, two = full - zero, tls - zero
            ok = abs(one - rtt) <= TOLERANCE_MS and abs(two - 2 * rtt) <= TOLERANCE_MS
            checks.append(
                f"| {rtt:g} | {target} | {one:.1f} (expect {rtt:g}) "
                f"| {two:.1f} (expect {2 * rtt:g}) | {'yes' if ok else 'no'} |"
            )
    out = ["## TTFT by transport and emulated RTT (a new connection per request)", "", *lines, ""]
    if checks:
        out += [
            "## 0-RTT savings (differences of median TTFT in the same run)",
            "",
            "| RTT (ms) | target | H3 − H3 0-RTT (ms) | H2 (TLS/TCP) − H3 0-RTT (ms) "
            f"| both within {TOLERANCE_MS:g} ms |",
            "| ---: | --- | ---: | ---: | --- |",
            *checks,
            "",
        ]
    warm = results.get("rtt0-reuse")
    rows = []
    for kind, other in (("h3", "stub"), ("h2", "stub"), ("h1", "stub"), ("h1plain", "direct")):
        edge, ref = _median(warm, f"edge-{kind}"), _median(warm, f"{other}-{kind}")
        if edge is not None and ref is not None:
            rows.append(f"| {kind} | {edge:.2f} | {other} {ref:.2f} | {edge - ref:+.2f} |")
    if rows:
        out += [
            "## Proxy added latency (no emulated RTT, warm connections, median TTFT)",
            "",
            "| transport | through the edge (ms) | without it (ms) | added (ms) |",
            "| --- | ---: | ---: | ---: |",
            *rows,
            "",
        ]
    return "\n".join(out)


def _f(value: float | None, *, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


async def _main(args: argparse.Namespace) -> int:
    certs = ensure_dev_certificates(Path(tempfile.mkdtemp(prefix="quicedge-report-")))
    results: dict[str, dict[str, Any]] = {}
    async with AsyncExitStack() as stack:
        sim_url = await stand_in(stack, args.sim_profile, "--enable-metrics")
        ports = {name: free_port() for name in ("h3", "tcp", "http", "admin")}
        if not args.no_edge:
            await stack.enter_async_context(
                spawn_module(
                    [
                        "edge.cli",
                        "serve",
                        "--h3",
                        f"127.0.0.1:{ports['h3']}",
                        "--tcp",
                        f"127.0.0.1:{ports['tcp']}",
                        "--http",
                        f"127.0.0.1:{ports['http']}",
                        "--admin",
                        f"127.0.0.1:{ports['admin']}",
                        "--backend",
                        sim_url,
                        "--cert",
                        str(certs.cert),
                        "--key",
                        str(certs.key),
                    ],
                    "the edge",
                )  # fmt: skip
            )
        stub_h3, stub_tcp = 0, 0
        if not args.no_stub:
            stub_h3, stub_tcp = await stack.enter_async_context(stub_listener(certs))
        ep = Endpoints(
            edge_h3=f"https://localhost:{ports['h3']}{ROUTE}",
            edge_tcp=f"https://localhost:{ports['tcp']}{ROUTE}",
            edge_http=f"http://127.0.0.1:{ports['http']}{ROUTE}",
            stub_h3=f"https://localhost:{stub_h3}{ROUTE}",
            stub_tcp=f"https://localhost:{stub_tcp}{ROUTE}",
            direct=f"{sim_url}{ROUTE}",
        )
        edge, stub = not args.no_edge, not args.no_stub
        specs = matrix_specs(ep, edge=edge, stub=stub, reuse=True)
        results["rtt0-reuse"] = await _bench(specs, None, args, certs, "rtt0-reuse")
        for rtt in [0.0, *args.rtts]:
            specs = matrix_specs(ep, edge=edge, stub=stub, reuse=False)
            tag = f"rtt{rtt:g}"
            results[tag] = await _bench(specs, rtt or None, args, certs, tag)
    path = write_report(args, results)
    print(f"wrote {path}")
    failed = sum(s["failed"] for d in results.values() for s in d["summary"].values())
    return 0 if failed == 0 else 1


def write_report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> Path:
    """Write OUT/report.md: a header naming the command that produced it (`args.argv`, what
    `main` ran with) and the setup, then `render_report(results)`. Its path."""
    report = render_report(results)
    command = shlex.join(["python", "-m", "bench.transport_report", *args.argv])
    header = [
        "# Transport TTFT report",
        "",
        f"Command: `{command}`",
        "",
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {args.num} requests per "
        f"configuration and RTT; prompt {args.input_len} words, {args.output_len} output tokens; "
        f"stand-in profile {args.sim_profile}.",
        "",
        "",
    ]
    path = args.out / "report.md"
    path.write_text("\n".join(header) + report + "\n")
    print(report)
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
