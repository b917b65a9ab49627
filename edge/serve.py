"""``quicedge serve``: the edge's listeners (HTTP/3, HTTP/2 + HTTP/1.1 over TLS, admin) and workers.

Settings come from flags, then the TOML file (``--config``: tables ``[serve]``, ``[early_data]``
and the proxy's ``[proxy]``), then defaults. One worker runs in this process; ``--workers N``
starts N processes that share the UDP and TCP ports with SO_REUSEPORT (the ticket store must
then be Redis, or one worker's ticket could open a second 0-RTT window on another).

Signals: SIGTERM/SIGINT drain (stop accepting, GOAWAY on HTTP/3 and HTTP/2, let open requests
finish for ``--drain-timeout`` s); SIGHUP reloads the certificate and key for new handshakes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry

from transport.asgi import ASGIApp
from transport.config import TransportConfig, format_address, parse_address
from transport.demo import demo_admin_app, demo_app
from transport.early_data import MODES, EarlyDataPolicy
from transport.gc_pauses import GcPauseProbe
from transport.h1_server import H1Listener
from transport.h3_server import H3Server
from transport.loop import LOOPS, running_loop_name
from transport.loop import run as run_on_loop
from transport.metrics import TransportMetrics
from transport.read_delay import ReadDelayProbe
from transport.retry import MIN_SECRET_BYTES
from transport.tcp import TcpListener, TcpOptions
from transport.tickets import MemoryTicketStore, RedisTicketStore, TicketStore
from transport.tls import TlsError, TlsMaterial, resolve_files

log = logging.getLogger("quicedge.serve")


def _wiring() -> Any | None:
    """The proxy core (``edge.wiring``), or None when it is not installed."""
    try:
        from edge import wiring
    except ImportError:
        return None
    return wiring


def build_parser() -> argparse.ArgumentParser:
    policy = EarlyDataPolicy()
    table = "\n".join(f"  {p:<22} {m.value}" for p, m in sorted(policy.routes.items()))
    parser = argparse.ArgumentParser(
        prog="quicedge serve",
        description="Run the edge proxy: HTTP/3 with 0-RTT, HTTP/2 and HTTP/1.1 over TLS.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "early-data policy (requests received in 0-RTT, before the handshake completes):\n"
            f"{table}\n  {'(any other path)':<22} {policy.default.value}\n"
            "accept: served at once, forwarded with Early-Data: 1; defer: held until the "
            "handshake\ncompletes; reject: 425 Too Early. Change per route in the TOML "
            "[early_data] table\n(default = MODE, routes = {PATH = MODE}); --early-data "
            "overrides every route.\n\nSignals: SIGTERM/SIGINT drain, SIGHUP reloads the "
            "certificate."
        ),
    )
    g = parser.add_argument_group("listeners and TLS")
    g.add_argument("--h3", metavar="HOST:PORT", help="HTTP/3 (QUIC, UDP) (127.0.0.1:4433)")
    g.add_argument(
        "--tcp", metavar="HOST:PORT", help="HTTP/2 + HTTP/1.1 over TLS; 'off' (127.0.0.1:8443)"
    )
    g.add_argument(
        "--admin", metavar="HOST:PORT", help="plain-HTTP admin: health, metrics (127.0.0.1:9901)"
    )
    g.add_argument("--http", metavar="HOST:PORT", help="plain-HTTP/1.1 proxy listener (off)")
    g.add_argument("--cert", help="PEM certificate chain (default: development certificates)")
    g.add_argument("--key", help="PEM private key for --cert")
    g = parser.add_argument_group("0-RTT and address validation")
    g.add_argument("--redis", metavar="URL", help="Redis for fleet-wide single-use tickets")
    g.add_argument(
        "--ticket-secret",
        metavar="SECRET",
        help="seal tickets stored in Redis (AES-GCM), >= 16 bytes, same on all workers "
        "(default: $QUICEDGE_TICKET_SECRET)",
    )
    g.add_argument(
        "--early-data", choices=MODES, help="policy for every route (overrides the table below)"
    )
    g.add_argument(
        "--quic-retry",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="validate client addresses with a Retry round trip (off)",
    )
    g.add_argument(
        "--quic-retry-secret",
        metavar="SECRET",
        help=f"Retry token key secret, >= {MIN_SECRET_BYTES} bytes, same on all workers",
    )
    g = parser.add_argument_group("processes and limits")
    g.add_argument("--workers", type=int, help="processes sharing the ports (1)")
    g.add_argument("--drain-timeout", type=float, help="SIGTERM: seconds to finish requests (10)")
    g.add_argument(
        "--loop",
        choices=LOOPS,
        help="event loop; auto: uvloop when installed, else asyncio (auto)",
    )
    g.add_argument("--idle-timeout", type=float, help="QUIC idle timeout, s (60)")
    g.add_argument(
        "--max-streams", type=int, dest="max_concurrent_streams",
        help="concurrent HTTP/3 requests per connection (128)",
    )  # fmt: skip
    g.add_argument(
        "--max-header-bytes", type=int, help="request header section, bytes (16384); 431"
    )
    g.add_argument(
        "--h3-max-body", type=int, dest="max_body_bytes",
        help="HTTP/3 request body, bytes (8 MiB); 413",
    )  # fmt: skip
    g.add_argument("--config", metavar="FILE", help="TOML file with the same settings")
    g.add_argument(
        "--demo",
        action="store_true",
        help="serve a built-in echo app instead of the proxy (no backends needed)",
    )
    wiring = _wiring()
    if wiring is not None:
        wiring.add_arguments(parser)
    return parser


def load_toml(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: {exc}") from None


def _table(doc: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = doc.get(name, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"config: [{name}] must be a table")
    return value


def transport_config(args: argparse.Namespace, doc: Mapping[str, Any]) -> TransportConfig:
    """TOML ``[serve]``/``[early_data]`` with the flags laid over them."""
    config = TransportConfig.from_mapping(_table(doc, "serve"), _table(doc, "early_data"))
    over: dict[str, Any] = {}
    for name in ("h3", "tcp", "admin", "http"):
        text = getattr(args, name)
        if text is None:
            continue
        if text == "off":
            if name == "h3":
                raise ValueError("--h3 cannot be off")
            over[name] = None
        else:
            over[name] = parse_address(text, setting=f"--{name}")
    for name in (
        "cert",
        "key",
        "redis",
        "ticket_secret",
        "quic_retry",
        "quic_retry_secret",
        "workers",
        "drain_timeout",
        "loop",
    ):
        value = getattr(args, name)
        if value is not None:
            over[name] = value
    limits = {
        n: getattr(args, n)
        for n in ("idle_timeout", "max_concurrent_streams", "max_header_bytes", "max_body_bytes")
        if getattr(args, n) is not None
    }
    env_secret = os.environ.get("QUICEDGE_TICKET_SECRET")
    if env_secret and "ticket_secret" not in over and config.ticket_secret is None:
        over["ticket_secret"] = env_secret  # keeps the secret off the command line (ps)
    config = replace(config, **over)
    if limits:
        config = replace(config, limits=replace(config.limits, **limits))
    return config.with_early_data_override(args.early_data).validate()


@dataclass
class Plan:
    """What each worker process runs (picklable: sent to spawned workers)."""

    transport: TransportConfig
    proxy: Any | None  # edge.config.ProxyConfig, or None for the demo app
    reuse_port: bool


async def run_worker(
    plan: Plan, *, announce: Callable[[list[str]], None], stop: asyncio.Event | None = None
) -> None:
    """Run the listeners until SIGTERM/SIGINT (or ``stop``), then drain and close."""
    t = plan.transport
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    registry = CollectorRegistry()
    metrics = TransportMetrics(registry)
    tls = TlsMaterial(resolve_files(t.cert, t.key))
    wiring: Any = None
    app: ASGIApp
    admin_app: ASGIApp
    if plan.proxy is not None:
        wiring = await _wiring().build(plan.proxy, registry=registry)  # type: ignore[union-attr]
        await wiring.start()
        app, admin_app = wiring.app, wiring.admin_app
    else:
        app, admin_app = demo_app, demo_admin_app(registry)
    tickets: TicketStore = (
        RedisTicketStore(
            t.redis,
            timeout=t.redis_timeout,
            secret=t.ticket_secret.encode() if t.ticket_secret else None,
        )
        if t.redis
        else MemoryTicketStore()
    )
    secret = t.quic_retry_secret.encode() if t.quic_retry_secret else None
    if t.quic_retry and secret is None:
        secret = os.urandom(32)  # one process: a random key is as good as a shared one
    h3 = H3Server(
        app,
        tls=tls,
        tickets=tickets,
        policy=t.early_data,
        limits=t.limits,
        retry_secret=secret if t.quic_retry else None,
        metrics=metrics,
    )
    listeners: list[TcpListener | H1Listener] = []
    probe = ReadDelayProbe(metrics.read_delay)
    gc_pauses = GcPauseProbe(metrics.gc_pauses)
    try:
        await h3.start(*t.h3, reuse_port=plan.reuse_port)
        options = TcpOptions(graceful_timeout=t.drain_timeout)
        lines = [f"h3     https://{format_address(h3.address or t.h3)} (QUIC, UDP)"]
        if t.tcp is not None:
            listeners.append(
                TcpListener(
                    app, host=t.tcp[0], port=t.tcp[1], tls=tls, alt_svc_port=h3.port,
                    reuse_port=plan.reuse_port, options=options,
                )
            )  # fmt: skip
            lines.append(f"tcp    {listeners[-1].url} (h2, http/1.1; alt-svc h3 :{h3.port})")
        if t.http is not None:
            listeners.append(
                H1Listener(
                    app, host=t.http[0], port=t.http[1], reuse_port=plan.reuse_port,
                    options=options,
                )
            )  # fmt: skip
            lines.append(f"http   {listeners[-1].url} (plain HTTP/1.1)")
        admin: H1Listener | None = None
        if t.admin is not None:
            admin = H1Listener(
                admin_app, host=t.admin[0], port=t.admin[1], reuse_port=plan.reuse_port
            )
            lines.append(f"admin  {admin.url} (/health /ready /metrics)")
        for listener in [*listeners, *([admin] if admin else [])]:
            await listener.start()
        store = (
            f"redis {t.redis} ({'sealed' if t.ticket_secret else 'NOT sealed: --ticket-secret'})"
            if t.redis
            else "memory (this process only)"
        )
        lines.append(f"tickets {store}; retry {'on' if t.quic_retry else 'off'}")
        lines.append(f"early data: {t.early_data.describe()}")
        lines.append(f"loop   {running_loop_name()}")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, partial(_reload, tls, wiring))
        prepare_collector()
        probe.start()
        gc_pauses.start()  # after the freeze's own full collection
        announce(lines)
        await stop.wait()
        log.info("draining for up to %.1fs", t.drain_timeout)
        await asyncio.gather(h3.drain(t.drain_timeout), *(lst.stop() for lst in listeners))
        if admin is not None:
            await admin.stop()
    finally:
        probe.stop()
        gc_pauses.stop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await h3.aclose()
        for listener in listeners:
            with contextlib.suppress(Exception):
                await listener.stop()
        if wiring is not None:
            await wiring.aclose()
        tickets.close()


def _reload(tls: TlsMaterial, wiring: Any) -> None:
    """SIGHUP: certificates, and the policy modules when the proxy runs."""
    tls.reload()
    if wiring is not None:
        wiring.reload()


# CPython starts a young collection when tracked allocations have outnumbered deallocations by
# this much since the last one (700 by default). Serving frees nearly all it allocates, but the
# requests in flight hold ~50 tracked objects each until they end, so at 32 streams the count
# crossed 700 about every 30 requests: a 0.3 ms stop of every request, finding nothing to free.
# At 10,000 a steady load runs almost none; real garbage still triggers one. Nothing long-lived
# piles up in the young generation meanwhile: the prefix tree, the one structure that grows with
# traffic, is not tracked at all (edge/routing/prefix_tree.py).
YOUNG_COLLECTION_THRESHOLD = 10_000


def prepare_collector() -> None:
    """Ready the garbage collector for serving. Everything allocated at startup (modules,
    classes, config: ~60k objects) moves out of its reach: a full collection walks every
    tracked object, ~75 ms here with them, a pause every request in flight would wait out;
    after the freeze, a full collection walks only what serving allocated. And young
    collections start at `YOUNG_COLLECTION_THRESHOLD`."""
    gc.collect()
    gc.freeze()
    _, middle, full = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, full)


def _print_lines(lines: list[str]) -> None:
    for line in lines:
        print(f"quicedge serve: {line}")
    print("ready", flush=True)


def _worker_entry(plan: Plan, index: int, ready: Any) -> None:
    """A worker process: run, and report its listening lines once up."""
    logging.basicConfig(level=logging.WARNING, format=f"worker {index}: %(message)s")
    # SIGTERM/SIGINT (from the parent, or a terminal's Ctrl-C to the process group) drain;
    # a second one while draining changes nothing.
    try:
        run_on_loop(
            run_worker(plan, announce=lambda lines: ready.put((index, lines))),
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


def run_workers(plan: Plan) -> int:
    t = plan.transport
    t = replace(
        t,
        h3=_concrete(t.h3, socket.SOCK_DGRAM) or t.h3,
        tcp=_concrete(t.tcp, socket.SOCK_STREAM),
        admin=_concrete(t.admin, socket.SOCK_STREAM),
        http=_concrete(t.http, socket.SOCK_STREAM),
    )
    if t.quic_retry and t.quic_retry_secret is None:
        t = replace(t, quic_retry_secret=os.urandom(24).hex())
    plan = replace(plan, transport=t, reuse_port=True)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    procs = [
        ctx.Process(target=_worker_entry, args=(plan, i, ready), name=f"quicedge-worker-{i}")
        for i in range(t.workers)
    ]
    for proc in procs:
        proc.start()

    def forward(signum: int, _frame: Any) -> None:
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
        _print_lines([*reported[0], f"workers {t.workers} (pids {[p.pid for p in procs]})"])
    for proc in procs:
        proc.join()
    return max((p.exitcode or 0) for p in procs) if reported else 1


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection at INFO
    try:
        doc = load_toml(args.config)
        transport = transport_config(args, doc)
        proxy = None
        wiring = _wiring()
        if not args.demo:
            if wiring is None:
                print("quicedge serve: proxy core not installed; serving the demo app")
            else:
                try:
                    proxy = wiring.config_from(args, doc)
                except ValueError as exc:
                    raise ValueError(f"{exc} (or --demo for the built-in echo app)") from None
        # Fail early on bad TLS files; make the development certificates once, here, so
        # that workers never race to generate them.
        files = resolve_files(transport.cert, transport.key)
        TlsMaterial(files)
        transport = replace(transport, cert=str(files.cert), key=str(files.key))
    except (ValueError, TlsError) as exc:
        print(f"quicedge serve: {exc}", file=sys.stderr)
        return 2
    plan = Plan(transport=transport, proxy=proxy, reuse_port=False)
    if transport.workers > 1:
        return run_workers(plan)
    try:
        run_on_loop(run_worker(plan, announce=_print_lines), plan.transport.loop)
    except OSError as exc:
        print(f"quicedge serve: {exc}", file=sys.stderr)
        return 1
    return 0


__all__ = ["Plan", "build_parser", "main", "run_worker", "transport_config"]
