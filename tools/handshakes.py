"""QUIC handshakes per second with each session-ticket store (memory, Redis); prints a report.

    .venv/bin/python -m tools.handshakes [--duration 5] [--concurrency 8] [--redis URL]

For each store it starts ``quicedge serve --demo`` in its own process and drives it with aioquic
clients from this one: *full* handshakes (no ticket; the server stores a new ticket each time)
and *0-RTT* resumptions (each connection redeems the ticket of the previous one with a GETDEL
and sends its request in 0-RTT; the server stores the next ticket). Every connection makes one
request and closes; an answer other than 2xx ends the run (exit status 1, naming the status):
it would count an error answer as a handshake. It reports connections/s and the server's CPU
per handshake, and the store's own cost per ``put`` + ``take`` pair as the event loop pays it
(that is what the synchronous fetcher costs). Without ``--redis`` it starts a private
``redis-server``. This is a measurement, not a test: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import selectors
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import HandshakeCompleted, QuicEvent
from aioquic.tls import CipherSuite, SessionTicket

from bench.children import free_port
from certs import ensure_dev_certificates
from transport.tickets import MemoryTicketStore, RedisTicketStore, TicketStore


class BadStatus(RuntimeError):
    """A measured request was answered with a status other than 2xx (or none): the connection
    measured an error answer, not the handshake and request the tool reports."""

    def __init__(self, status: int | None) -> None:
        said = "no :status" if status is None else f"status {status}"
        super().__init__(f"the server answered POST /generate with {said}, not 2xx: the run "
                         "measured error answers, not handshakes")  # fmt: skip
        self.status = status


class H3Client(QuicConnectionProtocol):
    """An aioquic client connection that notes whether 0-RTT was accepted and the response's
    status, and sets `done` when a response has ended (one request per connection)."""

    def __init__(self, quic: QuicConnection, *args: Any, **kwargs: Any) -> None:
        super().__init__(quic, *args, **kwargs)
        self.quic = quic  # aioquic's own reference (`_quic`) is private
        self.h3 = H3Connection(quic)
        self.done = asyncio.Event()
        self.early = False
        self.status: int | None = None

    def raise_for_status(self) -> None:
        """BadStatus unless the response (ended: `done`) had a 2xx status."""
        if self.status is None or not 200 <= self.status < 300:
            raise BadStatus(self.status)

    def post_empty(self) -> None:
        """Send one bodiless `POST /generate` (the request each measured connection makes)."""
        sid = self.quic.get_next_available_stream_id()
        self.h3.send_headers(
            sid,
            [(b":method", b"POST"), (b":scheme", b"https"),
             (b":authority", b"localhost"), (b":path", b"/generate")],
            end_stream=True,
        )  # fmt: skip
        self.transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.early = event.early_data_accepted
        for e in self.h3.handle_event(event):
            if isinstance(e, HeadersReceived) and self.status is None:
                status = dict(e.headers).get(b":status", b"")
                self.status = int(status) if status.isdigit() else None
            if isinstance(e, HeadersReceived | DataReceived) and e.stream_ended:
                self.done.set()


@dataclass
class Result:
    connections: int
    early: int
    seconds: float
    server_cpu: float


def client_config(ca: Path, ticket: SessionTicket | None) -> QuicConfiguration:
    """An HTTP/3 client configuration trusting `ca`, resuming with `ticket` when given."""
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
    config.load_verify_locations(str(ca))
    config.session_ticket = ticket
    return config


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_ready(proc: subprocess.Popen[bytes], *, timeout: float, what: str) -> None:
    """Read `proc`'s stdout until `serve` prints its `ready` line; RuntimeError, naming `what`,
    when it exits first or stays silent for `timeout` s."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        seen = b""
        while b"ready\n" not in seen:
            if not sel.select(timeout=timeout):
                raise RuntimeError(f"{what} did not start")
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"{what} exited")
            seen += chunk


@contextlib.contextmanager
def _serve(*args: str) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port(socket.SOCK_DGRAM)
    cmd = [sys.executable, "-m", "edge.cli", "serve", "--demo", "--h3", f"127.0.0.1:{port}"]
    cmd += ["--tcp", "off", "--admin", "off", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        wait_for_ready(proc, timeout=30, what="quicedge serve")
        yield port, proc
    finally:
        proc.terminate()
        proc.wait(30)


async def _drive(
    port: int, ca: Path, *, resume: bool, duration: float, concurrency: int
) -> tuple[int, int]:
    deadline = asyncio.get_running_loop().time() + duration
    counts = [0, 0]

    closing: set[asyncio.Task[None]] = set()

    async def one(
        ticket: SessionTicket | None, answered: asyncio.Future[SessionTicket | None]
    ) -> None:
        tickets: list[SessionTicket] = []
        config = client_config(ca, ticket)
        try:
            async with connect(
                "127.0.0.1", port, configuration=config, create_protocol=H3Client,
                session_ticket_handler=tickets.append, wait_connected=ticket is None,
            ) as client:  # fmt: skip
                assert isinstance(client, H3Client)
                client.post_empty()
                await asyncio.wait_for(client.done.wait(), 10)
                client.raise_for_status()
                for _ in range(100):  # the next ticket comes with the handshake's end
                    if tickets:
                        break
                    await asyncio.sleep(0.001)
                counts[0] += 1
                counts[1] += client.early
                answered.set_result(tickets[-1] if tickets else None)
                # leaving the block waits out the closing period (3 PTO): not our business
        except Exception as exc:
            if not answered.done():
                answered.set_exception(exc)

    async def worker() -> None:
        ticket: SessionTicket | None = None
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            answered: asyncio.Future[SessionTicket | None] = loop.create_future()
            task = asyncio.create_task(one(ticket if resume else None, answered))
            closing.add(task)
            task.add_done_callback(closing.discard)
            ticket = await answered

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await asyncio.gather(*closing)
    return counts[0], counts[1]


def _measure(store_args: list[str], ca: Path, resume: bool, args: argparse.Namespace) -> Result:
    with _serve(*store_args) as (port, proc):
        asyncio.run(_drive(port, ca, resume=resume, duration=0.5, concurrency=2))  # warm up
        cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
        n, early = asyncio.run(
            _drive(port, ca, resume=resume, duration=args.duration, concurrency=args.concurrency)
        )
        return Result(n, early, time.perf_counter() - t0, _cpu_seconds(proc.pid) - cpu0)


def _store_cost(store: TicketStore, n: int = 5000) -> float:
    """Microseconds of (blocking) loop time per put + take pair."""
    start = dt.datetime.now(dt.UTC)
    tickets = [
        SessionTicket(
            age_add=1,
            cipher_suite=CipherSuite.AES_128_GCM_SHA256,
            not_valid_after=start + dt.timedelta(days=1),
            not_valid_before=start,
            resumption_secret=os.urandom(32),
            server_name="localhost",
            ticket=os.urandom(64),
            max_early_data_size=0xFFFFFFFF,
        )  # fmt: skip
        for _ in range(n)
    ]
    t0 = time.perf_counter()
    for t in tickets:
        store.put(t)
        assert store.take(t.ticket) is not None
    return (time.perf_counter() - t0) / n * 1e6


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no --redis URL and no redis-server binary")
    port = free_port(socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.handshakes", description=__doc__.split("\n")[0]
    )
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measurement (5)")
    p.add_argument("--concurrency", type=int, default=8, help="connections in flight (8)")
    p.add_argument("--redis", help="Redis URL (default: a private redis-server)")
    args = p.parse_args(argv)
    ca = ensure_dev_certificates().ca_cert
    print(f"quicedge handshakes: {args.concurrency} concurrent clients, {args.duration}s per row,")
    print(f"server + clients on one machine ({os.cpu_count()} CPUs), one request per connection;")
    print(f"load average {os.getloadavg()[0]:.1f} at start\n")
    head = f"{'store':<8} {'handshake':<10} {'conn/s':>8} {'0-RTT ok':>9}"
    print(f"{head} {'server CPU/handshake':>21} {'server-CPU-bound/s':>19}")
    with _redis(args.redis) as url:
        stores = {"memory": [], "redis": ["--redis", url]}
        for name, store_args in stores.items():
            for resume in (False, True):
                try:
                    r = _measure(store_args, ca, resume, args)
                except BadStatus as exc:
                    print(f"tools.handshakes: {exc}", file=sys.stderr)
                    return 1
                kind = "0-RTT" if resume else "full"
                per = r.server_cpu / max(1, r.connections)
                print(
                    f"{name:<8} {kind:<10} {r.connections / r.seconds:>8.0f} "
                    f"{r.early:>9d} {per * 1e3:>18.2f} ms {1 / per if per else 0:>19.0f}"
                )
        print("\nstore cost per put + take (loop time the synchronous fetcher/handler block):")
        mem = MemoryTicketStore()
        print(f"  memory  {_store_cost(mem):8.1f} µs")
        # A generous timeout: the edge's 50 ms makes one answer slower than 10 ms (a loaded
        # machine) cool the store down and refuse the rest; the cost measured is the same.
        rs = RedisTicketStore(url, prefix=f"quicedge-bench:{os.getpid()}:", timeout=5.0)
        try:
            print(f"  redis   {_store_cost(rs):8.1f} µs  ({url})")
        finally:
            rs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
