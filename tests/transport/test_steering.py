"""Connection-ID steering across workers (`transport.steering`): the kernel's choice of socket
for real datagrams, the IDs each worker makes, and a client of `quicedge serve --workers 2`
whose address changes mid-connection (a NAT rebinding) staying with its worker."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
from typing import Any

import pytest

from certs import ensure_dev_certificates
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


async def test_new_clients_are_served_after_a_worker_dies(
    serve_process: Any, redis_url: str
) -> None:
    """Steered by connection ID, half of the new clients would go on reaching the dead
    worker's socket; the parent closes it and goes back to the address hash."""
    server: ServeProcess = await asyncio.to_thread(
        serve_process, "--demo", "--workers", "2", "--redis", redis_url
    )
    workers = _worker_pids(server)
    assert len(workers) == 2, server.lines
    os.kill(workers[0], signal.SIGKILL)
    ca = ensure_dev_certificates().ca_cert
    await asyncio.sleep(0.5)  # the parent notices
    pids = set()
    for _ in range(8):
        async with h3_connect(server.h3_port, ca) as client:
            response = await client.fetch("POST", "/x", body=b"{}", timeout=5)
            assert response.status == 200
            pids.add(json.loads(response.body)["pid"])
    assert pids == {workers[1]}
    assert "spread by client address now" in server.errors()


def _worker_pids(server: ServeProcess) -> list[int]:
    """The workers' pids, from the line `serve` prints once they are all up."""
    line = next(line for line in server.lines if "(pids [" in line)
    return [int(pid) for pid in line.split("(pids [", 1)[1].split("]", 1)[0].split(", ")]
