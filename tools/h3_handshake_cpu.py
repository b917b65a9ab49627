"""Server CPU per QUIC handshake plus one short HTTP/3 request, split by layer; prints a report.

    .venv/bin/python -m tools.h3_handshake_cpu [--connections 200] [--top 15] [--loop auto]

The HTTP/3 listener (``H3Server`` with the ``--demo`` app, a memory ticket store and the
transport's metrics, as ``quicedge serve --demo`` runs it) runs on its own event loop in a thread
of this process; aioquic clients drive it from the main thread, one connection at a time: a
*full* handshake, or a *0-RTT* resumption that redeems the previous connection's ticket and sends
its request in early data. Each connection makes one POST, reads the answer and closes; the
measurement waits until the server has dropped every connection, so the close is counted too.

The server thread's CPU (``time.thread_time``: user + system of that thread alone, so the clients'
work is not in it) gives CPU per connection and connections per second per core. A second pass
runs under cProfile, enabled in the server thread only, and attributes each function's own time
to a layer by its module; time in C functions (signatures, AEAD, the buffer codec) goes to the
layer of the Python function that called them. cProfile's overhead inflates the profiled pass,
so the report gives the layers as shares and scales them to the unprofiled CPU.
This is a measurement, not a test: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aioquic.asyncio.client import connect
from aioquic.tls import SessionTicket
from prometheus_client import CollectorRegistry

from certs import ensure_dev_certificates
from tools.handshakes import BadStatus, H3Client, client_config
from transport.demo import demo_app
from transport.h3_server import H3Server
from transport.loop import loop_factory, resolve
from transport.metrics import TransportMetrics
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial

T = TypeVar("T")

# (layer, module path prefixes), first match wins: aioquic's packet protection lives in
# quic/crypto.py and _crypto.py (AEAD and header protection over `cryptography`), its TLS 1.3
# state machine in tls.py (which builds its messages with
# contextlib's context managers); `cryptography` is signatures, key exchange, certificates.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TLS messages", ("aioquic/tls.py", "cryptography/", "contextlib.py")),
    ("packet protection", ("aioquic/quic/crypto.py", "aioquic/_crypto.py")),
    ("packet building", ("aioquic/quic/packet_builder.py", "aioquic/quic/packet.py",
                         "aioquic/buffer")),
    ("QUIC connection", ("aioquic/quic/",)),
    ("H3", ("aioquic/h3/", "pylsqpack", "transport/h3_connection.py")),
    ("quicedge transport", ("transport/",)),
    ("the app", ("edge/", "backends/", "json/")),
    ("metrics", ("prometheus_client/",)),
    ("event loop", ("asyncio/", "uvloop/", "selectors.py", "socket.py", "aioquic/asyncio/")),
)  # fmt: skip
OTHER = "other"
_APP_MODULES = ("transport/demo.py",)


_ROOT = str(Path(__file__).resolve().parent.parent).replace(os.sep, "/") + "/"
_STDLIB = str(Path(os.__file__).parent).replace(os.sep, "/") + "/"


def module_path(filename: str) -> str:
    """A code file's path as an import would name it: ``aioquic/tls.py``, ``transport/...``."""
    path = filename.replace(os.sep, "/")
    for root in ("site-packages/", "dist-packages/"):
        if root in path:
            return path.rsplit(root, 1)[1]
    for root in (_ROOT, _STDLIB):
        if path.startswith(root):
            return path[len(root) :]
    return path


def layer_of(filename: str) -> str:
    path = module_path(filename)
    if any(m in path for m in _APP_MODULES):
        return "the app"
    for name, parts in LAYERS:
        if any(path.startswith(p) for p in parts):
            return name
    return OTHER


@dataclass
class Pass:
    kind: str
    connections: int
    early: int
    cpu_s: float
    wall_s: float
    layers: dict[str, float] = field(default_factory=dict)
    """Own seconds by layer (profiled pass only)."""
    top: list[tuple[float, str]] = field(default_factory=list)

    @property
    def cpu_per_connection(self) -> float:
        return self.cpu_s / max(1, self.connections)


def split_by_layer(stats: pstats.Stats) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """Own time by layer; a C function's (file ``~``) goes to its callers' layers, in
    proportion to the time each caller spent in it."""
    layers: dict[str, float] = defaultdict(float)
    top: list[tuple[float, str]] = []
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (filename, line, name), (_cc, _nc, tt, _ct, callers) in raw.items():
        top.append((tt, f"{Path(filename).name}:{line}({name})" if line else name))
        if filename != "~" or not callers:
            layers[layer_of(filename)] += tt
            continue
        spent = sum(c[2] for c in callers.values()) or 1.0
        for (caller_file, _l, _n), c in callers.items():
            layers[layer_of(caller_file)] += tt * c[2] / spent
    top.sort(reverse=True)
    return dict(layers), top


class ServerThread:
    """The H3 listener on its own loop in a thread; `call` runs a coroutine there."""

    def __init__(self, loop_name: str) -> None:
        self._loop = loop_factory(loop_name)()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        certs = ensure_dev_certificates()
        tls = TlsMaterial(CertificateFiles(certs.cert, certs.key))
        self.server = H3Server(
            demo_app,
            tls=tls,
            tickets=MemoryTicketStore(),
            metrics=TransportMetrics(CollectorRegistry()),
        )
        self.call(self.server.start("127.0.0.1", 0))
        self.profile: cProfile.Profile | None = None
        self._cpu0 = 0.0

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(60)

    async def begin(self, profile: bool) -> None:
        self._cpu0 = time.thread_time()
        if profile:
            # Thread CPU, not wall time: the server thread loses the GIL to the clients.
            self.profile = cProfile.Profile(time.thread_time)
            self.profile.enable()

    async def end(self) -> tuple[float, cProfile.Profile | None]:
        profile, self.profile = self.profile, None
        if profile is not None:
            profile.disable()
        return time.thread_time() - self._cpu0, profile

    async def idle(self, timeout: float = 30.0) -> None:
        """Until the server holds no connection (closing periods over)."""
        deadline = time.monotonic() + timeout
        while self.server.connections() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    def close(self) -> None:
        self.call(self.server.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


async def drive(
    port: int, ca: Path, *, n: int, ticket: SessionTicket | None, timeout: float = 10.0
) -> tuple[int, int]:
    """`n` connections one after another (0-RTT on each previous ticket when `ticket` is given);
    returns (answered, accepted in 0-RTT)."""
    answered = early = 0
    resume = ticket is not None
    for _ in range(n):
        tickets: list[SessionTicket] = []
        config = client_config(ca, ticket if resume else None)
        async with connect(
            "127.0.0.1", port, configuration=config, create_protocol=H3Client,
            session_ticket_handler=tickets.append, wait_connected=not resume,
        ) as client:  # fmt: skip
            assert isinstance(client, H3Client)
            client.post_empty()
            await asyncio.wait_for(client.done.wait(), timeout)
            client.raise_for_status()  # an error answer is no handshake measured
            for _ in range(1000):  # the next ticket comes with the handshake's end
                if tickets:
                    break
                await asyncio.sleep(0.001)
            answered += 1
            early += client.early
            ticket = tickets[-1] if tickets else None
    return answered, early


def measure(
    server: ServerThread,
    ca: Path,
    kind: str,
    n: int,
    *,
    profile: bool,
    ticket_for: Callable[[], SessionTicket | None],
) -> Pass:
    ticket = ticket_for() if kind == "0-RTT" else None
    server.call(server.begin(profile))
    t0 = time.perf_counter()
    answered, early = asyncio.run(drive(server.server.port, ca, n=n, ticket=ticket))
    server.call(server.idle())
    cpu, prof = server.call(server.end())
    result = Pass(kind, answered, early, cpu, time.perf_counter() - t0)
    if prof is not None:
        result.layers, result.top = split_by_layer(pstats.Stats(prof))
    return result


async def first_ticket(port: int, ca: Path) -> SessionTicket | None:
    """A full handshake that returns the ticket the server issued (starts a 0-RTT chain)."""
    tickets: list[SessionTicket] = []
    config = client_config(ca, None)
    async with connect(
        "127.0.0.1", port, configuration=config, create_protocol=H3Client,
        session_ticket_handler=tickets.append,
    ):  # fmt: skip
        for _ in range(1000):
            if tickets:
                break
            await asyncio.sleep(0.001)
    return tickets[-1] if tickets else None


def _first_ticket(server: ServerThread, ca: Path) -> Callable[[], SessionTicket | None]:
    return lambda: asyncio.run(first_ticket(server.server.port, ca))


def report(plain: list[Pass], profiled: list[Pass], top: int, out: Callable[[str], Any]) -> None:
    head = f"{'handshake':<10} {'conns':>6} {'0-RTT ok':>9}"
    out(f"{head} {'server CPU/conn':>16} {'conn/s/core':>12}")
    for p in plain:
        per = p.cpu_per_connection
        out(
            f"{p.kind:<10} {p.connections:>6} {p.early:>9} {per * 1e3:>13.3f} ms"
            f" {1 / per if per else 0:>12.0f}"
        )
    for p, q in zip(plain, profiled, strict=True):
        total = sum(q.layers.values()) or 1.0
        out(f"\n{q.kind}: by layer (own time under cProfile, scaled to the unprofiled CPU)")
        for name, seconds in sorted(q.layers.items(), key=lambda kv: -kv[1]):
            share = seconds / total
            out(
                f"  {name:<20} {share * 100:>5.1f} %  {share * p.cpu_per_connection * 1e3:>7.3f} ms"
            )
        if top:
            out(f"  top {top} functions by own time (profiled µs per connection):")
            for seconds, name in q.top[:top]:
                out(f"    {seconds / max(1, q.connections) * 1e6:>8.1f}  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.h3_handshake_cpu", description=__doc__.split("\n")[0]
    )
    p.add_argument("--connections", type=int, default=200, help="connections per pass (200)")
    p.add_argument("--top", type=int, default=15, help="functions listed per profile (15)")
    p.add_argument("--loop", default="auto", help="server event loop: auto, asyncio, uvloop")
    args = p.parse_args(argv)
    if args.connections < 1:
        p.error("--connections must be >= 1")
    ca = ensure_dev_certificates().ca_cert
    server = ServerThread(args.loop)
    out: Callable[[str], Any] = print
    try:
        ticket_for = _first_ticket(server, ca)
        out(f"quicedge HTTP/3 handshake CPU: {args.connections} connections per pass, one at a "
            f"time, one POST each; server loop {resolve(args.loop)}, {os.cpu_count()} CPUs, "
            f"load average {os.getloadavg()[0]:.1f} at start\n")  # fmt: skip
        warm = max(1, args.connections // 10)
        for kind in ("full", "0-RTT"):
            measure(server, ca, kind, warm, profile=False, ticket_for=ticket_for)
        plain = [
            measure(server, ca, k, args.connections, profile=False, ticket_for=ticket_for)
            for k in ("full", "0-RTT")
        ]
        profiled = [
            measure(server, ca, k, args.connections, profile=True, ticket_for=ticket_for)
            for k in ("full", "0-RTT")
        ]
        report(plain, profiled, args.top, out)
    except BadStatus as exc:
        print(f"tools.h3_handshake_cpu: {exc}", file=sys.stderr)
        return 1
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
