"""Connection-ID steering across workers (`transport.steering`): the kernel's choice of socket
for real datagrams, the IDs each worker makes, and a client of `quicedge serve --workers 2`
whose address changes mid-connection (a NAT rebinding) staying with its worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import select
import signal
import socket
import sys
from typing import Any

import pytest

from certs import ensure_dev_certificates
from tests.helpers import wait_until
from tests.transport.conftest import ServeProcess
from tests.transport.h3client import h3_connect
from tests.transport.udp_holdback import UdpHoldback
from transport import aioquic_patches as patches
from transport.steering import (
    MAX_WORKERS,
    WorkerConnectionIds,
    bind_group,
    program,
    spread_by_address,
    worker_for,
)
from transport.workers import RESTARTS, RestartBudget, _Workers


def _short(first_cid_byte: int) -> bytes:
    return bytes([0x41, first_cid_byte]) + os.urandom(40)


def _long(first_cid_byte: int) -> bytes:
    # Initial: first byte, version 1, DCID length 8, then the DCID
    return bytes([0xC0]) + (1).to_bytes(4, "big") + bytes([8, first_cid_byte]) + os.urandom(40)


def _receiver(group: list[socket.socket], datagram: bytes) -> int:
    """Which socket of `group` the kernel gives `datagram` to."""
    port = group[0].getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        client.sendto(datagram, ("127.0.0.1", port))
    readable, _, _ = select.select(group, [], [], 5.0)
    assert len(readable) == 1, f"{len(readable)} sockets of the group got the datagram"
    assert readable[0].recv(2048) == datagram
    return group.index(readable[0])


@pytest.mark.parametrize("workers", [2, 3])
def test_the_kernel_gives_each_datagram_to_the_worker_its_connection_id_names(
    workers: int,
) -> None:
    group = bind_group("127.0.0.1", 0, workers)
    try:
        assert len({s.getsockname() for s in group}) == 1  # one port for all
        for first in (0, 1, 2, 5, 7, 130, 255):
            assert _receiver(group, _short(first)) == first % workers
            assert _receiver(group, _long(first)) == first % workers
            assert worker_for(_short(first), workers) == first % workers
            assert worker_for(_long(first), workers) == first % workers
    finally:
        for sock in group:
            sock.close()


def test_spread_by_address_gives_up_the_connection_id() -> None:
    group = bind_group("127.0.0.1", 0, 3)
    try:
        assert {_receiver(group, _short(0)) for _ in range(6)} == {0}
        spread_by_address(group[1])  # any socket of the group sets it for all
        # By the hash of each client's port now: twelve clients all on socket 0 would be a
        # one-in-half-a-million chance.
        assert len({_receiver(group, _short(0)) for _ in range(12)}) > 1
    finally:
        for sock in group:
            sock.close()


def test_restarts_are_bounded_per_window() -> None:
    now = [0.0]
    budget = RestartBudget(limit=3, window=60.0, clock=lambda: now[0])
    assert [budget.take() for _ in range(4)] == [True, True, True, False]
    now[0] = 59.0
    assert not budget.take()
    now[0] = 60.5  # the first three are out of the window
    assert budget.take()


def test_each_worker_makes_ids_that_name_it_and_still_vary() -> None:
    for workers in (1, 2, 3, 7, MAX_WORKERS):
        for index in {0, workers - 1, workers // 2}:
            ids = [WorkerConnectionIds(index, workers).new(8) for _ in range(200)]
            assert all(len(i) == 8 and i[0] % workers == index for i in ids)
            if workers < 100:
                assert len({i[0] for i in ids}) > 1  # the first byte tells an observer little
    with pytest.raises(ValueError, match="below"):
        WorkerConnectionIds(2, 2)
    with pytest.raises(ValueError, match="workers"):
        program(0)
    with pytest.raises(ValueError, match="workers"):
        program(MAX_WORKERS + 1)


def test_a_connection_makes_all_its_ids_with_its_worker(dev_certs: Any) -> None:
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection

    config = QuicConfiguration(is_client=False)
    config.load_cert_chain(dev_certs.cert, dev_certs.key)
    quic = QuicConnection(configuration=config, original_destination_connection_id=b"\x00" * 8)
    patches.make_connection_ids(quic, WorkerConnectionIds(1, 3).new)
    assert quic.host_cid[0] % 3 == 1
    assert quic._local_initial_source_connection_id == quic.host_cid
    quic._remote_active_connection_id_limit = 4
    quic._replenish_connection_ids()
    assert len(quic._host_cids) == 4
    assert all(c.cid[0] % 3 == 1 for c in quic._host_cids)


async def test_a_client_whose_address_changes_stays_with_its_worker(
    serve_process: Any, redis_url: str
) -> None:
    """Each rebinding would reach the other of two workers half the time if the kernel spread
    datagrams by address; by connection ID, all eight requests reach the one worker."""
    server: ServeProcess = await asyncio.to_thread(
        serve_process, "--demo", "--workers", "2", "--redis", redis_url
    )
    assert any("QUIC by connection ID" in line for line in server.lines), server.lines
    relay = UdpHoldback(server.h3_port)
    port = await relay.start()
    pids = set()
    try:
        async with h3_connect(port, ensure_dev_certificates().ca_cert) as client:
            for _ in range(8):
                response = await client.fetch("POST", "/x", body=b"{}", timeout=5)
                assert response.status == 200
                pids.add(json.loads(response.body)["pid"])
                await relay.rebind()
    finally:
        relay.close()
    assert len(pids) == 1
    assert await asyncio.to_thread(server.stop) == 0
    assert "spread by client address" not in server.errors()  # stopped, none died


async def _restarted(server: ServeProcess, count: int) -> int:
    """The pid of the `count`th worker the parent started again (once it is up)."""
    pattern = re.compile(r"started again \(pid (\d+)\)")
    for _ in range(300):
        found = pattern.findall(server.errors())
        if len(found) >= count:
            # Datagrams for it wait in its socket, which the parent holds, until it reads them.
            return int(found[count - 1])
        await asyncio.sleep(0.1)
    raise AssertionError(f"no restart {count}: {server.errors()[-2000:]}")


async def _served_by(port: int, clients: int) -> set[int]:
    """The worker pids that answered `clients` new connections."""
    ca = ensure_dev_certificates().ca_cert
    pids = set()
    for _ in range(clients):
        async with h3_connect(port, ca) as client:
            response = await client.fetch("POST", "/x", body=b"{}", timeout=5)
            assert response.status == 200
            pids.add(json.loads(response.body)["pid"])
    return pids


async def test_a_worker_that_dies_is_started_again_and_its_clients_told(
    serve_process: Any, redis_url: str
) -> None:
    """The new worker gets the dead one's index, socket and key: new clients reach it, and a
    client of the dead one gets a stateless reset it recognises, at once."""
    server: ServeProcess = await asyncio.to_thread(
        serve_process, "--demo", "--workers", "2", "--redis", redis_url
    )
    first, second = _worker_pids(server)
    ca = ensure_dev_certificates().ca_cert
    async with contextlib.AsyncExitStack() as stack:
        orphan = None
        for _ in range(60):  # a client of the first worker
            client = await stack.enter_async_context(h3_connect(server.h3_port, ca))
            response = await client.fetch("POST", "/x", body=b"{}")
            if json.loads(response.body)["pid"] == first:
                orphan = client
                break
        assert orphan is not None
        os.kill(first, signal.SIGKILL)
        again = await _restarted(server, 1)
        orphan.quic.send_ping(1)
        orphan.transmit()
        await wait_until(lambda: orphan.terminated is not None, timeout=15)
        assert orphan.terminated is not None
        assert orphan.terminated.reason_phrase == patches.STATELESS_RESET
    # Each scrape of the demo's /metrics is answered by either worker: the new one says so.
    starts: set[float] = set()
    for _ in range(100):
        starts.add(_sample(await asyncio.to_thread(server.metrics)))
        if starts == {1.0, 2.0}:
            break
        await asyncio.sleep(0.05)
    assert starts == {1.0, 2.0}
    seen: set[int] = set()
    for _ in range(5):  # by connection ID, each new client reaches either worker
        seen |= await _served_by(server.h3_port, 8)
        if seen == {again, second}:
            break
    assert seen == {again, second}


async def test_a_worker_that_keeps_dying_is_left_dead_and_the_others_serve(
    serve_process: Any, redis_url: str
) -> None:
    """Past its restart budget a worker stays dead; steered by connection ID, half of the
    new clients would go on reaching its socket, so the parent closes it and goes back to the
    address hash: every new client reaches the other worker. The exit status says so."""
    server: ServeProcess = await asyncio.to_thread(
        serve_process, "--demo", "--workers", "2", "--redis", redis_url
    )
    dying, survivor = _worker_pids(server)
    for restart in range(1, RESTARTS + 1):
        os.kill(dying, signal.SIGKILL)
        dying = await _restarted(server, restart)
    os.kill(dying, signal.SIGKILL)
    for _ in range(50):
        if "spread by client address now" in server.errors():
            break
        await asyncio.sleep(0.1)
    assert "is not started again" in server.errors()
    assert await _served_by(server.h3_port, 8) == {survivor}
    # A worker killed and left dead fails the serve (a supervisor sees it), though the other
    # drained and stopped as told.
    assert await asyncio.to_thread(server.stop) == 128 + signal.SIGKILL


def _sample(metrics: str) -> float:
    """`quicedge_worker_starts` in one worker's exposition."""
    line = next(line for line in metrics.splitlines() if line.startswith("quicedge_worker_starts "))
    return float(line.split()[-1])


def _worker_pids(server: ServeProcess) -> list[int]:
    """The workers' pids, from the line `serve` prints once they are all up."""
    line = next(line for line in server.lines if "(pids [" in line)
    return [int(pid) for pid in line.split("(pids [", 1)[1].split("]", 1)[0].split(", ")]


def test_the_parent_reads_every_report_of_a_restarted_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each worker reports on a pipe of its own (a worker killed while it wrote to a shared
    queue would hold its lock for good); the parent reads them all, logs a failure, and closes
    the pipe of a worker that has ended."""
    workers = object.__new__(_Workers)
    workers._reports = {}
    ends = []
    for index, said in ((0, ["h3 ..."]), (1, "failed: [Errno 98] address in use")):
        reader, writer = multiprocessing.Pipe(duplex=False)
        workers._reports[index] = reader
        writer.send((index, said))
        ends.append(writer)
    ends[1].close()  # worker 1 has ended
    with caplog.at_level("ERROR", logger="quicedge.serve"):
        workers._read_reports()
        assert workers.reports(timeout=0) == []
    assert "worker 1 did not start again: failed: [Errno 98]" in caplog.text
    assert list(workers._reports) == [0]  # worker 1's pipe closed at its end
    ends[0].close()
    workers._reports[0].close()


def test_a_worker_dead_before_the_parent_first_looks_is_started_again() -> None:
    """A worker killed between serve's `ready` and the supervisor's first look (its exit not
    yet collected) is started again, not dropped from the watch as no longer alive."""
    ctx = multiprocessing.get_context("spawn")
    dead = ctx.Process(target=sys.exit, args=(3,))
    dead.start()
    assert dead.pid is not None
    os.waitid(os.P_PID, dead.pid, os.WEXITED | os.WNOWAIT)  # ended, not collected
    workers = object.__new__(_Workers)
    workers._reports, workers.group, workers.stopping = {}, [], []
    workers.budget = RestartBudget()
    workers.procs = [dead]
    spawned: list[int] = []

    def spawn(index: int) -> Any:
        spawned.append(index)
        workers.stopping.append(signal.SIGTERM)  # one look is all this test needs
        return dead

    workers._spawn = spawn  # type: ignore[method-assign]
    workers.supervise()
    assert spawned == [0]
    assert dead.exitcode == 3
