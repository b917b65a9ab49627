"""Connection migration on the QUIC listener over real sockets (RFC 9000 §9): a client whose
NAT rebinds mid-stream keeps its streams."""

from __future__ import annotations

import asyncio

from certs import DevCertificates
from tests.transport.apps import RecordingApp
from tests.transport.conftest import H3Factory
from tests.transport.h3client import h3_connect
from tests.transport.udp_holdback import UdpHoldback


async def test_a_nat_rebinding_mid_stream_keeps_the_stream(
    h3_server: H3Factory, dev_certs: DevCertificates
) -> None:
    app = RecordingApp()
    async with h3_server(app=app) as server:
        relay = UdpHoldback(server.port)
        port = await relay.start()
        try:
            async with h3_connect(port, dev_certs.ca_cert) as client:
                sid = client.request("GET", "/stream?n=3")
                client.send_now()
                await app.release.put(None)
                await asyncio.wait_for(client.responses[sid].arrivals.get(), 10)
                before = server.connections()[0].quic._network_paths[0].addr
                await relay.rebind()
                # Anything the client sends now comes from the new port.
                assert (await client.fetch("GET", "/echo", timeout=5)).status == 200
                for _ in range(2):
                    await app.release.put(None)
                r = await client.wait(sid, 5)
                after = server.connections()[0].quic._network_paths[0].addr
        finally:
            relay.close()
    assert r.body == b"0;1;2;" and r.reset_code is None
    assert before != after


class _Spoofer(asyncio.DatagramProtocol):
    """Where the server's answers to a forged source address land: counted, never answered."""

    def __init__(self) -> None:
        self.received = 0

    def datagram_received(self, data: bytes, addr: object) -> None:
        self.received += len(data)


class _Forging(UdpHoldback):
    """A relay whose next client datagram also reaches the server first from another address,
    as an attacker who copies a packet and forges its source would send it."""

    forge_next = False
    forged = 0
    spoof: asyncio.DatagramTransport | None = None

    def datagram_received(self, data: bytes, addr: object) -> None:
        if self.forge_next and self.spoof is not None:
            self.forge_next = False
            self.forged += len(data)
            self.spoof.sendto(data, self.server)
        super().datagram_received(data, addr)


async def test_a_packet_copied_from_another_address_does_not_take_the_connection(
    h3_server: H3Factory, dev_certs: DevCertificates
) -> None:
    """The copy arrives first, so the listener moves to its address, unvalidated: it sends
    there at most three times what came from it (RFC 9000 §9.3.1), and the connection comes
    back to its client's address and finishes the stream."""
    app = RecordingApp()
    loop = asyncio.get_running_loop()
    async with h3_server(app=app) as server:
        relay = _Forging(server.port)
        port = await relay.start()
        victim = _Spoofer()
        relay.spoof, _ = await loop.create_datagram_endpoint(
            lambda: victim, local_addr=("127.0.0.2", 0)
        )
        try:
            async with h3_connect(port, dev_certs.ca_cert) as client:
                sid = client.request("GET", "/stream?n=2")
                client.send_now()
                await app.release.put(None)
                await asyncio.wait_for(client.responses[sid].arrivals.get(), 10)
                relay.forge_next = True
                assert (await client.fetch("GET", "/echo", timeout=5)).status == 200
                await app.release.put(None)
                r = await client.wait(sid, 5)
                home = server.connections()[0].quic._network_paths[0].addr
        finally:
            relay.spoof.close()
            relay.close()
    assert relay.forged > 0
    assert r.body == b"0;1;" and r.reset_code is None
    assert home[0] == "127.0.0.1"
    assert victim.received <= 3 * relay.forged
