"""Stateless resets (RFC 9000 §10.3): what a reset looks like and when one is sent, the tokens
a listener gives its connection IDs, and a client of a killed and restarted `quicedge serve`
learning at once that its connection is gone, over real sockets with aioquic clients."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from prometheus_client import CollectorRegistry

from certs import ensure_dev_certificates
from tests.helpers import wait_until
from tests.transport.conftest import H3Factory, ServeProcess
from tests.transport.h3client import H3Client, h3_connect
from transport import aioquic_patches as patches
from transport.demo import demo_app
from transport.metrics import TransportMetrics
from transport.stateless_reset import (
    MIN_RESET_BYTES,
    SHORT_TRIGGER_BYTES,
    SPREAD_BYTES,
    TOKEN_BYTES,
    StatelessResets,
    instance_label,
    looks_like_reset,
    reset_length,
)

SECRET = b"a secret every worker shares"
CID = bytes(range(8))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _short(length: int, cid: bytes = CID) -> bytes:
    """A datagram that looks like a 1-RTT packet for `cid`."""
    return bytes([0x41]) + cid + os.urandom(length - 1 - len(cid))


def test_a_token_is_the_same_for_the_same_secret_host_and_worker_only() -> None:
    token = StatelessResets(SECRET, instance=instance_label(0, "edge-1")).token(CID)
    assert len(token) == TOKEN_BYTES
    assert StatelessResets(SECRET, instance=instance_label(0, "edge-1")).token(CID) == token
    others = [
        StatelessResets(SECRET, instance=instance_label(1, "edge-1")),  # another worker
        StatelessResets(SECRET, instance=instance_label(0, "edge-2")),  # another machine
        StatelessResets(b"another secret of some length", instance=instance_label(0, "edge-1")),
        StatelessResets(),  # no secret: a key of this object's own
    ]
    assert all(o.token(CID) != token for o in others)
    assert StatelessResets(SECRET).token(CID[:-1] + b"\xff") != StatelessResets(SECRET).token(CID)


@pytest.mark.parametrize("trigger", [22, 30, 43, 44, 60, 107, 108, 1200])
def test_a_reset_is_shorter_than_its_trigger_and_looks_like_a_short_header(trigger: int) -> None:
    resets = StatelessResets(SECRET)
    for _ in range(20):
        reply = resets.reply(_short(trigger), len(CID))
        assert reply is not None
        assert MIN_RESET_BYTES <= len(reply) < trigger
        if trigger <= SHORT_TRIGGER_BYTES:
            assert len(reply) == trigger - 1
        else:
            assert len(reply) < SHORT_TRIGGER_BYTES + SPREAD_BYTES
        assert reply[0] & 0xC0 == 0x40  # header form 0, fixed bit 1
        assert reply[-TOKEN_BYTES:] == resets.token(CID)
        assert looks_like_reset(reply, resets.token(CID))
        assert not looks_like_reset(reply, StatelessResets(SECRET).token(b"another"))


def test_a_trigger_too_short_to_answer_gets_nothing() -> None:
    """A reset shorter than its trigger must still be 21 bytes, so nothing answers 21 or less
    (two endpoints can then never reset each other in a loop)."""
    resets = StatelessResets(SECRET)
    assert reset_length(MIN_RESET_BYTES) is None
    assert resets.reply(_short(MIN_RESET_BYTES), len(CID)) is None
    assert resets.reply(bytes([0x41]) + CID[:4], len(CID)) is None  # not even a whole ID
    assert resets.sent == 0


def test_resets_are_bounded_by_their_rate() -> None:
    clock = Clock()
    resets = StatelessResets(SECRET, rate=10, clock=clock)
    replies = [resets.reply(_short(100, os.urandom(8)), 8) for _ in range(25)]
    assert sum(r is not None for r in replies) == 10
    assert (resets.sent, resets.limited) == (10, 15)
    clock.now += 0.5  # half a second refills five
    replies = [resets.reply(_short(100, os.urandom(8)), 8) for _ in range(25)]
    assert sum(r is not None for r in replies) == 5
    with pytest.raises(ValueError, match="rate"):
        StatelessResets(SECRET, rate=0)


def test_what_is_not_a_reset_is_not_taken_for_one() -> None:
    token = StatelessResets(SECRET).token(CID)
    body = os.urandom(30)
    assert looks_like_reset(b"\x40" + body + token, token)
    assert not looks_like_reset(b"\xc0" + body + token, token)  # a long header
    assert not looks_like_reset((b"\x40" + body + token)[-20:], token)  # too short
    assert not looks_like_reset(b"\x40" + body + token, None)  # no token for that ID


def test_a_server_connection_gets_derived_tokens_for_every_id_it_issues(dev_certs: Any) -> None:
    resets = StatelessResets(SECRET)
    config = QuicConfiguration(is_client=False)
    config.load_cert_chain(dev_certs.cert, dev_certs.key)
    quic = QuicConnection(configuration=config, original_destination_connection_id=CID)
    routed: list[bytes] = []
    patches.derive_reset_tokens(quic, resets.token, routed.append)
    quic._remote_active_connection_id_limit = 4
    quic._replenish_connection_ids()
    assert len(quic._host_cids) == 4
    for connection_id in quic._host_cids:
        assert connection_id.stateless_reset_token == resets.token(connection_id.cid)
    # Routed as they are made, before a NEW_CONNECTION_ID frame carries them: a client that
    # moves to one at once must reach its connection, not get a reset.
    assert routed == [c.cid for c in quic._host_cids[1:]]
    assert not any(c.was_sent for c in quic._host_cids[1:])


async def test_the_listener_answers_an_unknown_connection_with_a_reset(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """Over a real socket: a reset for a datagram of an unknown connection ID, with the token
    the listener gives that ID; nothing for one too short; both counted."""
    metrics = TransportMetrics(CollectorRegistry())
    resets = StatelessResets(SECRET)
    async with h3_server(stateless_resets=resets, metrics=metrics) as server:
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.connect(("127.0.0.1", server.port))
            sock.send(_short(100))
            reply = await asyncio.wait_for(loop.sock_recv(sock, 2048), 5)
            assert len(reply) < 100 and reply[0] & 0xC0 == 0x40
            assert reply[-TOKEN_BYTES:] == resets.token(CID)
            sock.send(_short(MIN_RESET_BYTES))
            await wait_until(lambda: metrics.stateless_resets.labels("not_sent")._value.get() == 1)
        # A live connection's datagrams still reach it, and its tokens are the derived ones.
        async with h3_connect(server.port, dev_certs.ca_cert) as client:
            assert (await client.fetch("GET", "/echo")).status == 200
            peer = client.quic._peer_cid
            assert peer.stateless_reset_token == resets.token(peer.cid)
            # A client that moves to another of the IDs it was given is still answered.
            await wait_until(lambda: bool(client.quic._peer_cid_available))
            client.quic.change_connection_id()
            assert (await client.fetch("GET", "/echo")).status == 200
            moved = client.quic._peer_cid
            assert moved.cid != peer.cid
            assert moved.stateless_reset_token == resets.token(moved.cid)
            assert client.terminated is None
    assert metrics.stateless_resets.labels("sent")._value.get() == 1


async def test_a_closed_connection_leaves_nothing_behind(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """The per-connection entry the reset tokens need goes with its connection."""
    async with h3_server(app=demo_app, stateless_resets=StatelessResets(SECRET)) as server:
        for _ in range(3):
            async with h3_connect(server.port, dev_certs.ca_cert) as client:
                assert (await client.fetch("GET", "/echo")).status == 200
        await wait_until(lambda: not server.connections())
        await wait_until(lambda: (gc.collect(), len(patches._RESET_TOKENS))[1] == 0)


def _answer(port: int) -> bytes | None:
    """What a `quicedge serve` sends back to a 1-RTT-looking datagram of no connection."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(1.0)
        sock.sendto(_short(100), ("127.0.0.1", port))
        try:
            return sock.recv(2048)
        except TimeoutError:
            return None


def test_serve_sends_resets_unless_turned_off(serve_process: Any) -> None:
    on = serve_process("--demo")
    reply = _answer(on.h3_port)
    assert reply is not None and len(reply) < 100
    off = serve_process("--demo", "--no-quic-stateless-reset")
    assert _answer(off.h3_port) is None
    assert off.metric('quicedge_quic_stateless_resets_total{outcome="sent"}') == 0


@asynccontextmanager
async def _connected_then_restarted(
    serve_process: Any, restart_secret: str
) -> AsyncIterator[tuple[H3Client, ServeProcess]]:
    """A client connected to a `quicedge serve` that is then killed (SIGKILL: no
    CONNECTION_CLOSE) and started again on the same port with `restart_secret`; the client
    then sends a PING into its old connection."""
    first = await asyncio.to_thread(
        serve_process, "--demo", "--quic-retry-secret", SECRET.decode(), "--idle-timeout", "60"
    )
    ca = ensure_dev_certificates().ca_cert  # what `--demo` serves
    async with h3_connect(first.h3_port, ca) as client:
        assert (await client.fetch("POST", "/x", body=b"hello")).status == 200
        first.proc.kill()
        first.proc.wait()
        second = await asyncio.to_thread(
            serve_process, "--demo", "--quic-retry-secret", restart_secret,
            "--h3", f"127.0.0.1:{first.h3_port}",
        )  # fmt: skip
        client.quic.send_ping(1)
        client.transmit()
        yield client, second


SENT = 'quicedge_quic_stateless_resets_total{outcome="sent"}'


async def test_a_client_of_a_killed_and_restarted_serve_learns_at_once(serve_process: Any) -> None:
    """Without a reset the client would wait out its 60 s idle timeout."""
    async with _connected_then_restarted(serve_process, SECRET.decode()) as (
        client,
        second,
    ):
        await wait_until(lambda: client.terminated is not None, timeout=5)
        assert client.terminated is not None
        assert client.terminated.reason_phrase == patches.STATELESS_RESET
        assert await asyncio.to_thread(second.metric, SENT) >= 1


async def test_a_reset_under_another_secret_is_not_recognised(serve_process: Any) -> None:
    async with _connected_then_restarted(serve_process, "another secret of some length") as (
        client,
        second,
    ):
        await asyncio.to_thread(second.wait_metric, SENT, 1)
        await asyncio.sleep(0.3)  # the reset has arrived and been looked at
        assert client.terminated is None


def test_an_independent_client_recognises_the_reset(serve_process: Any, tmp_path: Path) -> None:
    """ngtcp2's gtlsclient (not aioquic) completes a handshake, then holds its request back
    while the serve it talks to is killed and started again with the same secret; the request
    it then sends is answered with a reset under the token the first process gave it, and it
    stops at once instead of waiting out its 30 s idle timeout."""
    assert shutil.which("gtlsclient"), "gtlsclient (Debian ngtcp2-client) is required: make test"
    args = ("--demo", "--quic-retry-secret", SECRET.decode())
    first = serve_process(*args)
    body = tmp_path / "body.json"
    body.write_text('{"text": "hello"}')
    port = first.h3_port
    started = time.monotonic()
    client = subprocess.Popen(
        [
            "gtlsclient", "--exit-on-all-streams-close", "--no-quic-dump", "--no-http-dump",
            f"--download={tmp_path}", "-m", "POST", "-d", str(body), "--timeout=30s",
            "--delay-stream=6s", "127.0.0.1", str(port), f"https://localhost:{port}/generate",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        first.wait_metric('quicedge_handshakes_total{resumed="false"}', 1)
        first.proc.kill()
        first.proc.wait()
        serve_process(*args, "--h3", f"127.0.0.1:{port}")
        out, _ = client.communicate(timeout=25)
    finally:
        client.kill()
    elapsed = time.monotonic() - started
    given = re.search(r"remote transport_parameters stateless_reset_token=0x([0-9a-f]+)", out)
    received = re.search(r"rx 0 SR token=0x([0-9a-f]+)", out)
    assert given and received, out[-3000:]
    assert received.group(1) == given.group(1)
    assert "ERR_DRAINING" in out
    assert elapsed < 20, f"the client took {elapsed:.1f} s"


def _kill_with_workers(server: ServeProcess) -> None:
    """SIGKILL a serve and its workers: a crash, no CONNECTION_CLOSE from anyone."""
    children = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    server.proc.kill()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    server.proc.wait()


async def test_every_client_of_a_restarted_multi_worker_serve_gets_a_reset_it_knows(
    serve_process: Any, redis_url: str
) -> None:
    """Keys are per worker; connection-ID steering takes each client's packets to the worker
    with its old index after the restart, so each gets a token it knows."""
    args = ("--demo", "--workers", "2", "--redis", redis_url, "--quic-retry-secret")
    first = await asyncio.to_thread(serve_process, *args, SECRET.decode())
    ca = ensure_dev_certificates().ca_cert
    async with contextlib.AsyncExitStack() as stack:
        clients: list[H3Client] = []
        per_worker: dict[int, int] = {}
        while len(per_worker) < 2 or min(per_worker.values()) < 3:  # both workers' clients
            assert len(clients) < 60, f"clients reached one worker only: {per_worker}"
            client = await stack.enter_async_context(h3_connect(first.h3_port, ca))
            response = await client.fetch("POST", "/x", body=b"{}")
            pid = json.loads(response.body)["pid"]
            per_worker[pid] = per_worker.get(pid, 0) + 1
            clients.append(client)
        await asyncio.to_thread(_kill_with_workers, first)
        await asyncio.to_thread(
            serve_process, *args, SECRET.decode(), "--h3", f"127.0.0.1:{first.h3_port}"
        )
        for client in clients:
            client.quic.send_ping(1)
            client.transmit()
        await wait_until(lambda: all(c.terminated is not None for c in clients), timeout=5)
        assert {c.terminated.reason_phrase for c in clients if c.terminated} == {
            patches.STATELESS_RESET
        }


_BENCH_CLIENT = """
import asyncio, sys, time
from bench.clients import ClientOptions, Target, make_client

async def main() -> None:
    options = ClientOptions(cacert=sys.argv[2], timeout=30.0, new_connection_per_request=False)
    client = make_client("h3", options)
    target = Target.parse(f"https://localhost:{sys.argv[1]}/x")
    for _ in range(3):
        started = time.monotonic()
        result = await client.request(target, method="POST", headers=[], body=b"{}")
        print(result.status, round(time.monotonic() - started, 2), result.error, flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the test restarts the serve meanwhile
    await client.aclose()
    # The check is the client's own: aioquic is not patched in this process.
    print("patched" if "transport.aioquic_patches" in sys.modules else "unpatched", flush=True)

asyncio.run(main())
"""


def test_quicedge_bench_fails_a_request_on_a_reset_connection_at_once(
    serve_process: Any,
) -> None:
    """`quicedge bench`'s client keeps one connection; after the serve restarts, that
    connection meets a reset and the client knows it at once: its next request fails at once
    or goes on a new connection, never waits out the 30 s timeout; the one after is served."""
    args = ("--demo", "--quic-retry-secret", SECRET.decode())
    first = serve_process(*args)
    client = subprocess.Popen(
        [sys.executable, "-c", _BENCH_CLIENT, str(first.h3_port),
         str(ensure_dev_certificates().ca_cert)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert client.stdin is not None and client.stdout is not None
    try:
        assert client.stdout.readline().split()[0] == "200"
        first.proc.kill()
        first.proc.wait()
        serve_process(*args, "--h3", f"127.0.0.1:{first.h3_port}")
        client.stdin.write("\n")
        client.stdin.flush()
        status, seconds, error = client.stdout.readline().strip().split(" ", 2)
        # Failed by the reset, or (where the client's own packets met a reset while it waited)
        # served on a new connection; on the dead one it would have waited 30 s.
        assert float(seconds) < 5, (status, seconds, error)
        assert (status, error) == ("200", "None") or "stateless reset" in error
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.stdout.readline().split()[0] == "200"  # a new connection
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "unpatched"
    finally:
        client.kill()
        client.wait()
