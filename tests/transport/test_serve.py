"""``quicedge serve`` as a user runs it: CLI errors, TOML, processes, workers, interop."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from certs import ensure_dev_certificates
from edge.serve import build_parser, load_settings, main, transport_config
from tests.helpers import free_port, wait_until
from tests.transport.conftest import ServeProcess
from tests.transport.h3client import fresh_ticket, h3_connect
from transport.address_tokens import AddressTokens
from transport.early_data import Mode

ZERO_RTT = 'quicedge_zero_rtt_total{result="%s"}'


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--demo", "--workers", "2"], "--workers 2 needs --redis URL"),
        (["--demo", "--h3", "localhost"], "--h3: expected HOST:PORT"),
        (["--demo", "--h3", "off"], "--h3: cannot be off"),
        (["--demo", "--cert", "x.pem"], "--cert and --key go together"),
        (["--demo", "--cert", "/nonexistent.pem", "--key", "/nonexistent.key"], "cannot read"),
        (["--demo", "--quic-retry-secret", "short"], "at least 16 bytes"),
        (["--demo", "--ticket-secret", "x" * 16], "--ticket-secret seals tickets stored in Redis"),
        (["--demo", "--redis", "redis://x", "--ticket-secret", "short"], "at least 16 bytes"),
        (["--demo", "--workers", "0"], "serve.workers must be >= 1"),
        (["--demo", "--max-streams", "0"], "max_concurrent_streams must be >= 1"),
        (["--demo", "--config", "/nonexistent.toml"], "--config /nonexistent.toml"),
    ],
)
def test_bad_settings_are_refused_clearly(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("taken", ["--http", "--h3"])
def test_a_port_in_use_is_named(
    taken: str, dev_certs: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Of the listeners `serve` starts, the one whose address is taken is named."""
    kind = socket.SOCK_STREAM if taken == "--http" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as holder:
        holder.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            holder.listen()
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        ports = {"--http": f"127.0.0.1:{free_port()}", "--h3": f"127.0.0.1:{free_port()}"}
        ports[taken] = address
        argv = ["--demo", "--tcp", "off", "--admin", "off", "--cert", str(dev_certs.cert),
                "--key", str(dev_certs.key),
                *(x for flag, value in ports.items() for x in (flag, value))]  # fmt: skip
        assert main(argv) == 1
    protocol = "TCP" if taken == "--http" else "UDP"
    assert f"cannot listen on {address} ({protocol}): Address already in use" in (
        capsys.readouterr().err
    )


def test_help_shows_the_early_data_policy() -> None:
    text = build_parser().format_help()
    for route in ("/v1/chat/completions", "/v1/completions", "/generate"):
        assert f"{route:<22} accept" in text
    assert "(any other path)       defer" in text
    assert "--early-data {accept,defer,reject}" in text


def test_toml_settings_and_flag_overrides(tmp_path: Path) -> None:
    config = tmp_path / "edge.toml"
    config.write_text(
        """
[serve]
h3 = "0.0.0.0:443"
tcp = "off"
dev_certs = true
workers = 3
redis = "redis://r:6379/0"
max_body_bytes = 1000

[early_data]
default = "reject"
routes = { "/v1/embeddings" = "accept" }
"""
    )
    parser = build_parser()
    t = _transport(parser.parse_args(["--demo", "--config", str(config)]))
    assert t.h3 == ("0.0.0.0", 443) and t.tcp is None and t.workers == 3
    assert t.limits.max_body_bytes == 1000
    assert t.early_data.mode_for("/v1/embeddings") is Mode.ACCEPT
    assert t.early_data.mode_for("/generate") is Mode.ACCEPT
    assert t.early_data.mode_for("/other") is Mode.REJECT
    args = parser.parse_args(
        ["--demo", "--config", str(config), "--workers", "1", "--early-data", "defer"]
        + ["--tcp", "[::1]:8443"]
    )
    t = _transport(args)
    assert t.workers == 1 and t.tcp == ("::1", 8443)
    assert t.early_data.mode_for("/generate") is Mode.DEFER


def test_new_connection_settings_from_flags_and_toml(tmp_path: Path) -> None:
    config = tmp_path / "edge.toml"
    config.write_text(
        "[serve]\ninitial_congestion_window = 10\nquic_address_tokens = false\n"
        "quic_stateless_reset = false\n"
    )
    t = _transport(build_parser().parse_args(["--demo", "--config", str(config)]))
    assert t.limits.initial_congestion_window == 10 and t.quic_address_tokens is False
    assert t.quic_stateless_reset is False
    args = build_parser().parse_args(["--demo", "--initial-congestion-window", "16"])
    t = _transport(args)
    assert t.limits.initial_congestion_window == 16 and t.quic_address_tokens is True
    assert t.quic_stateless_reset is True
    args = build_parser().parse_args(["--demo", "--no-quic-stateless-reset"])
    assert _transport(args).quic_stateless_reset is False
    assert _transport(build_parser().parse_args(["--demo"])).quic_worker_steering is True
    config.write_text("[serve]\nquic_worker_steering = false\n")
    args = build_parser().parse_args(["--demo", "--config", str(config)])
    assert _transport(args).quic_worker_steering is False


def _transport(args, environ: dict[str, str] | None = None):
    return transport_config(load_settings(args, environ or {}))


def test_environment_sits_between_flags_and_toml(tmp_path: Path) -> None:
    config = tmp_path / "edge.toml"
    config.write_text('[serve]\nworkers = 3\nredis = "redis://r:6379/0"\ndrain_timeout = 4\n')
    env = {"QUICEDGE_WORKERS": "2", "QUICEDGE_EARLY_DATA": "reject", "QUICEDGE_H3": "[::1]:9"}
    t = _transport(build_parser().parse_args(["--demo", "--config", str(config)]), env)
    assert t.workers == 2 and t.drain_timeout == 4.0 and t.h3 == ("::1", 9)
    assert t.early_data.mode_for("/generate") is Mode.REJECT
    args = build_parser().parse_args(["--demo", "--config", str(config), "--workers", "5"])
    assert _transport(args, env).workers == 5


def _gtls(port: int, workdir: Path, *extra: str) -> tuple[str, dict]:
    """One gtlsclient run (ngtcp2 + GnuTLS: not aioquic) POSTing to /generate; (log, answer)."""
    assert shutil.which("gtlsclient"), "gtlsclient (Debian ngtcp2-client) is required: make test"
    out = workdir / "out"
    out.mkdir(exist_ok=True)
    body = workdir / "body.json"
    body.write_text('{"text": "hello"}')
    answer = out / "generate"
    answer.unlink(missing_ok=True)
    run = subprocess.run(
        [
            "gtlsclient", "--exit-on-all-streams-close", "--no-quic-dump", "--no-http-dump",
            f"--session-file={workdir / 'session'}", f"--tp-file={workdir / 'tp'}",
            f"--download={out}", "-m", "POST", "-d", str(body), "--timeout=10s", *extra,
            "127.0.0.1", str(port), f"https://localhost:{port}/generate",
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert answer.exists(), f"no answer from gtlsclient: {run.stdout}\n{run.stderr}"
    return run.stdout + run.stderr, json.loads(answer.read_text())


def test_gtlsclient_resumes_with_0rtt_and_the_replayed_ticket_is_refused(
    serve_process, tmp_path: Path
) -> None:
    server: ServeProcess = serve_process("--demo")
    log, first = _gtls(server.h3_port, tmp_path)
    assert first["early_data"] is False and first["transport"] == "h3"
    assert (tmp_path / "session").exists() and (tmp_path / "tp").exists()
    # Keep the ticket the first run saved; the second run overwrites the files with a new one.
    saved = {n: (tmp_path / n).read_bytes() for n in ("session", "tp")}
    log, second = _gtls(server.h3_port, tmp_path)
    assert "Early data was rejected" not in log
    assert second["early_data"] is True
    assert second["body_bytes"] == len('{"text": "hello"}')
    for name, data in saved.items():
        (tmp_path / name).write_bytes(data)
    log, replay = _gtls(server.h3_port, tmp_path)
    assert "Early data was rejected by server" in log
    assert replay["early_data"] is False  # served after the full handshake
    assert server.metric(ZERO_RTT % "accepted") == 1
    assert server.metric(ZERO_RTT % "replay_refused") == 1
    assert server.stop() == 0  # SIGTERM: drained and exited cleanly


def test_gtlsclient_takes_the_address_token_from_the_new_token_frame(
    serve_process, tmp_path: Path
) -> None:
    """Another QUIC stack (ngtcp2) parses the NEW_TOKEN frame and keeps the token it carries:
    the one this server issued to it. (ngtcp2 0.12's client then fails to read its own token
    file back, "Could not read token", so the next connection does not present it.)"""
    secret = "a secret of the edge's own, 16+ bytes"
    server: ServeProcess = serve_process("--demo", "--quic-retry-secret", secret)
    token_file = tmp_path / "token"
    _gtls(server.h3_port, tmp_path, f"--token-file={token_file}")
    pem = token_file.read_text().split()
    assert pem[:3] == ["-----BEGIN", "QUIC", "TOKEN-----"]
    token = base64.b64decode(pem[3])
    assert AddressTokens(secret.encode()).valid(token, "127.0.0.1")
    assert server.stop() == 0


async def test_two_processes_sharing_redis_accept_a_ticket_once(
    serve_process, dev_certs, redis_url: str, redis_prefix: str
) -> None:
    # Both processes use the default development certificates of the checkout.
    ca = ensure_dev_certificates().ca_cert
    sealed = ("--redis", redis_url, "--ticket-secret", "one secret for the whole fleet")
    a: ServeProcess = serve_process("--demo", *sealed)
    b: ServeProcess = serve_process("--demo", *sealed)
    assert any("(sealed)" in line for line in a.lines)
    ticket = await fresh_ticket(a.h3_port, ca)  # issued by A, kept in Redis
    results = []
    for server in (b, a, b):  # redeemed on B; replays on A and on B are refused
        async with h3_connect(server.h3_port, ca, ticket=ticket, wait_connected=False) as c:
            r = await c.fetch("POST", "/generate", body=b"{}")
            await asyncio.wait_for(c.handshake_done.wait(), 10)
            assert c.handshake is not None
            results.append((c.handshake.early_data_accepted, json.loads(r.body)["early_data"]))
    assert results == [(True, True), (False, False), (False, False)]
    assert b.metric(ZERO_RTT % "accepted") == 1
    assert a.metric(ZERO_RTT % "replay_refused") + b.metric(ZERO_RTT % "replay_refused") == 2


async def test_workers_share_ports_and_tickets(serve_process, redis_url: str) -> None:
    ca = ensure_dev_certificates().ca_cert
    server: ServeProcess = serve_process("--demo", "--workers", "2", "--redis", redis_url)
    assert any("workers 2" in line for line in server.lines)
    ticket = await fresh_ticket(server.h3_port, ca)
    accepted: list[bool] = []
    pids = set()

    async def resume() -> None:  # a new client port: the kernel spreads them over both workers
        async with h3_connect(server.h3_port, ca, ticket=ticket, wait_connected=False) as c:
            r = await c.fetch("POST", "/generate", body=b"{}")
            await asyncio.wait_for(c.handshake_done.wait(), 10)
            assert c.handshake is not None
            accepted.append(c.handshake.early_data_accepted)
            pids.add(json.loads(r.body)["pid"])

    # Whichever worker the first resumption reaches takes the ticket another worker issued.
    # A store cooling down after a slow Redis answer (a loaded host: 10 ms) refuses early
    # data but leaves the ticket in Redis for a later connection, so wait for the one taker.
    for _ in range(40):
        await resume()
        if accepted[-1]:
            break
        await asyncio.sleep(0.1)
    assert accepted[-1] is True
    for _ in range(4):  # used once: no worker takes it again
        await resume()
    assert accepted.count(True) == 1
    assert server.stop() == 0
    assert len(pids) >= 1


def _sample(metrics: str, sample: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no sample {sample}")


async def test_workers_accept_each_others_address_tokens(serve_process, redis_url: str) -> None:
    """The parent gives every worker one key: a token from either is good at either. The
    kernel spreads new client ports over the workers, so with a key per worker some tokens
    would reach the other one and be refused there."""
    ca = ensure_dev_certificates().ca_cert
    server: ServeProcess = serve_process("--demo", "--workers", "2", "--redis", redis_url)
    tokens: list[bytes] = []
    for i in range(8):
        async with h3_connect(server.h3_port, ca, tokens=tokens) as c:
            assert (await c.fetch("POST", "/generate", body=b"{}")).status == 200
            await wait_until(lambda: len(tokens) > i)  # noqa: B023 (awaited at once)
    for token in list(tokens):
        async with h3_connect(server.h3_port, ca, token=token) as c:
            assert (await c.fetch("POST", "/generate", body=b"{}")).status == 200
    # The demo's /metrics is the answering worker's own; each scrape is a new connection,
    # which the kernel hands to either worker.
    name = "quicedge_quic_address_tokens_total{outcome=%s}"
    scrapes = [server.metrics() for _ in range(12)]
    assert all(_sample(m, name % '"invalid"') == 0 for m in scrapes)
    accepted = {_sample(m, name % '"accepted"') for m in scrapes}
    assert max(accepted) > 0 and sum(accepted) <= 8
    assert server.stop() == 0


async def test_address_tokens_can_be_turned_off(serve_process) -> None:
    ca = ensure_dev_certificates().ca_cert
    for flag, expected in (("--quic-address-tokens", 1), ("--no-quic-address-tokens", 0)):
        server: ServeProcess = serve_process("--demo", flag)
        tokens: list[bytes] = []
        async with h3_connect(server.h3_port, ca, tokens=tokens) as c:
            assert (await c.fetch("POST", "/generate", body=b"{}")).status == 200
            # The flight a token comes in (with HANDSHAKE_DONE) came before the answer's end.
            await asyncio.wait_for(c.handshake_done.wait(), 10)
            await asyncio.sleep(0.1)
        assert len(tokens) == expected
        assert server.stop() == 0


async def test_serve_listeners_alt_svc_and_sighup(serve_process) -> None:
    http_port = free_port()
    server: ServeProcess = serve_process(
        "--demo", "--http", f"127.0.0.1:{http_port}", "--max-requests-per-connection", "3"
    )
    ctx = ssl.create_default_context(cafile=str(ensure_dev_certificates().ca_cert))
    async with httpx.AsyncClient(http2=True, verify=ctx) as client:
        r = await client.get(f"https://localhost:{server.tcp_port}/v1/models")
        assert r.http_version == "HTTP/2"
        assert r.headers["alt-svc"] == f'h3=":{server.h3_port}"; ma=86400'
        assert r.json()["transport"] == "h2"
        server.proc.send_signal(signal.SIGHUP)  # reload the certificate: keeps serving
        await asyncio.sleep(0.2)
        r = await client.get(f"https://localhost:{server.tcp_port}/v1/models")
        assert r.status_code == 200
    async with httpx.AsyncClient() as client:
        r = await client.get(f"http://127.0.0.1:{http_port}/generate")
        assert r.json()["transport"] == "h1" and "alt-svc" not in r.headers
        closes = [
            (await client.get(f"http://127.0.0.1:{http_port}/generate")).headers.get("connection")
            for _ in range(2)
        ]
        assert closes == [None, "close"]  # the connection's third request is its last
        health = await client.get(f"http://127.0.0.1:{server.admin_port}/health")
        assert health.status_code == 200
    assert server.proc.poll() is None
    assert server.stop() == 0


def printed_numbers(script: str) -> list[int]:
    """The integers a fresh interpreter prints running `script` (the collector's settings and
    counts are per process)."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    return [int(word) for word in done.stdout.split()]


def test_a_steady_load_runs_almost_no_young_collections() -> None:
    """Requests in flight hold tracked objects until they end: with CPython's default young
    threshold (700), 32 streams crossed it every ~30 requests, each time stopping every request
    to find nothing to free. The whole request path in-process (`tools.request_cpu`), after the
    collector is prepared as `serve` prepares it."""
    script = (
        "import asyncio, gc\n"
        "from tools import request_cpu\n"
        "from transport.collector import prepare_collector\n"
        "prepare_collector()\n"
        "young = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and young.append(info))\n"
        "per_request, ok = asyncio.run(request_cpu.measure(2000, 1, 32, 4))\n"
        "print(ok, sum(1 for info in young if info['generation'] == 0))\n"
    )
    served, young = printed_numbers(script)
    assert served == 2000
    assert young <= 3  # 80 with the default threshold


def test_startup_heap_is_frozen_before_serving() -> None:
    """What startup allocated is out of the collector's reach, so a full collection while
    serving does not walk it (a pause of tens of ms on a small machine)."""
    script = (
        "import gc\n"
        "import edge.wiring\n"
        "from transport.collector import prepare_collector\n"
        "prepare_collector()\n"
        "print(gc.get_freeze_count(), len(gc.get_objects()))\n"
    )
    frozen, tracked = printed_numbers(script)
    assert frozen > 10_000 and tracked < frozen // 10
