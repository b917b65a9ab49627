"""A UDP relay between one QUIC client and the server that can hold the client's later flights,
and change its source port toward the server (`rebind`), as a NAT's mapping does.

With ``hold_after_reply`` set, every client datagram sent after the server's first reply is held
back. The client's first flight (Initial + 0-RTT) passes; its Finished does not, so the server's
handshake cannot complete until ``release()``. A response that reaches the client meanwhile was
provably answered before the handshake completed.
"""

from __future__ import annotations

import asyncio
from typing import Any


class _Upstream(asyncio.DatagramProtocol):
    def __init__(self, relay: UdpHoldback) -> None:
        self.relay = relay

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.relay.from_server(data)


class UdpHoldback(asyncio.DatagramProtocol):
    def __init__(self, server_port: int, *, hold_after_reply: bool = False) -> None:
        self.server = ("127.0.0.1", server_port)
        self.hold_after_reply = hold_after_reply
        self.held: list[bytes] = []
        self.hold_down = False
        """Hold server → client datagrams (the client then acknowledges nothing)."""
        self.held_down: list[bytes] = []
        self.holding = asyncio.Event()
        """Set once a client datagram has been held back."""
        self.client: Any = None
        self.server_replied = False
        self.forwarded = 0
        self.bytes_up = 0
        """Client → server bytes forwarded."""
        self.bytes_down = 0
        """Server → client bytes forwarded."""
        self._down: asyncio.DatagramTransport | None = None
        self._up: asyncio.DatagramTransport | None = None

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self._down, _ = await loop.create_datagram_endpoint(
            lambda: self, local_addr=("127.0.0.1", 0)
        )
        self._up, _ = await loop.create_datagram_endpoint(
            lambda: _Upstream(self), remote_addr=self.server
        )
        return int(self._down.get_extra_info("sockname")[1])

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.client = addr
        if self.hold_after_reply and self.server_replied:
            self.held.append(data)
            self.holding.set()
            return
        assert self._up is not None
        self.forwarded += 1
        self.bytes_up += len(data)
        self._up.sendto(data)

    def from_server(self, data: bytes) -> None:
        self.server_replied = True
        if self.hold_down:
            self.held_down.append(data)
            return
        self.bytes_down += len(data)
        if self._down is not None and self.client is not None:
            self._down.sendto(data, self.client)

    async def rebind(self) -> None:
        """Send on from a new source port; the old mapping is gone."""
        old = self._up
        self._up, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Upstream(self), remote_addr=self.server
        )
        assert old is not None
        old.close()

    def release(self) -> None:
        """Stop holding and pass on everything held."""
        self.hold_after_reply = False
        assert self._up is not None
        for data in self.held:
            self.bytes_up += len(data)
            self._up.sendto(data)
        self.held.clear()

    def release_down(self) -> None:
        self.hold_down = False
        for data in self.held_down:
            self.from_server(data)
        self.held_down.clear()

    def close(self) -> None:
        for t in (self._down, self._up):
            if t is not None:
                t.close()
