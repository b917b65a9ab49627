"""The Python cost of relaying one streamed chunk, with the system calls taken out.

    python -m tools.relay_cpu [--chunks 64] [--streams 200] [--loop uvloop]

Drives the edge's own relay path in one process, through public APIs only: an HTTP/1.1
listener protocol (`transport.h1_server.H1Protocol`) gets one request per stream, and its app
sends the request upstream through an `UpstreamPool` whose one connection was adopted on a
stand-in transport (`UpstreamPool.adopt`). That connection is fed a 64-token chat completion
chunk by chunk (one chunk per event-loop turn, as one socket read each), and the relay
(`edge.relay.relay_stream`) scans and passes each one to the listener's response, which frames
it. Both ends' transports write nothing, so what is measured is the Python work per chunk: the
llhttp callback, the scan and the chunked framing, and either the listener's body writer called
from the pool's read callback (our HTTP/1.1 listener) or a wake-up of the relay's task and an
ASGI send (other listeners). Compare it with the edge's CPU per token under load
(`bench.edge_latency`): the difference is system calls and the loop's I/O dispatch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from backends.connection import Connection
from backends.pool import UpstreamPool
from edge.relay import RelayResult, relay_stream
from transport.asgi import ASGIApp, Receive, Scope, Send
from transport.h1_server import H1Listener, H1Protocol
from transport.loop import LOOPS
from transport.loop import run as run_on_loop

BACKEND = "http://127.0.0.1:9"
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
REQUEST = b"POST /relay HTTP/1.1\r\nhost: edge\r\ncontent-length: 0\r\n\r\n"
_END = b"0\r\n\r\n"


class NullTransport:
    """Writes nothing, and answers what the protocols ask."""

    def write(self, data: bytes) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


class HeadOnly(NullTransport):
    """A backend connection's transport: each request written is answered with `HEAD` on the
    next loop turn; the body is fed by the bench."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.conn: Connection | None = None

    def write(self, data: bytes) -> None:
        assert self.conn is not None
        self.loop.call_soon(self.conn.data_received, HEAD)


class Client(NullTransport):
    """A client connection's transport: notes when a chunked response has ended."""

    def __init__(self) -> None:
        self.tail = b""
        self.ended = 0

    def write(self, data: bytes) -> None:
        self.tail = (self.tail + data)[-len(_END) :]
        if self.tail == _END:
            self.tail = b""
            self.ended += 1


def _framed(event: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(event), event)


def chat_chunks(tokens: int) -> list[bytes]:
    """A chat completion stream as SGLang sends it: one framed chunk per token, then the end."""
    out = []
    for i in range(tokens):
        obj = {
            "id": "dace2cad43b901949b98cf92ee442cd4", "object": "chat.completion.chunk",
            "created": 1764488147, "model": "default",
            "choices": [{"index": 0, "delta": {"role": None, "content": f" tok{i}"},
                         "logprobs": None, "finish_reason": None}],
            "usage": None,
        }  # fmt: skip
        out.append(_framed(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"))
    out.append(_framed(b"data: [DONE]\n\n") + _END)
    return out


def relay_app(
    pool: UpstreamPool, conn: Connection, chunks: list[bytes], *, splice: bool, times: list[float]
) -> ASGIApp:
    """The listener's app: sends the request upstream, then relays the stand-in's chunks,
    timing from the first chunk fed to the relay's end (`times` gets one entry a stream)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        response = await pool.request(
            BACKEND, "POST", "/v1/chat/completions", headers=[], body=b"", chunk_timeout=30
        )
        await send({"type": "http.response.start", "status": 200, "headers": []})

        async def feed() -> None:
            for chunk in chunks:
                await asyncio.sleep(0)  # a loop turn per chunk, as a read per chunk
                conn.data_received(chunk)

        started = time.perf_counter()
        feeder = loop.create_task(feed())
        result = RelayResult()
        writer = scope["extensions"].get("quicedge.body_writer") if splice else None
        await relay_stream(response, send, result, writer=writer)
        await feeder
        times.append(time.perf_counter() - started)
        if len(result.delays) != len(chunks) - 1:
            raise RuntimeError(f"the relay passed {len(result.delays)} tokens, not all")

    return app


async def measure(chunks: list[bytes], streams: int, *, splice: bool) -> float:
    """Seconds of wall time per chunk (one process, nothing else running in it). `splice`:
    through the listener's body writer, from the pool's read callback (what our HTTP/1.1
    listener gets); else as ASGI messages sent by the relay's task (what hypercorn gets)."""
    loop = asyncio.get_running_loop()
    pool = UpstreamPool(max_connections_per_backend=1, urgent_reads=False)
    upstream = HeadOnly(loop)
    upstream.conn = pool.adopt(BACKEND, upstream)  # type: ignore[arg-type]
    times: list[float] = []
    listener = H1Listener(
        relay_app(pool, upstream.conn, chunks, splice=splice, times=times),
        host="127.0.0.1",
        port=0,
    )
    client = Client()
    proto = H1Protocol(listener, loop)
    proto.connection_made(client)  # type: ignore[arg-type]
    try:
        for i in range(streams):
            proto.data_received(REQUEST)
            for _ in range(100 * len(chunks) + 1000):  # bounded: a failed app never times
                if len(times) > i:
                    break
                await asyncio.sleep(0)
            else:
                raise RuntimeError(f"stream {i} was not relayed")
    finally:
        await listener.stop()  # never started: closes its bound socket
        await pool.aclose()
    if client.ended != streams:
        raise RuntimeError(f"{client.ended} of {streams} answers reached the client whole")
    return sum(times) / (streams * len(chunks))


async def loop_turn(turns: int) -> float:
    """Seconds per bare loop turn (`asyncio.sleep(0)`), the feeder's share of each chunk."""
    started = time.perf_counter()
    for _ in range(turns):
        await asyncio.sleep(0)
    return (time.perf_counter() - started) / turns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.relay_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--chunks", type=int, default=64, help="tokens per stream")
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--loop", choices=sorted(LOOPS), default="auto")
    args = p.parse_args(argv)
    if args.chunks < 1 or args.streams < 1:
        p.error("--chunks and --streams must be >= 1")
    chunks = chat_chunks(args.chunks)

    async def run() -> tuple[float, float, float]:
        splice = await measure(chunks, args.streams, splice=True)
        pull = await measure(chunks, args.streams, splice=False)
        return splice, pull, await loop_turn(args.streams * len(chunks))

    splice, pull, turn = run_on_loop(run(), args.loop)
    print(
        f"relay per chunk: {splice * 1e6:.1f} us through the body writer, {pull * 1e6:.1f} us"
        f" as ASGI messages; a bare loop turn {turn * 1e6:.1f} us"
        f" ({args.streams} streams of {len(chunks)} chunks)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
