"""The Python cost of relaying one streamed chunk, with the system calls taken out.

    python -m bench.relay_cpu [--chunks 64] [--streams 200] [--loop uvloop]

Drives the edge's own relay path in one process: a pool connection is fed a 64-token chat
completion chunk by chunk (one chunk per event-loop turn, as one socket read each), the relay
(`edge.relay.relay_stream`) scans and passes each one to an HTTP/1.1 listener's response cycle,
which frames it. Both ends have stand-in transports whose writes cost nothing, so what is
measured is the Python work per chunk: the llhttp callback, the scan and the chunked framing,
and either the listener's body writer called from the pool's read callback (our HTTP/1.1
listener) or a wake-up of the relay's task and an ASGI send (other listeners). Compare it with
the edge's CPU per token under load (`bench.edge_latency`): the difference is system calls and
the loop's I/O dispatch.

It reaches into the pool's and the listener's private classes on purpose: no socket is involved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from backends.pool import UpstreamPool, UpstreamResponse, _Connection
from edge.relay import RelayResult, relay_stream
from transport.h1_server import H1Listener, H1Protocol, _Cycle
from transport.loop import LOOPS
from transport.loop import run as run_on_loop

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class NullTransport:
    """Writes nothing, and answers what the protocols ask."""

    def write(self, data: bytes) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


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
    out.append(_framed(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return out


async def measure(chunks: list[bytes], streams: int, *, splice: bool) -> float:
    """Seconds of wall time per chunk (one process, nothing else running in it). `splice`:
    through the listener's body writer, from the pool's read callback (what our HTTP/1.1
    listener gets); else as ASGI messages sent by the relay's task (what hypercorn gets)."""
    loop = asyncio.get_running_loop()
    host = UpstreamPool()._host("http://127.0.0.1:9")
    listener = H1Listener(_no_app, host="127.0.0.1", port=0)
    proto = H1Protocol(listener, loop)
    proto.connection_made(NullTransport())  # type: ignore[arg-type]
    total = 0.0
    try:
        for _ in range(streams):
            conn = _Connection(host)
            conn.connection_made(NullTransport())  # type: ignore[arg-type]
            host.all.add(conn)
            host.active += 1
            conn.send(b"")
            conn.data_received(HEAD)
            response = UpstreamResponse(
                host=host, conn=conn, status=200, headers=conn.response.headers, reused=True,
                chunk_timeout=30,
            )  # fmt: skip
            cycle = _Cycle(proto, {"method": "POST", "http_version": "1.1"}, keep_alive=True)
            await cycle.send({"type": "http.response.start", "status": 200, "headers": []})

            async def feed(conn: _Connection = conn) -> None:
                for chunk in chunks:
                    await asyncio.sleep(0)  # a loop turn per chunk, as a read per chunk
                    conn.data_received(chunk)

            started = time.perf_counter()
            feeder = loop.create_task(feed())
            result = RelayResult()
            writer = cycle if splice else None
            await relay_stream(response, cycle.send, result, writer=writer)
            await feeder
            total += time.perf_counter() - started
            if len(result.delays) != len(chunks) - 1 or not cycle.finished:
                raise RuntimeError(f"the relay passed {len(result.delays)} tokens, not all")
            proto._cycle = None
    finally:
        await listener.stop()  # never started: closes its bound socket
    return total / (streams * len(chunks))


async def loop_turn(turns: int) -> float:
    """Seconds per bare loop turn (`asyncio.sleep(0)`), the feeder's share of each chunk."""
    started = time.perf_counter()
    for _ in range(turns):
        await asyncio.sleep(0)
    return (time.perf_counter() - started) / turns


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("not called")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.relay_cpu", description=__doc__,
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
