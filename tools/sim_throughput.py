"""How many streamed tokens per second one stand-in process serves (`--profile instant`).

Starts `python -m backends.sim` as a child process pinned to one CPU (when `taskset` exists),
then runs N concurrent streaming clients on keep-alive connections for a fixed time and prints
a report. The clients are deliberately lean (raw asyncio streams, no JSON parsing except the
final usage chunk) so that the server, not the load generator, is what gets measured.

    python -m tools.sim_throughput --clients 64 --duration 10 --max-tokens 256

This is a benchmark, not a test: it prints numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from bench.summary import rank_index

_USAGE_RE = re.compile(rb'"completion_tokens":(\d+)')
_END = b"\r\n0\r\n\r\n"  # last chunk of a chunked response
# A content delta with text (the role chunk's `"content":""` has none), in whatever read it came.
_CONTENT_RE = re.compile(rb'"content":"[^"]')


@dataclass
class ClientStats:
    tokens: int = 0
    events: int = 0
    requests: int = 0
    ttfts: list[float] = field(default_factory=list)


async def run_client(
    host: str, port: int, body: bytes, deadline: float, stats: ClientStats
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            writer.write(head + body)
            buf = bytearray()
            first = None
            while not buf.endswith(_END):
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("server closed the connection")
                buf += data
                if first is None and _CONTENT_RE.search(buf):
                    first = time.perf_counter() - start
            usage = buf.rfind(b'"usage":{')
            match = _USAGE_RE.search(buf, usage)
            if usage < 0 or match is None:
                raise RuntimeError("no usage chunk in the response")
            stats.tokens += int(match.group(1))
            # content events: all `data:` lines but role, finish, usage and [DONE]
            stats.events += buf.count(b"data: ") - 4
            stats.requests += 1
            if first is not None:
                stats.ttfts.append(first)
    finally:
        writer.close()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(cpu: int | None, port: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "backends.sim", "--host", "127.0.0.1", "--port", str(port),
           "--profile", "instant", "--name", "bench"]  # fmt: skip
    if cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("ready "):
        proc.kill()
        raise RuntimeError(f"the stand-in did not start: {line!r}")
    return proc, line.split()[1]


async def measure(url: str, clients: int, duration: float, max_tokens: int) -> dict[str, float]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    stats = [ClientStats() for _ in range(clients)]
    # Warm-up: one request per client shape, not counted.
    await run_client(host, int(port), body, time.perf_counter() + 0.01, ClientStats())
    start = time.perf_counter()
    deadline = start + duration
    await asyncio.gather(*(run_client(host, int(port), body, deadline, s) for s in stats))
    elapsed = time.perf_counter() - start
    tokens = sum(s.tokens for s in stats)
    ttfts = sorted(t for s in stats for t in s.ttfts)
    return {
        "clients": clients,
        "elapsed_s": elapsed,
        "requests": sum(s.requests for s in stats),
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "tokens_per_event": tokens / max(1, sum(s.events for s in stats)),
        "ttft_median_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p99_ms": 1000 * ttfts[rank_index(len(ttfts), 99)] if ttfts else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.sim_throughput", description=__doc__)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--server-cpu", type=int, default=0, help="CPU to pin the server to (-1: none)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--url", default=None, help="measure an already running server instead")
    args = p.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(None if args.server_cpu < 0 else args.server_cpu, args.port)
        others = set(range(os.cpu_count() or 1)) - {args.server_cpu}
        if args.server_cpu >= 0 and others and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, others)  # keep the load generator off the server's core
    cpu_before = cpu_seconds(proc.pid) if proc else None
    try:
        report = asyncio.run(measure(url, args.clients, args.duration, args.max_tokens))
        cpu_after = cpu_seconds(proc.pid) if proc else None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
    pinned = "not pinned" if args.server_cpu < 0 or args.url else f"pinned to CPU {args.server_cpu}"
    print("== stand-in streaming throughput (profile instant) ==")
    print(f"server                 {url} ({pinned}; {os.cpu_count()} CPUs on this machine)")
    print(f"concurrent clients     {report['clients']}")
    print(f"tokens per request     {args.max_tokens} (ignore_eos, chat completions, streamed)")
    print(f"elapsed                {report['elapsed_s']:.2f} s")
    print(f"requests completed     {report['requests']}")
    print(f"tokens streamed        {report['tokens']}")
    print(f"streamed tokens/s      {report['tokens_per_s']:.0f}")
    print(f"tokens per SSE event   {report['tokens_per_event']:.2f} (1.00: one event per token)")
    print(f"TTFT median / p99      {report['ttft_median_ms']:.2f} / {report['ttft_p99_ms']:.2f} ms")
    if cpu_before is not None and cpu_after is not None and cpu_after > cpu_before:
        cpu = cpu_after - cpu_before  # includes the uncounted warm-up request: negligible
        print(f"server CPU time        {cpu:.2f} s ({cpu / report['elapsed_s'] * 100:.0f} % of "
              f"one core)")  # fmt: skip
        print(f"tokens per CPU-second  {report['tokens'] / cpu:.0f} (capacity of one busy core)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
