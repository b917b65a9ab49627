"""The RTT relay adds the configured delay (generous tolerances: the machine is shared)."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from typing import Any

import pytest

from bench.rtt_relay import Forward, Link, Relay, RelayError
from tests.bench.conftest import REPO, run_command
from tests.helpers import free_port

RTT_S = 0.080
# A relay may be late on a loaded machine, never early: allow 1 ms early (timer slack and clock
# granularity) and a generous amount late, still under one RTT so a missing or extra half-RTT
# delay per direction is caught.
EARLY_S = 0.001
LATE_S = 0.060


class _Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.DatagramTransport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.transport.sendto(data, addr)


class _Collector(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.queue.put_nowait((time.perf_counter(), data))


async def _udp_echo() -> tuple[asyncio.DatagramTransport, int]:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(_Echo, local_addr=("127.0.0.1", 0))
    return transport, transport.get_extra_info("sockname")[1]


async def _tcp_echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def test_udp_round_trip_gets_the_configured_rtt_in_order() -> None:
    echo, echo_port = await _udp_echo()
    relay = Relay(Link(rtt_ms=RTT_S * 1000), udp=[Forward("127.0.0.1", 0, "127.0.0.1", echo_port)])
    loop = asyncio.get_running_loop()
    try:
        async with relay:
            client, collector = await loop.create_datagram_endpoint(
                _Collector, remote_addr=("127.0.0.1", relay.udp_relays[0].port)
            )
            sent = {}
            for i in range(20):  # a burst: all in flight at once
                sent[i] = time.perf_counter()
                client.sendto(str(i).encode())
            received = [await asyncio.wait_for(collector.queue.get(), 5) for _ in range(20)]
            client.close()
            stats = relay.udp_relays[0]
            assert (stats.upstream.items, stats.downstream.items) == (20, 20)
    finally:
        echo.close()
    order = [int(data) for _, data in received]
    assert order == list(range(20))  # no jitter: order kept
    rtts = [at - sent[int(data)] for at, data in received]
    assert min(rtts) >= RTT_S - EARLY_S
    assert statistics.median(rtts) <= RTT_S + LATE_S


async def test_udp_loss_drops_some_datagrams_deterministically() -> None:
    echo, echo_port = await _udp_echo()
    link = Link(rtt_ms=2, loss=0.5)
    relay = Relay(link, udp=[Forward("127.0.0.1", 0, "127.0.0.1", echo_port)], seed=7)
    loop = asyncio.get_running_loop()
    try:
        async with relay:
            client, _ = await loop.create_datagram_endpoint(
                _Collector, remote_addr=("127.0.0.1", relay.udp_relays[0].port)
            )
            for _ in range(200):
                client.sendto(b"x")
                await asyncio.sleep(0)
            await asyncio.sleep(0.2)
            client.close()
            udp = relay.udp_relays[0]
    finally:
        echo.close()
    assert udp.upstream.items == 200
    assert 50 < udp.upstream.dropped < 150  # p = 0.5 of 200, seeded
    assert udp.downstream.items == 200 - udp.upstream.dropped


async def test_tcp_adds_rtt_per_exchange_and_charges_the_handshake() -> None:
    server = await _tcp_echo_server()
    port = server.sockets[0].getsockname()[1]
    relay = Relay(Link(rtt_ms=RTT_S * 1000), tcp=[Forward("127.0.0.1", 0, "127.0.0.1", port)])
    try:
        async with relay:
            start = time.perf_counter()
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.tcp_relays[0].port)
            writer.write(b"hello")
            assert await asyncio.wait_for(reader.readexactly(5), 5) == b"hello"
            first = time.perf_counter() - start
            rtts = []
            for _ in range(3):
                t0 = time.perf_counter()
                writer.write(b"ping")
                assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
                rtts.append(time.perf_counter() - t0)
            writer.write_eof()  # half-close travels through and the echo closes
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
    finally:
        server.close()
        await server.wait_closed()
    # connect (1 RTT, emulated) + request/response (1 RTT)
    assert 2 * RTT_S - EARLY_S <= first <= 2 * RTT_S + LATE_S
    assert min(rtts) >= RTT_S - EARLY_S
    assert statistics.median(rtts) <= RTT_S + LATE_S


async def test_tcp_relay_to_nothing_closes_the_client() -> None:
    relay = Relay(Link(rtt_ms=10), tcp=[Forward("127.0.0.1", 0, "127.0.0.1", free_port())])
    async with relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.tcp_relays[0].port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("4433:127.0.0.1:8443", Forward("127.0.0.1", 4433, "127.0.0.1", 8443)),
        ("0.0.0.0:4433:backend:8443", Forward("0.0.0.0", 4433, "backend", 8443)),
    ],
)
def test_forward_parse(spec: str, expected: Forward) -> None:
    assert Forward.parse(spec) == expected


@pytest.mark.parametrize(
    "spec", ["8443", "a:b:c", "4433:host:0", "4433:host:70000", "4433::8443", ":1:h:2"]
)
def test_forward_parse_rejects(spec: str) -> None:
    with pytest.raises(RelayError):
        Forward.parse(spec)


@pytest.mark.parametrize(
    "kwargs", [{"rtt_ms": -1}, {"rtt_ms": 10, "jitter_ms": 20}, {"loss": 1.0}, {"loss": -0.1}]
)
def test_link_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(RelayError):
        Link(**kwargs)


async def test_relay_command_rejects_bad_input() -> None:
    done = await run_command("bench.relay_cli", "--udp", "nonsense", "--rtt-ms", "10")
    assert done.returncode == 2 and "expected [LISTEN_HOST:]PORT" in done.stderr
    done = await run_command("bench.relay_cli", "--rtt-ms", "10")
    assert done.returncode == 2 and "at least one --udp or --tcp" in done.stderr


async def test_relay_selftest_reports_accuracy(tmp_path: Any) -> None:
    report = tmp_path / "relay.json"
    done = await run_command(
        "bench.relay_cli", "--selftest", "--rtt-ms", "20", "--pings", "5", "--report", str(report)
    )
    assert done.returncode == 0, done.stderr
    assert "relay self-test" in done.stdout
    data = json.loads(report.read_text())
    (case,) = data["cases"]
    assert case["rtt_ms"] == 20
    assert case["udp"]["p50_ms"] >= 20 - 1
    assert case["tcp_connect_expected_ms"] == 40
    assert case["packets"] > 0


async def test_relay_command_runs_on_its_own() -> None:
    """`quicedge bench relay` as a process: prints its ports, relays with the delay, stops on
    SIGTERM."""
    server = await _tcp_echo_server()
    port = server.sockets[0].getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "edge.cli", "bench", "relay",
        "--tcp", f"0:127.0.0.1:{port}", "--udp", f"0:127.0.0.1:{port}", "--rtt-ms", "40",
        stdout=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 20)).decode() for _ in range(3)]
        assert lines[0].startswith("udp 127.0.0.1:") and lines[2].startswith("ready rtt=40")
        relay_port = int(lines[1].split()[1].rsplit(":", 1)[1])
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", relay_port)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        assert time.perf_counter() - start >= 2 * 0.040 - EARLY_S  # handshake RTT + echo RTT
        writer.close()
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        server.close()
        await server.wait_closed()
