"""Worker processes: one runs its listeners until a signal; N share the ports with SO_REUSEPORT.

`run_worker` runs one worker on the running loop: it opens the app (`AppFactory`, so that the
transport never imports what it serves), starts the `Listeners`, readies the garbage collector
and waits for SIGTERM/SIGINT (drain) or SIGHUP (reload the certificate). `serve` runs one worker
in this process, or spawns N (`workers` > 1) and forwards signals to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from transport import steering
from transport.asgi import ASGIApp
from transport.collector import prepare_collector
from transport.config import TransportConfig
from transport.file_watch import FileWatch
from transport.gc_pauses import GcPauseProbe
from transport.listeners import Listeners, ticket_store
from transport.loop import run as run_on_loop
from transport.loop import running_loop_name
from transport.metrics import TransportMetrics
from transport.read_delay import ReadDelayProbe
from transport.redacted import without_password
from transport.sockets import bind_naming
from transport.tls import TlsMaterial, resolve_files

log = logging.getLogger("quicedge.serve")

Announce = Callable[[list[str]], None]

RELOAD_SIGNALS = {signal.SIGHUP}
"""Held (blocked, so pending rather than lost) from a worker's first instruction until its
handler is in place: the default action of SIGHUP is to end the process, and a reload sent
while a worker starts (or starts again) must not cost the worker."""


def _hold_reloads() -> set[int | signal.Signals]:
    """Block SIGHUP in this thread (and in the processes and threads it starts from now on);
    the mask as it was."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, RELOAD_SIGNALS)


def _release_reloads() -> None:
    """Unblock SIGHUP: one that came while it was held is delivered now, to the handler."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELOAD_SIGNALS)


def _ignore() -> None:
    """SIGHUP's handler once a worker closes: the loop's close removes it, and by then the
    worker's thread holds SIGHUP blocked again (`run_worker`)."""


@dataclass
class ServedApps:
    """The two apps one worker serves, and how to close them after the drain."""

    app: ASGIApp
    admin_app: ASGIApp
    aclose: Callable[[], Awaitable[None]]
    reload: Callable[[], None] | None = None
    """SIGHUP: what the apps reload besides the certificate (the policy modules)."""
    record: Callable[..., object] | None = None
    """`record(event, **fields)`: where the transport's own events (a certificate reload) go
    beside the apps' (the audit log); None: nowhere."""
    settle: Callable[[float], Awaitable[None]] | None = None
    """`settle(timeout)`, beside the listeners' drain: let the apps' work that outlives its
    requests (background answers) finish for up to `timeout` seconds."""


class StartupError(Exception):
    """The apps could not start, for a reason the operator fixes (a log the edge refuses, a file
    it cannot open): `serve` prints its one line and exits 1, with no traceback."""


class AppFactory(Protocol):
    """Makes a worker's apps inside that worker (picklable: it is sent to spawned workers)."""

    async def open(self, registry: CollectorRegistry) -> ServedApps:
        """The apps, started; StartupError when they cannot be."""
        ...

    def describe(self) -> str: ...

    def for_worker(self, index: int) -> AppFactory:
        """The factory as worker `index` of several runs it (itself when that changes nothing)."""
        ...


def reload_certificate(tls: TlsMaterial, metrics: TransportMetrics, apps: ServedApps) -> None:
    """Re-read the certificate (the old one stays if the files are broken); counted, and
    recorded where the apps record events."""
    applied = tls.reload()
    outcome = "applied" if applied else "refused"
    metrics.cert_reloads.labels(outcome).inc()
    metrics.cert_expiry.set(tls.expires_at)
    if apps.record is not None:
        apps.record("certificate_reload", outcome=outcome, cert=str(tls.files.cert),
                    expires_at=round(tls.expires_at))  # fmt: skip


def _reloader(tls: TlsMaterial, metrics: TransportMetrics, apps: ServedApps) -> Callable[[], None]:
    """SIGHUP: the certificate, then whatever the apps reload."""

    def reload() -> None:
        reload_certificate(tls, metrics, apps)
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
    starts: int = 1
    """How many times a worker with this index has been started (above 1: restarted)."""


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
    this worker's UDP socket of the group its parent bound (`transport.steering`).

    SIGHUP is held until its handler is installed, then let through: one that came while the
    worker started reloads once it is up. A spawned worker is born with it held (the parent
    blocks it around the spawn), since its imports alone take longer than a reload loop's
    period."""
    held = _hold_reloads()
    try:
        await _run_worker(plan, announce=announce, stop=stop, h3_socket=h3_socket)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


async def _run_worker(
    plan: Plan,
    *,
    announce: Announce,
    stop: asyncio.Event | None,
    h3_socket: socket.socket | None,
) -> None:
    t = plan.transport
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    registry = CollectorRegistry()
    metrics = TransportMetrics(registry)
    metrics.worker_starts.set(plan.starts)
    keylog = Path(t.tls_keylog) if t.tls_keylog else None
    tls = TlsMaterial(resolve_files(t.cert, t.key), keylog=keylog)
    metrics.cert_expiry.set(tls.expires_at)
    apps = await plan.apps.open(registry)
    cert_watch = None
    if t.cert_poll_interval is not None:
        paths = [str(tls.files.cert), str(tls.files.key)]
        cert_watch = FileWatch(
            paths, t.cert_poll_interval, lambda: reload_certificate(tls, metrics, apps)
        )
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
            f"redis {without_password(t.redis)} "
            f"({'sealed' if t.ticket_secret else 'NOT sealed: --ticket-secret'})"
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
        loop.add_signal_handler(signal.SIGHUP, _reloader(tls, metrics, apps))
        _release_reloads()
        if cert_watch is not None:
            cert_watch.start()
        prepare_collector()
        probe.start()
        gc_pauses.start()  # after the freeze's own full collection
        announce(lines)
        await stop.wait()
        settling = [apps.settle(t.drain_timeout)] if apps.settle is not None else []
        await asyncio.gather(listeners.drain(), *settling)
    finally:
        # Nothing is left to reload, but a SIGHUP must not end the close half-way: with no
        # handler its default action would, whichever thread (an executor's) it lands on.
        loop.add_signal_handler(signal.SIGHUP, _ignore)
        probe.stop()
        gc_pauses.stop()
        if cert_watch is not None:
            await cert_watch.aclose()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await listeners.aclose()
        await apps.aclose()
        tickets.close()


def _worker_entry(
    plan: Plan,
    index: int,
    ready: multiprocessing.connection.Connection,
    h3_socket: socket.socket | None,
) -> None:
    """A spawned worker: run, and report its listening lines once up (or why it failed) on
    `ready`, its own pipe to the parent."""
    logging.basicConfig(level=logging.WARNING, format=f"worker {index}: %(message)s")
    plan = replace(plan, apps=plan.apps.for_worker(index), worker=index)

    def report(what: list[str] | str) -> None:
        with contextlib.suppress(OSError):  # a parent gone: nobody to tell
            ready.send((index, what))

    # SIGTERM/SIGINT (from the parent, or a terminal's Ctrl-C to the process group) drain;
    # a second one while draining changes nothing.
    try:
        run_on_loop(run_worker(plan, announce=report, h3_socket=h3_socket), plan.transport.loop)
    except StartupError as exc:  # its one line is all there is to say
        report(f"failed: {exc}")
        sys.exit(1)
    except Exception as exc:  # report, so the parent does not wait forever
        report(f"failed: {exc}")
        raise


def _claim(addr: tuple[str, int] | None, kind: int) -> tuple[str, int] | None:
    """The address the workers will bind, free now: port 0 → a concrete free port, so that
    every worker binds the same one. The workers bind with SO_REUSEPORT, which lets them share
    the port, and would as well let them join any other process of this user that listens on
    it so (another serve): a socket without the option, bound here first, is refused wherever
    a process holds the port (OSError naming it, as one worker's own bind would)."""
    if addr is None:
        return None
    with socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, kind) as s:
        if kind == socket.SOCK_STREAM:  # as the listeners: a closed connection's TIME_WAIT
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # holds nothing
        bind_naming(s, addr[0], addr[1], "TCP" if kind == socket.SOCK_STREAM else "UDP")
        return addr[0], int(s.getsockname()[1])


RESTARTS = 5
"""A worker that dies is started again, at most this many times within `RESTART_WINDOW`."""
RESTART_WINDOW = 60.0
"""Seconds over which `RESTARTS` are counted; past the budget a dead worker stays dead."""


class RestartBudget:
    """At most `limit` restarts within any `window` seconds: a worker that dies at once every
    time it starts is left dead rather than restarted in a loop."""

    def __init__(
        self,
        limit: int = RESTARTS,
        window: float = RESTART_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limit = limit
        self._window = window
        self._clock = clock
        self._times: list[float] = []

    def take(self) -> bool:
        now = self._clock()
        self._times = [t for t in self._times if now - t < self._window]
        if len(self._times) >= self._limit:
            return False
        self._times.append(now)
        return True


def run_workers(plan: Plan, *, announce: Announce = print_ready) -> int:
    """Spawn `workers` processes on the same ports; forward SIGTERM/SIGINT/SIGHUP to them;
    start one that dies again (`RestartBudget`). The exit status is the worst of theirs
    (`exit_status`), at least 1 when the start-up did not complete."""
    # Held until the handler below forwards it, and inherited held by every worker spawned.
    _hold_reloads()
    t = plan.transport
    try:
        t = replace(
            t,
            h3=_claim(t.h3, socket.SOCK_DGRAM) or t.h3,
            tcp=_claim(t.tcp, socket.SOCK_STREAM),
            admin=_claim(t.admin, socket.SOCK_STREAM),
            http=_claim(t.http, socket.SOCK_STREAM),
        )
    except OSError as exc:  # a port in use: one line, as with one worker (`serve`)
        print(f"quicedge serve: {exc}", file=sys.stderr)
        return 1
    if t.quic_retry_secret is None:  # one key for every worker's Retry and address tokens
        t = replace(t, quic_retry_secret=os.urandom(24).hex())
    plan = replace(plan, transport=t, reuse_port=True)
    workers = _Workers(plan, _steered_sockets(t))
    # Before the first spawn: a SIGTERM while they are spawned (a pipe's worth of settings
    # each, written as the worker's interpreter reads them) ended this process alone, and
    # left the workers it had started serving on.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, workers.forward)
    workers.start()
    _release_reloads()
    reported: dict[int, Any] = {}
    failed = False
    while len(reported) < len(workers.procs) and not failed:
        got = workers.reports(timeout=0.5)
        for index, lines in got:
            reported[index] = lines
            if isinstance(lines, str):
                print(f"quicedge serve: worker {index} {lines}", file=sys.stderr)
                failed = True
        if got:
            continue
        for i, proc in enumerate(workers.procs):  # nothing said: did one die meanwhile?
            if not proc.is_alive():
                proc.join()
                print(f"quicedge serve: worker {i} ended (exit {proc.exitcode}) before serve "
                      "was ready", file=sys.stderr)  # fmt: skip
                failed = True
    started = not failed
    if failed:
        workers.forward(signal.SIGTERM, None)
    else:
        spread = "connection ID" if workers.group else "client address"
        pids = [p.pid for p in workers.procs]
        announce([*reported[0], f"workers {t.workers} (pids {pids}; QUIC by {spread})"])
        workers.supervise()
    workers.wait()
    status = exit_status([p.exitcode for p in workers.procs], workers.stopping)
    return status if started else max(status, 1)


def exit_status(exitcodes: list[int | None], stopped_by: list[int]) -> int:
    """The worst of the last workers' exit codes, a death by signal N as 128 + N (as a shell
    reports it), so that a worker killed and left dead (past its restart budget) fails the
    serve. A death by a signal the parent forwarded to stop them (`stopped_by`: one that
    reached a worker before its handler was in place) is the stop asked for, not a failure."""
    worst = 0
    for code in exitcodes:
        if code is None or code == 0:
            continue
        if code < 0:
            if -code in stopped_by:
                continue
            code = 128 - code
        worst = max(worst, code)
    return worst


class _Workers:
    """The worker processes of one serve, and the steered sockets the parent holds for them
    (`group`, by worker index; empty without steering)."""

    def __init__(self, plan: Plan, group: list[socket.socket]) -> None:
        self.plan = plan
        self.group = group
        self._ctx = multiprocessing.get_context("spawn")
        self._reports: dict[int, multiprocessing.connection.Connection] = {}
        """By worker index, the parent's end of the pipe the worker reports on: `(index,
        lines)` once it is up, or `(index, why)` if it failed. A pipe of its own, not a queue
        all share: a worker killed while it wrote to a shared queue would leave the queue's
        lock held, and the next worker's report would wait for it forever, and so would that
        worker's exit."""
        self.stopping: list[int] = []
        """The signals that stop the workers, once one came."""
        self.budget = RestartBudget()
        self._starts: dict[int, int] = {}
        self.procs: list[Any] = []

    def start(self) -> None:
        """Spawn the workers; one told to stop while it was spawned is told now."""
        for index in range(self.plan.transport.workers):
            self.procs.append(self._spawn(index))
            if self.stopping:  # it came during the spawn, when `forward` missed it
                self._tell(self.procs[index], self.stopping[-1])

    def _spawn(self, index: int) -> Any:
        sock = self.group[index] if self.group else None
        self._starts[index] = self._starts.get(index, 0) + 1
        plan = replace(self.plan, starts=self._starts[index])
        reader, writer = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=_worker_entry,
            args=(plan, index, writer, sock),
            name=f"quicedge-worker-{index}",
        )
        held = _hold_reloads()  # the worker is born with SIGHUP held (`run_worker`)
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            writer.close()  # the worker has its own copy: its exit is the pipe's end
        old = self._reports.pop(index, None)
        if old is not None:  # a dead worker's: whatever it said before is of no use now
            old.close()
        self._reports[index] = reader
        return proc

    def reports(self, timeout: float | None) -> list[tuple[int, Any]]:
        """What the workers said (each says one thing), waiting up to `timeout` for the first
        word; the pipe of a worker that has ended is closed."""
        pipes = {conn: index for index, conn in self._reports.items()}
        said: list[tuple[int, Any]] = []
        for conn in multiprocessing.connection.wait(list(pipes), timeout):
            assert isinstance(conn, multiprocessing.connection.Connection)
            try:
                said.append(conn.recv())
            except (EOFError, OSError):  # it ended: nothing more will come
                conn.close()
                del self._reports[pipes[conn]]
        return said

    def forward(self, signum: int, _frame: Any) -> None:
        if signum != signal.SIGHUP:
            self.stopping.append(signum)
        for proc in self.procs:
            self._tell(proc, signum)

    @staticmethod
    def _tell(proc: Any, signum: int) -> None:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signum)

    def supervise(self) -> None:
        """Until told to stop: start a worker that dies again, with its index and its steered
        socket, so that its clients' datagrams reach it (and a client of the dead one gets a
        stateless reset it recognises: same index, same key). Past the budget a dead worker
        stays dead, and with steering the group goes back to the address hash (its socket
        closed), so that the others take its new clients.

        Every worker not left dead is watched by its sentinel, alive or not: one that died
        before a look (between `ready` and the first, or during a restart) has a sentinel
        already readable, and is started again like any other."""
        left_dead: set[int] = set()
        while not self.stopping:
            watched = {p.sentinel: i for i, p in enumerate(self.procs) if i not in left_dead}
            if not watched:
                return
            ended = multiprocessing.connection.wait(list(watched))
            self._read_reports()
            if self.stopping:
                return
            for sentinel in ended:
                index = watched[sentinel]
                proc = self.procs[index]
                proc.join()
                if self.budget.take():
                    self.procs[index] = self._spawn(index)
                    if self.stopping:  # it came during the spawn, when `forward` missed it
                        self._tell(self.procs[index], self.stopping[-1])
                    log.warning(
                        "worker %d ended (exit %s): started again (pid %s)",
                        index, proc.exitcode, self.procs[index].pid,
                    )  # fmt: skip
                else:
                    log.error(
                        "worker %d ended (exit %s) and is not started again: %d restarts "
                        "within %.0f s", index, proc.exitcode, RESTARTS, RESTART_WINDOW,
                    )  # fmt: skip
                    left_dead.add(index)
                    self._give_up(index)

    def _read_reports(self) -> None:
        """What restarted workers said once up, or why they failed (logged)."""
        for index, lines in self.reports(timeout=0):
            if isinstance(lines, str):
                log.error("worker %d did not start again: %s", index, lines)

    def _give_up(self, index: int) -> None:
        if not self.group or self.group[index].fileno() < 0:
            return
        others = [i for i, p in enumerate(self.procs) if i != index and p.is_alive()]
        if others:
            log.warning("HTTP/3 datagrams spread by client address now")
            steering.spread_by_address(self.group[others[0]])
        self.group[index].close()

    def wait(self) -> None:
        """Wait until every worker has ended, then close the steered sockets (held until now,
        so the group's order never changes)."""
        for proc in self.procs:
            proc.join()
        for sock in self.group:
            sock.close()
        for conn in self._reports.values():
            conn.close()


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
    except (OSError, StartupError) as exc:  # a port in use, an address not on this machine
        print(f"quicedge serve: {exc}", file=sys.stderr)
        return 1
    return 0


__all__ = [
    "AppFactory",
    "Plan",
    "ServedApps",
    "StartupError",
    "exit_status",
    "print_ready",
    "run_worker",
    "run_workers",
    "serve",
]
