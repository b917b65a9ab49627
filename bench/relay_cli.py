"""`quicedge bench relay`: run the RTT emulator on its own, or measure its accuracy and cost.

    quicedge bench relay --udp 4433:127.0.0.1:8443 --tcp 8444:127.0.0.1:8443 --rtt-ms 50
    quicedge bench relay --selftest --rtt-ms 20 50 100 [--report relay.json]

The self-test sends ping-pongs through the relay to echo servers on 127.0.0.1 (UDP datagrams and
TCP messages), compares the round trip with and without the relay, and reports the error against
the configured RTT (accuracy) and the CPU time the relay spends per relayed packet (cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.loop import run
from bench.rtt_relay import Forward, Link, Relay, RelayError
from bench.summary import rank_index


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quicedge bench relay",
        description="User-space RTT emulator: delays each direction by RTT/2 (UDP and TCP).",
    )
    parser.add_argument(
        "--udp", action="append", default=[], metavar="LISTEN:TARGET",
        help="relay UDP: [HOST:]PORT:TARGET_HOST:TARGET_PORT (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--tcp", action="append", default=[], metavar="LISTEN:TARGET",
        help="relay TCP: [HOST:]PORT:TARGET_HOST:TARGET_PORT (repeatable)",
    )  # fmt: skip
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[50.0], help="round-trip time")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="one-way delay ± jitter/2")
    parser.add_argument("--loss", type=float, default=0.0, help="UDP drop probability")
    parser.add_argument("--seed", type=int, default=None, help="seed for jitter and loss")
    parser.add_argument(
        "--no-tcp-handshake", action="store_true",
        help="do not charge the TCP handshake its round trip",
    )  # fmt: skip
    parser.add_argument("--selftest", action="store_true", help="measure accuracy and cost")
    parser.add_argument(
        "--pings", type=int, default=200, help="self-test round trips per case (>= 2)"
    )
    parser.add_argument("--report", type=Path, help="self-test: write the results as JSON")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        links = [
            Link(rtt, args.jitter_ms, args.loss, tcp_handshake=not args.no_tcp_handshake)
            for rtt in args.rtt_ms
        ]
        udp = [Forward.parse(spec) for spec in args.udp]
        tcp = [Forward.parse(spec) for spec in args.tcp]
    except RelayError as exc:
        parser.error(str(exc))
    if args.pings < 2:
        parser.error("--pings must be >= 2")
    if args.report is not None:  # tried now, not after the self-test it would lose
        existed = args.report.exists()
        try:
            with args.report.open("a"):
                pass
        except OSError as exc:
            parser.error(f"--report {args.report}: {exc.strerror}")
        if not existed:
            args.report.unlink(missing_ok=True)
    if args.selftest:
        results = run(selftest(links, pings=args.pings))
        print(format_selftest(results))
        if args.report:
            args.report.write_text(json.dumps(results, indent=2) + "\n")
        return 0
    if not udp and not tcp:
        parser.error("give at least one --udp or --tcp forward (or --selftest)")
    if len(links) != 1:
        parser.error("give one --rtt-ms when relaying")
    return run(_serve(Relay(links[0], udp=udp, tcp=tcp, seed=args.seed)))


async def _serve(relay: Relay) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with relay:
        for udp in relay.udp_relays:
            f = udp.forward
            print(f"udp {f.listen_host}:{udp.port} -> {f.target_host}:{f.target_port}", flush=True)
        for tcp in relay.tcp_relays:
            f = tcp.forward
            print(f"tcp {f.listen_host}:{tcp.port} -> {f.target_host}:{f.target_port}", flush=True)
        print(f"ready rtt={relay.link.rtt_ms}ms", flush=True)
        await stop.wait()
    return 0


# --- self-test -------------------------------------------------------------------------------


class _UdpEcho(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.DatagramTransport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.transport.sendto(data, addr)


class _UdpPinger(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.waiter: asyncio.Future[None] | None = None

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


async def _tcp_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := await reader.read(65536):
        writer.write(data)
    writer.close()


async def _udp_rtts(port: int, pings: int, size: int = 1200) -> list[float]:
    loop = asyncio.get_running_loop()
    transport, pinger = await loop.create_datagram_endpoint(
        _UdpPinger, remote_addr=("127.0.0.1", port)
    )
    payload = b"x" * size
    rtts = []
    try:
        for _ in range(pings):
            pinger.waiter = loop.create_future()
            start = time.perf_counter()
            transport.sendto(payload)
            await asyncio.wait_for(pinger.waiter, 5.0)
            rtts.append(time.perf_counter() - start)
    finally:
        transport.close()
    return rtts


async def _tcp_rtts(port: int, pings: int, size: int = 1200) -> tuple[float, list[float]]:
    """Connect-to-first-echo time (handshake included) and per-message round trips."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = b"y" * size
    rtts = []
    first = 0.0
    try:
        for i in range(pings):
            t0 = time.perf_counter()
            writer.write(payload)
            await asyncio.wait_for(reader.readexactly(size), 5.0)
            if i == 0:  # held for the emulated TCP handshake: not a steady round trip
                first = time.perf_counter() - start
            else:
                rtts.append(time.perf_counter() - t0)
    finally:
        writer.close()
    return first, rtts


def _stats(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000.0 for s in samples)
    return {
        "mean_ms": statistics.fmean(ms),
        "p50_ms": ms[rank_index(len(ms), 50)],
        "p99_ms": ms[rank_index(len(ms), 99)],
        "max_ms": ms[-1],
    }


async def selftest(links: list[Link], *, pings: int = 200) -> dict[str, Any]:
    """Measure the relay at each link's RTT; see the module doc."""
    loop = asyncio.get_running_loop()
    echo_udp, _ = await loop.create_datagram_endpoint(_UdpEcho, local_addr=("127.0.0.1", 0))
    echo_udp_port = echo_udp.get_extra_info("sockname")[1]
    echo_tcp = await asyncio.start_server(_tcp_echo, "127.0.0.1", 0)
    echo_tcp_port = echo_tcp.sockets[0].getsockname()[1]
    out: dict[str, Any] = {"pings": pings, "cases": []}
    try:
        cpu0 = time.process_time()
        direct_udp = await _udp_rtts(echo_udp_port, pings)
        direct_tcp_first, direct_tcp = await _tcp_rtts(echo_tcp_port, pings)
        direct_cpu = time.process_time() - cpu0
        out["direct"] = {"udp": _stats(direct_udp), "tcp": _stats(direct_tcp)}
        for link in links:
            relay = Relay(
                link,
                udp=[Forward("127.0.0.1", 0, "127.0.0.1", echo_udp_port)],
                tcp=[Forward("127.0.0.1", 0, "127.0.0.1", echo_tcp_port)],
            )
            async with relay:
                cpu0 = time.process_time()
                udp = await _udp_rtts(relay.udp_relays[0].port, pings)
                tcp_first, tcp = await _tcp_rtts(relay.tcp_relays[0].port, pings)
                cpu = time.process_time() - cpu0
                packets = relay.packets()
            udp_stats, tcp_stats = _stats(udp), _stats(tcp)
            expected_first = 2 * link.rtt_ms if link.tcp_handshake else link.rtt_ms
            out["cases"].append(
                {
                    "rtt_ms": link.rtt_ms,
                    "udp": udp_stats,
                    "tcp": tcp_stats,
                    # Relay error: measured minus configured, minus what loopback costs anyway.
                    "udp_error_p50_ms": udp_stats["p50_ms"]
                    - link.rtt_ms
                    - out["direct"]["udp"]["p50_ms"],
                    "tcp_error_p50_ms": tcp_stats["p50_ms"]
                    - link.rtt_ms
                    - out["direct"]["tcp"]["p50_ms"],
                    "tcp_connect_to_first_echo_ms": tcp_first * 1000.0,
                    "tcp_connect_expected_ms": expected_first,
                    "cpu_us_per_packet": max(0.0, cpu - direct_cpu) / max(packets, 1) * 1e6,
                    "packets": packets,
                }
            )
    finally:
        echo_udp.close()
        echo_tcp.close()
        await echo_tcp.wait_closed()
    return out


def format_selftest(results: dict[str, Any]) -> str:
    direct = results["direct"]
    lines = [
        f"relay self-test: {results['pings']} round trips per case, 1200-byte messages",
        f"direct loopback p50: udp {direct['udp']['p50_ms']:.3f} ms, "
        f"tcp {direct['tcp']['p50_ms']:.3f} ms",
        f"{'rtt ms':>7} {'udp p50':>9} {'udp p99':>9} {'udp err':>8} {'tcp p50':>9} "
        f"{'tcp p99':>9} {'tcp err':>8} {'tcp 1st':>9} {'expect':>7} {'cpu us/pkt':>10}",
    ]
    for case in results["cases"]:
        lines.append(
            f"{case['rtt_ms']:>7.1f} {case['udp']['p50_ms']:>9.3f} {case['udp']['p99_ms']:>9.3f} "
            f"{case['udp_error_p50_ms']:>+8.3f} {case['tcp']['p50_ms']:>9.3f} "
            f"{case['tcp']['p99_ms']:>9.3f} {case['tcp_error_p50_ms']:>+8.3f} "
            f"{case['tcp_connect_to_first_echo_ms']:>9.3f} {case['tcp_connect_expected_ms']:>7.1f} "
            f"{case['cpu_us_per_packet']:>10.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
