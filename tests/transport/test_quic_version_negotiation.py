"""Version negotiation on the QUIC listener (RFC 9000 §5.2.2, §6), over a real socket: a
Version Negotiation packet only for a datagram that could open a connection."""

from __future__ import annotations

import asyncio
import os
import socket

from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE

from tests.transport.conftest import H3Factory

UNKNOWN = b"\x1a\x2a\x3a\x4a"
"""A QUIC version no listener supports (a reserved, greasing one: RFC 9000 §15)."""


def _long(size: int) -> bytes:
    """A long-header Initial-looking datagram of an unknown version, `size` bytes long."""
    head = b"\xc0" + UNKNOWN + b"\x08" + os.urandom(8) + b"\x08" + os.urandom(8) + b"\x00\x00"
    return head + bytes(size - len(head))


async def _answer(port: int, datagram: bytes) -> bytes | None:
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.connect(("127.0.0.1", port))
        sock.send(datagram)
        try:
            return await asyncio.wait_for(loop.sock_recv(sock, 4096), 0.5)
        except TimeoutError:
            return None


async def test_a_small_datagram_of_an_unknown_version_gets_no_version_negotiation(
    h3_server: H3Factory,
) -> None:
    """A datagram too small to open a connection is dropped, not answered: the answer listed
    every version, longer than a 9-byte trigger, to an address no one checked (§5.2.2: servers
    MUST drop smaller packets that specify unsupported versions)."""
    async with h3_server() as server:
        for datagram in (b"\xc0" + UNKNOWN + b"\x00\x00\x00\x00", _long(100), _long(1199)):
            assert await _answer(server.port, datagram) is None, len(datagram)
        # One of a full Initial's size is still told the versions the listener speaks.
        reply = await _answer(server.port, _long(SMALLEST_MAX_DATAGRAM_SIZE))
        assert reply is not None and reply[1:5] == bytes(4)  # version 0: Version Negotiation
        assert len(reply) < SMALLEST_MAX_DATAGRAM_SIZE
