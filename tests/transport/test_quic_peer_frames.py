"""QUIC frames a client writes that no well-behaved one would, in 1-RTT packets of its own
connection, against the real listener: what they may make it do is bounded."""

from __future__ import annotations

import asyncio
from typing import Any

from aioquic.buffer import encode_uint_var
from aioquic.quic.connection import QuicErrorCode
from aioquic.quic.packet import QuicFrameType, QuicPacketType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.tls import Epoch

from tests.helpers import wait_until
from tests.transport.conftest import H3Factory
from tests.transport.h3client import H3Client, h3_connect


def send_frames(client: H3Client, frames: list[tuple[int, bytes]]) -> None:
    """One 1-RTT packet holding these (frame type, payload) frames, under the client's keys and
    next packet number, which the client's own state knows nothing of."""
    quic = client.quic
    builder = QuicPacketBuilder(
        host_cid=quic.host_cid,
        peer_cid=quic._peer_cid.cid,
        version=quic._version,
        is_client=True,
        max_datagram_size=quic.configuration.max_datagram_size,
        packet_number=quic._packet_number,
    )
    builder.start_packet(QuicPacketType.ONE_RTT, quic._cryptos[Epoch.ONE_RTT])
    for frame_type, payload in frames:
        builder.start_frame(frame_type, capacity=len(payload)).push_bytes(payload)
    datagrams, _ = builder.flush()
    quic._packet_number = builder.packet_number
    transport: Any = client._transport
    for datagram in datagrams:
        transport.sendto(datagram, quic._network_paths[0].addr)


async def _closed(client: H3Client) -> tuple[int, str]:
    async with asyncio.timeout(10):
        while client.terminated is None:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return client.terminated.error_code, client.terminated.reason_phrase


async def test_retiring_a_connection_id_never_sent_ends_the_connection(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """Retiring ID 1 makes ID 4 at once, unsent; retiring that too made ID 5, and so on, hundreds
    a datagram (2.5 ms of CPU each), and without stateless resets (as here) aioquic's server
    failed an assertion for each, logged at every datagram."""
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as c:
        await wait_until(lambda: len(c.quic._peer_cid_available) == 3)  # IDs 1 to 3 were sent
        send_frames(c, [(QuicFrameType.RETIRE_CONNECTION_ID, encode_uint_var(1))])
        assert (await c.fetch("GET", "/echo")).status == 200  # one sent: retired, replaced
        retire = [(QuicFrameType.RETIRE_CONNECTION_ID, encode_uint_var(n)) for n in (2, 5)]
        send_frames(c, retire)  # 2 was sent, and makes 5, not sent yet
        code, reason = await _closed(c)
        assert code == QuicErrorCode.PROTOCOL_VIOLATION
        assert reason == "Cannot retire a connection ID never sent"
