"""The edge's memory under uploads that never end, with and without its body budget.

    .venv/bin/python -m tools.pending_bodies [--uploads 100] [--size 8000000] [--budget BYTES ...]

For each `--budget` (`max_pending_body_bytes`; 0: no cap) it starts `quicedge serve --http`
(`--max-body` the body's size) in front of a backend address nothing listens on (the body is
read before any backend is asked). It opens `--uploads` connections one after another and on
each sends a chat completion's head and all but the last byte of a `--size`-byte body, as a
client that stalls would. A second after the last, it reads the edge's resident memory from
/proc and counts the uploads the edge refused (503 `overloaded`, or a close). docs/errors.md,
its bodies still arriving, has the numbers. This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from bench.children import free_port
from tools.handshakes import wait_for_ready

CHUNK = 64 * 1024


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@contextlib.contextmanager
def _serve(budget: int, size: int) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port(socket.SOCK_STREAM)
    cmd = [
        sys.executable, "-m", "edge.cli", "serve", "--http", f"127.0.0.1:{port}",
        "--h3", f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}", "--tcp", "off", "--admin", "off",
        "--backend", f"http://127.0.0.1:{free_port(socket.SOCK_STREAM)}", "--no-access-log",
        "--max-body", str(size), "--max-pending-body-bytes", str(budget),
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
        try:
            wait_for_ready(proc, timeout=30, what="quicedge serve")
        except RuntimeError as exc:
            log.seek(0)
            raise RuntimeError(f"{exc}: {log.read().decode(errors='replace')[-500:]}") from None
        try:
            yield port, proc
        finally:
            proc.terminate()
            proc.wait(30)


async def _stall(port: int, size: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
    """One upload of all but the last byte of `size`; False when the edge cut it off first."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\n"
        f"content-type: application/json\r\ncontent-length: {size}\r\n\r\n"
    ).encode()
    try:
        writer.write(head)
        left = size - 1
        while left > 0:
            writer.write(b" " * min(CHUNK, left))
            left -= min(CHUNK, left)
            await writer.drain()
    except ConnectionError:
        return reader, writer, False
    return reader, writer, True


async def _refused(reader: asyncio.StreamReader) -> bool:
    """Whether the edge answered (a refusal: nothing else comes before the body's end) or
    closed the connection."""
    try:
        line = await asyncio.wait_for(reader.readline(), 0.01)
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return not line or line.startswith(b"HTTP/1.1 503")


async def _measure(port: int, pid: int, uploads: int, size: int) -> tuple[int, int, int]:
    before = _rss_mib(pid)
    sent = [await _stall(port, size) for _ in range(uploads)]
    try:
        await asyncio.sleep(1.0)
        after = _rss_mib(pid)
        refused = [not whole or await _refused(reader) for reader, _, whole in sent]
        return before, after, refused.count(True)
    finally:
        for _, writer, _ in sent:
            writer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.pending_bodies", description=__doc__.split("\n")[0]
    )
    p.add_argument("--uploads", type=int, default=100, help="uploads that never end (100)")
    p.add_argument("--size", type=int, default=8_000_000, help="bytes of each body (8000000)")
    p.add_argument(
        "--budget", type=int, action="append",
        help="max_pending_body_bytes to run with, repeatable (0, 268435456, 67108864)",
    )  # fmt: skip
    args = p.parse_args(argv)
    budgets = args.budget or [0, 256 * 1024 * 1024, 64 * 1024 * 1024]
    if args.uploads < 1 or args.size < 2:
        p.error("--uploads must be >= 1 and --size >= 2")
    if any(b != 0 and b < args.size for b in budgets):
        p.error("every --budget must be 0 (no cap) or at least --size (the edge's max body)")
    print(f"quicedge pending bodies: {args.uploads} uploads of {args.size} bytes that never end")
    print(f"{'budget':>12} {'RSS before':>11} {'RSS after':>10} {'refused':>8}")
    for budget in budgets:
        with _serve(budget, args.size) as (port, proc):
            before, after, refused = asyncio.run(_measure(port, proc.pid, args.uploads, args.size))
        mib, rest = divmod(budget, 1024 * 1024)
        shown = "no cap" if budget == 0 else f"{mib} MiB" if not rest else f"{budget} B"
        print(f"{shown:>12} {before:>7} MiB {after:>6} MiB {refused:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
