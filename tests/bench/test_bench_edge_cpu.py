"""`quicedge bench` reports the edge's CPU per request when the edge runs on this machine: here
the edge (and its stand-in) run in the test's process, the bench in a child process."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from bench import edge_cpu
from certs import DevCertificates
from tests.bench.conftest import run_command
from tests.bench.test_bench_edge import edge_urls  # noqa: F401  (the fixture)

SMALL = (
    "--workload", "gsp", "--num", "4", "--gsp-groups", "1", "--gsp-prompts-per-group", "4",
    "--gsp-system-len", "16", "--gsp-question-len", "4", "--output-len", "4",
)  # fmt: skip


def test_the_processes_holding_a_port_are_found() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
        udp.bind(("127.0.0.1", 0))
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        assert edge_cpu.find_edge(udp.getsockname()[1], ["udp"]) == [os.getpid()]
        assert edge_cpu.find_edge(tcp.getsockname()[1], ["tcp"]) == [os.getpid()]
        # A UDP port is not a TCP listener.
        assert os.getpid() not in edge_cpu.find_edge(udp.getsockname()[1], ["tcp"])
    assert edge_cpu.cpu_seconds(os.getpid()) > 0


async def test_bench_reports_the_edge_cpu_per_request(
    edge_urls: tuple[str, str, str],  # noqa: F811
    dev_certs: DevCertificates,
    tmp_path: Path,
) -> None:
    h3, tcp, _backend = edge_urls
    summary = tmp_path / "summary.json"
    done = await run_command(
        "bench.cli", "--url", h3, "--cacert", str(dev_certs.ca_cert), *SMALL,
        "--compare", "h3+0rtt", f"h2@{tcp}", "--summary-json", str(summary),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    cpu = json.loads(summary.read_text())["edge_cpu"]
    assert cpu["pids"] == [os.getpid()]  # found through the ports (UDP and TCP)
    assert cpu["requests"] == 8
    # Four new QUIC connections and four HTTP/2 requests cost the edge more than one tick.
    assert cpu["cpu_s"] > 0 and cpu["cpu_ms_per_request"] == cpu["cpu_s"] * 1e3 / 8
    assert f"edge CPU: {cpu['cpu_ms_per_request']:.3f} ms per request" in done.stdout

    done = await run_command(
        "bench.cli", "--url", h3, "--cacert", str(dev_certs.ca_cert), *SMALL,
        "--edge-pid", str(os.getpid()), "--summary-json", str(summary),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(summary.read_text())["edge_cpu"]["pids"] == [os.getpid()]

    done = await run_command(
        "bench.cli", "--url", h3, "--cacert", str(dev_certs.ca_cert), *SMALL,
        "--no-edge-cpu", "--summary-json", str(summary),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "edge_cpu" not in json.loads(summary.read_text())
    assert "edge CPU" not in done.stdout
