"""The Python cost of one whole request through the edge, with the system calls taken out.

    python -m tools.request_cpu [--requests 4000] [--repeats 5] [--concurrency 32] [--tokens 1] \
        [--loop uvloop] [--instructions]

Runs the edge's own objects in one process, wired as `quicedge serve` wires them (`edge.wiring`,
the default `ttft` policy, metrics on): `--concurrency` client connections on an HTTP/1.1
listener protocol, each a closed loop that sends its next streamed chat completion (the request
`bench.edge_latency` sends, with a fresh `rid`) as soon as the previous answer ended, and a
stand-in backend that answers each forwarded request one event-loop turn later, a chunk per
turn, as SGLang streams it (`--tokens` content chunks, then the finish chunk and `[DONE]`).
Both ends are transports whose writes cost nothing, so what is measured is the Python work of
a request: the listener's parsing, the stages, routing, the pool, the relay, the accounting,
and the event loop's turns between them. Compare with the edge's CPU per request under load
(`bench.edge_latency`, `--max-tokens 1`): the difference is system calls and I/O dispatch.
It reports the minimum and the median over `--repeats` runs of `--requests` each: on a shared
VM, other tenants only ever add time. Even so, identical runs differ by ±20 % on the 2-vCPU VM,
more than most single changes to the request path save. `--instructions` counts instead: it runs
this bench twice under valgrind (cachegrind, no cache simulation; valgrind must be installed),
with one and with three repeats, and reports the difference per request, which is the same from
run to run to a few hundred instructions. Instructions are not time (cache misses, branch
misses and system calls are not in them), but the count tells whether a change did less work.

No socket is involved: the pool takes the stand-in connections through `UpstreamPool.adopt`, the
listener's protocol gets the clients' bytes through `data_received`, both public.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from prometheus_client import CollectorRegistry

from backends.connection import Connection
from bench.edge_latency import Request, request_bytes
from edge.config import ProxyConfig
from edge.wiring import build
from tools.cachegrind import instructions
from tools.relay_cpu import NullTransport
from transport.collector import prepare_collector
from transport.h1_server import H1Listener, H1Protocol
from transport.loop import LOOPS
from transport.loop import run as run_on_loop

BACKEND = "http://127.0.0.1:9"
HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
)
_END = b"0\r\n\r\n"


def _framed(event: dict[str, Any] | str) -> bytes:
    text = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    data = b"data: " + text.encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "f641573f9bfe4261af53a95eb98be592", "object": "chat.completion.chunk",
        "created": 1796033430, "model": "default",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                     "matched_stop": None}],
    }  # fmt: skip


def stream_reads(tokens: int) -> list[bytes]:
    """What the backend's socket gives per read, as the stand-in writes it: the head with the
    role chunk, one chunk per token, then the finish chunk with `[DONE]` and the last chunk."""
    reads = [HEAD + _framed(_chunk({"role": "assistant", "content": ""}))]
    reads += [_framed(_chunk({"content": f" tok{i}"})) for i in range(tokens)]
    reads.append(_framed(_chunk({"content": None}, "length")) + _framed("[DONE]") + _END)
    return reads


class StandIn(NullTransport):
    """A backend connection's transport: each request written is answered a read per turn."""

    def __init__(self, reads: list[bytes], loop: asyncio.AbstractEventLoop):
        self.conn: Connection | None = None
        self.reads, self.loop = reads, loop

    def write(self, data: bytes) -> None:
        self.loop.call_soon(self._answer, 0)

    def _answer(self, i: int) -> None:
        assert self.conn is not None
        self.conn.data_received(self.reads[i])
        if i + 1 < len(self.reads):
            self.loop.call_soon(self._answer, i + 1)


class Client(NullTransport):
    """A client connection's transport: the next request goes out when an answer has ended."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.proto: H1Protocol | None = None
        self.tail = b""

    def write(self, data: bytes) -> None:
        tail = (self.tail + data)[-len(_END) :]
        self.tail = tail
        if tail == _END and data:
            self.tail = b""
            self.bench.answered(self)

    def send(self) -> None:
        assert self.proto is not None
        _, wire = self.bench.request.next()
        self.proto.data_received(wire)


RUN_TIMEOUT_S = 300.0
"""Longest one run of requests may take, s."""


class Bench:
    def __init__(self, loop: asyncio.AbstractEventLoop, requests: int) -> None:
        self.loop = loop
        self.request = Request(request_bytes("edge", 1, 64))
        self.left = requests  # requests still to send
        self.pending = 0
        self.done: asyncio.Future[None] = loop.create_future()

    def answered(self, client: Client) -> None:
        self.pending -= 1
        if self.left > 0:
            self.left -= 1
            self.pending += 1
            self.loop.call_soon(client.send)
        elif not self.pending and not self.done.done():
            self.done.set_result(None)


async def measure(
    requests: int, repeats: int, concurrency: int, tokens: int
) -> tuple[list[float], int]:
    """CPU seconds per request of each repeat of `requests` (after a warm-up), and how many
    requests were answered 200 in all."""
    loop = asyncio.get_running_loop()
    config = ProxyConfig.from_mapping({"backends": [BACKEND]}).validate()
    wiring = await build(config, registry=CollectorRegistry())
    reads = stream_reads(tokens)
    for _ in range(concurrency):
        stand_in = StandIn(reads, loop)
        stand_in.conn = wiring.pool.adopt(BACKEND, stand_in)  # type: ignore[arg-type]
    listener = H1Listener(wiring.app, host="127.0.0.1", port=0)
    clients = []
    for _ in range(concurrency):
        client = Client(Bench(loop, 0))
        client.proto = H1Protocol(listener, loop)
        client.proto.connection_made(client)  # type: ignore[arg-type]
        clients.append(client)
    try:
        await _run(loop, clients, max(concurrency * 20, requests // 10))  # warm-up
        prepare_collector()  # as `serve` does before it serves
        ok_before = _ok(wiring)
        per_request = []
        for _ in range(repeats):
            cpu = time.process_time()
            await _run(loop, clients, requests)
            per_request.append((time.process_time() - cpu) / requests)
        ok = _ok(wiring) - ok_before
    finally:
        await listener.stop()
        await wiring.aclose()
    return per_request, ok


async def _run(loop: asyncio.AbstractEventLoop, clients: list[Client], requests: int) -> None:
    bench = Bench(loop, requests)
    for client in clients:
        client.bench = bench
    for client in clients[:requests]:
        bench.left -= 1
        bench.pending += 1
        client.send()
    try:
        # Generous for valgrind's ~50x slowdown; a lost answer must end the run, not hang it.
        await asyncio.wait_for(asyncio.shield(bench.done), RUN_TIMEOUT_S)
    except TimeoutError:
        raise RuntimeError(
            f"{bench.pending} requests unanswered after {RUN_TIMEOUT_S:.0f} s "
            f"({bench.left} not sent)"
        ) from None


def _ok(wiring: Any) -> int:
    counter = wiring.metrics.requests.labels("/v1/chat/completions", "200", "default")
    return int(counter.value)


def count_instructions(argv: list[str], requests: int) -> int:
    """Instructions per request: this bench under cachegrind with 3 repeats minus with 1."""
    counts = [
        instructions(["tools.request_cpu", *argv, "--repeats", str(repeats)]) for repeats in (1, 3)
    ]
    return (counts[1] - counts[0]) // (2 * requests)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.request_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--requests", type=int, default=4000, help="per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=32, help="client connections")
    p.add_argument("--tokens", type=int, default=1, help="content chunks per answer")
    p.add_argument("--loop", choices=sorted(LOOPS), default="auto")
    p.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per request under valgrind instead of timing",
    )
    args = p.parse_args(argv)
    if min(args.requests, args.repeats, args.concurrency) < 1 or args.tokens < 0:
        p.error("--requests, --repeats and --concurrency must be >= 1, --tokens >= 0")
    if args.instructions:
        passed = ["--requests", str(args.requests), "--concurrency", str(args.concurrency),
                  "--tokens", str(args.tokens), "--loop", args.loop]  # fmt: skip
        try:
            count = count_instructions(passed, args.requests)
        except RuntimeError as exc:
            print(f"request_cpu: {exc}", file=sys.stderr)
            return 1
        print(
            f"edge instructions per request: {count} ({2 * args.requests} requests,"
            f" {args.concurrency} connections, {args.tokens} tokens each)"
        )
        return 0
    per_request, ok = run_on_loop(
        measure(args.requests, args.repeats, args.concurrency, args.tokens), args.loop
    )
    total = args.requests * args.repeats
    if ok != total:
        print(f"request_cpu: {ok} of {total} requests answered 200", file=sys.stderr)
        return 1
    print(
        f"edge CPU per request: min {min(per_request) * 1e6:.1f} us,"
        f" median {statistics.median(per_request) * 1e6:.1f} us ({args.repeats} x"
        f" {args.requests} requests, {args.concurrency} connections, {args.tokens} tokens each)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
