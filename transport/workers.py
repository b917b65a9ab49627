"""Worker processes: one runs its listeners until a signal; N share the ports with SO_REUSEPORT.

`run_worker` runs one worker on the running loop: it opens the app (`AppFactory`, so that the
transport never imports what it serves), starts the `Listeners`, readies the garbage collector
and waits for SIGTERM/SIGINT (drain) or SIGHUP (reload the certificate). `serve` runs one worker
in this process, or spawns N (`workers` > 1) and forwards signals to them.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from transport import steering
from transport.asgi import ASGIApp
from transport.collector import prepare_collector
from transport.config import TransportConfig
from transport.gc_pauses import GcPauseProbe
from transport.listeners import Listeners, ticket_store
from transport.loop import run as run_on_loop
from transport.loop import running_loop_name
from transport.metrics import TransportMetrics
from transport.read_delay import ReadDelayProbe
from transport.tls import TlsMaterial, resolve_files

log = logging.getLogger("quicedge.serve")

Announce = Callable[[list[str]], None]


@dataclass
class ServedApps:
    """The two apps one worker serves, and how to close them after the drain."""

    app: ASGIApp
    admin_app: ASGIApp
    aclose: Callable[[], Awaitable[None]]
    reload: Callable[[], None] | None = None
    """SIGHUP: what the apps reload besides the certificate (the policy modules)."""


class AppFactory(Protocol):
    """Makes a worker's apps inside that worker (picklable: it is sent to spawned workers)."""

    async def open(self, registry: CollectorRegistry) -> ServedApps: ...

    def describe(self) -> str: ...

    def for_worker(self, index: int) -> AppFactory:
        """The factory as worker `index` of several runs it (itself when that changes nothing)."""
        ...


def _reloader(tls: TlsMaterial, apps: ServedApps) -> Callable[[], None]:
    """SIGHUP: the certificate, then whatever the apps reload."""

    def reload() -> None:
        tls.reload()
        if apps.reload is not None:
            apps.reload()

    return reload


@dataclass
class Plan:
    """What each worker process runs (picklable: sent to spawned workers)."""

    transport: TransportConfig
    apps: AppFactory
    reuse_port: bool = False
    worker: int = 0
    """This worker's index among the processes of one serve (its stateless reset key's)."""


def print_ready(lines: list[str]) -> None:
    """Where the listeners are, then `ready`: what a supervisor or a test waits for."""
    for line in lines:
        print(f"quicedge serve: {line}")
    print("ready", flush=True)


async def run_worker(
    plan: Plan,
    *,
    announce: Announce,
    stop: asyncio.Event | None = None,
    h3_socket: socket.socket | None = None,
) -> None:
    """Run the listeners until SIGTERM/SIGINT (or `stop`), then drain and close. `h3_socket`:
    this worker's UDP socket of the group its parent bound (`transport.steering`)."""
    t = plan.transport
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    registry = CollectorRegistry()
    metrics = TransportMetrics(registry)
    keylog = Path(t.tls_keylog) if t.tls_keylog else None
    tls = TlsMaterial(resolve_files(t.cert, t.key), keylog=keylog)
    apps = await plan.apps.open(registry)
    tickets = ticket_store(t)
    listeners = Listeners(
        t,
        app=apps.app,
        admin_app=apps.admin_app,
        tls=tls,
        tickets=tickets,
        metrics=metrics,
        reuse_port=plan.reuse_port,
        worker=plan.worker,
        h3_socket=h3_socket,
    )
    probe = ReadDelayProbe(metrics.read_delay)
    gc_pauses = GcPauseProbe(metrics.gc_pauses)
    try:
        lines = await listeners.start()
        store = (
            f"redis {t.redis} ({'sealed' if t.ticket_secret else 'NOT sealed: --ticket-secret'})"
            if t.redis
            else "memory (this process only)"
        )
        lines.append(f"tickets {store}; retry {'on' if t.quic_retry else 'off'}")
        if keylog is not None:
            lines.append(
                f"TLS keylog {keylog}: every connection's secrets; whoever reads it can decrypt"
                " this edge's traffic (debugging only)"
            )
        lines.append(f"early data: {t.early_data.describe()}")
        lines.append(f"loop   {running_loop_name()}")
        lines.append(f"app    {plan.apps.describe()}")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, _reloader(tls, apps))
        prepare_collector()
        probe.start()
        gc_pauses.start()  # after the freeze's own full collection
        announce(lines)
        await stop.wait()
        await listeners.drain()
    finally:
        probe.stop()
        gc_pauses.stop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await listeners.aclose()
        await apps.aclose()
        tickets.close()


def _worker_entry(plan: Plan, index: int, ready: Any, h3_socket: socket.socket | None) -> None:
    """A spawned worker: run, and report its listening lines once up (or why it failed)."""
    logging.basicConfig(level=logging.WARNING, format=f"worker {index}: %(message)s")
    plan = replace(plan, apps=plan.apps.for_worker(index), worker=index)
    # SIGTERM/SIGINT (from the parent, or a terminal's Ctrl-C to the process group) drain;
    # a second one while draining changes nothing.
    try:
        run_on_loop(
            run_worker(plan, announce=lambda lines: ready.put((index, lines)), h3_socket=h3_socket),
            plan.transport.loop,
        )
    except Exception as exc:  # report, so the parent does not wait forever
        ready.put((index, f"failed: {exc}"))
        raise


def _concrete(addr: tuple[str, int] | None, kind: int) -> tuple[str, int] | None:
    """Port 0 → a concrete free port, so that every worker binds the same one."""
    if addr is None or addr[1] != 0:
        return addr
    with socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, kind) as s:
        s.bind(addr)
        return addr[0], int(s.getsockname()[1])


def run_workers(plan: Plan, *, announce: Announce = print_ready) -> int:
    """Spawn `workers` processes on the same ports; forward SIGTERM/SIGINT/SIGHUP to them.
    The exit status is the worst of theirs (1 if one failed before reporting)."""
    t = plan.transport
    t = replace(
        t,
        h3=_concrete(t.h3, socket.SOCK_DGRAM) or t.h3,
        tcp=_concrete(t.tcp, socket.SOCK_STREAM),
        admin=_concrete(t.admin, socket.SOCK_STREAM),
        http=_concrete(t.http, socket.SOCK_STREAM),
    )
    if t.quic_retry_secret is None:  # one key for every worker's Retry and address tokens
        t = replace(t, quic_retry_secret=os.urandom(24).hex())
    plan = replace(plan, transport=t, reuse_port=True)
    group = _steered_sockets(t)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker_entry,
            args=(plan, i, ready, group[i] if group else None),
            name=f"quicedge-worker-{i}",
        )
        for i in range(t.workers)
    ]
    for proc in procs:
        proc.start()

    stopping: list[int] = []  # the signals that stop the workers, once one came

    def forward(signum: int, _frame: Any) -> None:
        if signum != signal.SIGHUP:
            stopping.append(signum)
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    reported: dict[int, Any] = {}
    while len(reported) < len(procs):
        try:
            index, lines = ready.get(timeout=0.5)
        except Exception:  # queue.Empty: check that nobody died before reporting
            if any(not p.is_alive() for p in procs):
                forward(signal.SIGTERM, None)
                break
            continue
        reported[index] = lines
        if isinstance(lines, str):
            print(f"quicedge serve: worker {index} {lines}", file=sys.stderr)
            forward(signal.SIGTERM, None)
            break
    else:
        spread = "connection ID" if group else "client address"
        pids = [p.pid for p in procs]
        announce([*reported[0], f"workers {t.workers} (pids {pids}; QUIC by {spread})"])
    _wait_for(procs, group, stopping)
    return max((p.exitcode or 0) for p in procs) if reported else 1


def _wait_for(procs: list[Any], group: list[socket.socket], stopping: list[int]) -> None:
    """Wait until every worker has ended. The parent holds the steered sockets until then, so
    the group's order never changes; but once a worker has ended, the datagrams its index
    named would wait on its socket for nobody, so the group goes back to the address hash (its
    socket closed: the others take its new clients; its connections were lost with it)."""
    alive = list(procs)
    while alive:
        ended = multiprocessing.connection.wait([p.sentinel for p in alive])
        for proc in [p for p in alive if p.sentinel in ended]:
            proc.join()
            alive.remove(proc)
            if group and alive and not stopping:  # a worker that died, not one told to stop
                log.warning(
                    "worker %s ended (exit %s): HTTP/3 datagrams spread by client address now",
                    proc.name, proc.exitcode,
                )  # fmt: skip
                steering.spread_by_address(group[procs.index(alive[0])])
                group[procs.index(proc)].close()
    for sock in group:
        sock.close()


def _steered_sockets(t: TransportConfig) -> list[socket.socket]:
    """One UDP socket per worker with the connection-ID steering program, bound here in worker
    order (`transport.steering`); none where steering is off or the kernel refuses it (then
    each worker binds its own and the kernel spreads clients by address)."""
    if not t.quic_worker_steering:
        return []
    try:
        return steering.bind_group(t.h3[0], t.h3[1], t.workers)
    except OSError as exc:
        log.warning("HTTP/3 datagrams spread by client address, not by connection ID: %s", exc)
        return []


def serve(plan: Plan, *, announce: Announce = print_ready) -> int:
    """Run `plan` to the end: in this process, or in `workers` spawned ones. Exit status."""
    if plan.transport.workers > 1:
        return run_workers(plan, announce=announce)
    try:
        run_on_loop(run_worker(plan, announce=announce), plan.transport.loop)
    except OSError as exc:  # a port in use, an address not on this machine
        print(f"quicedge serve: {exc}", file=sys.stderr)
        return 1
    return 0


__all__ = [
    "AppFactory",
    "Plan",
    "ServedApps",
    "print_ready",
    "run_worker",
    "run_workers",
    "serve",
]
