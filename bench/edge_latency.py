"""What the edge adds to TTFT, measured with the cheapest client there is.

    python -m bench.edge_latency direct=http://127.0.0.1:31001 edge=http://127.0.0.1:31080 \\
        --max-tokens 1 --rounds 10 --per-round 50 [--cpu-pid sim=PID --cpu-pid edge=PID]

An asyncio client costs more per request than the edge's own work on a small machine, so this
one is a blocking socket on one keep-alive HTTP/1.1 connection per target, concurrency 1. Targets
are measured in interleaved rounds (A, B, A, B, ...) so that drift in the machine's load (other
processes, CPU frequency) lands on every target alike. For each target it reports the time to
the first response byte and to the first content token (p50/p90/p99); for `--cpu-pid` processes,
the CPU time (user + system, from /proc) each spent per request while that target was measured.
Targets after the first are also reported as "added" over the first (difference of the p50s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_CONTENT = re.compile(rb'"(?:content|text)"\s*:\s*"[^"]')
_END = b"0\r\n\r\n"


@dataclass
class Target:
    name: str
    host: str
    port: int
    first_byte_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    requests: int = 0


def _target(spec: str) -> Target:
    name, sep, url = spec.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=http://host:port, got {spec!r}")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected a plain http:// URL, got {url!r}")
    return Target(name, parts.hostname, parts.port or 80)


def _pid(spec: str) -> tuple[str, int]:
    name, sep, pid = spec.partition("=")
    if not sep or not pid.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=PID, got {spec!r}")
    return name, int(pid)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request_bytes(host: str, max_tokens: int, prompt_words: int) -> bytes:
    body = json.dumps(
        {
            "model": "default",
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello " * prompt_words}],
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def one(sock: socket.socket, request: bytes) -> tuple[float, float]:
    """Send one request and read its chunked answer; (first byte, first token) in ms."""
    t0 = time.perf_counter()
    sock.sendall(request)
    buf = b""
    first_byte = first_token = None
    while True:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        now = time.perf_counter()
        if first_byte is None:
            first_byte = now
        buf += data
        if first_token is None and _CONTENT.search(buf):
            first_token = now
        if buf.endswith(_END):
            break
    if first_token is None:
        raise ValueError("the answer carried no content token")
    return (first_byte - t0) * 1e3, (first_token - t0) * 1e3


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def measure(
    targets: list[Target],
    *,
    max_tokens: int,
    prompt_words: int,
    rounds: int,
    per_round: int,
    warmup: int,
    pause_s: float,
    pids: dict[str, int],
) -> None:
    socks = []
    for t in targets:
        sock = socket.create_connection((t.host, t.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(sock)
    reqs = [request_bytes(t.host, max_tokens, prompt_words) for t in targets]
    try:
        for sock, req in zip(socks, reqs, strict=True):
            for _ in range(warmup):
                one(sock, req)
        for _ in range(rounds):
            for t, sock, req in zip(targets, socks, reqs, strict=True):
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                for _ in range(per_round):
                    fb, ttft = one(sock, req)
                    t.first_byte_ms.append(fb)
                    t.ttft_ms.append(ttft)
                    if pause_s:
                        time.sleep(pause_s)
                for name, pid in pids.items():
                    t.cpu_s[name] = t.cpu_s.get(name, 0.0) + cpu_seconds(pid) - before[name]
                t.requests += per_round
    finally:
        for sock in socks:
            sock.close()


def report(targets: list[Target]) -> str:
    lines = []
    base = targets[0]
    for t in targets:
        fb, tt = t.first_byte_ms, t.ttft_ms
        line = (
            f"{t.name:>8}: first byte p50 {statistics.median(fb):.2f} p90 {_pct(fb, 0.9):.2f}"
            f" p99 {_pct(fb, 0.99):.2f} | TTFT p50 {statistics.median(tt):.2f}"
            f" p90 {_pct(tt, 0.9):.2f} p99 {_pct(tt, 0.99):.2f} ms"
        )
        if t.cpu_s:
            line += " | CPU/request " + " ".join(
                f"{name} {cpu / t.requests * 1e3:.2f}" for name, cpu in t.cpu_s.items()
            )
            line += " ms"
        lines.append(line)
        if t is not base:
            added_tt = statistics.median(tt) - statistics.median(base.ttft_ms)
            added_fb = statistics.median(fb) - statistics.median(base.first_byte_ms)
            lines.append(
                f"{'':>8}  added over {base.name}: TTFT p50 {added_tt:+.2f} ms,"
                f" first byte p50 {added_fb:+.2f} ms"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.edge_latency", description=__doc__)
    p.add_argument("targets", nargs="+", type=_target, help="NAME=http://host:port")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--pause-ms", type=float, default=2.0, help="between requests")
    p.add_argument("--cpu-pid", type=_pid, action="append", default=[], metavar="NAME=PID")
    args = p.parse_args(argv)
    targets: list[Target] = args.targets
    try:
        measure(
            targets,
            max_tokens=args.max_tokens,
            prompt_words=args.prompt_words,
            rounds=args.rounds,
            per_round=args.per_round,
            warmup=args.warmup,
            pause_s=args.pause_ms / 1e3,
            pids=dict(args.cpu_pid),
        )
    except (OSError, ValueError) as exc:
        print(f"edge_latency: {exc}", file=sys.stderr)
        return 1
    print(report(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
