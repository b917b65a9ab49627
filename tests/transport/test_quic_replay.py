"""A captured 0-RTT first flight replayed, over real sockets: to the listener that served it
and to another one sharing the Redis ticket store (another worker or edge), it runs nothing."""

from __future__ import annotations

import asyncio
import socket
from functools import partial
from typing import Any

from tests.helpers import wait_until
from tests.transport.apps import RecordingApp
from tests.transport.conftest import H3Factory
from tests.transport.h3client import fresh_ticket, h3_connect
from tests.transport.udp_holdback import UdpHoldback
from transport.h3_server import H3Server
from transport.tickets import RedisTicketStore

INFERENCE = "/v1/chat/completions"  # `accept` by default: served in 0-RTT


class _Recording(UdpHoldback):
    """A relay that keeps a copy of the client's first flight (what it sends before the
    server's first reply: Initial and 0-RTT)."""

    def __init__(self, server_port: int) -> None:
        super().__init__(server_port)
        self.first_flight: list[bytes] = []

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if not self.server_replied:
            self.first_flight.append(data)
        super().datagram_received(data, addr)


def _zero_rtt(server: H3Server, result: str) -> float:
    assert server.metrics is not None
    return float(server.metrics.zero_rtt.labels(result)._value.get())


def _zero_rtt_is(server: H3Server, result: str, count: float) -> bool:
    return _zero_rtt(server, result) == count


def _replay(port: int, datagrams: list[bytes]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for datagram in datagrams:
            sock.sendto(datagram, ("127.0.0.1", port))


async def test_a_replayed_first_flight_runs_nothing_on_any_listener(
    h3_server: H3Factory, dev_certs: Any, redis_url: str, redis_prefix: str
) -> None:
    stores = [RedisTicketStore(redis_url, prefix=redis_prefix, timeout=1.0) for _ in range(2)]
    first, other = RecordingApp(), RecordingApp()
    try:
        async with (
            h3_server(app=first, tickets=stores[0]) as a,
            h3_server(app=other, tickets=stores[1]) as b,
        ):
            ticket = await fresh_ticket(a.port, dev_certs.ca_cert)
            relay = _Recording(a.port)
            port = await relay.start()
            try:
                async with h3_connect(
                    port, dev_certs.ca_cert, ticket=ticket, wait_connected=False
                ) as client:
                    sid = client.request("POST", INFERENCE, body=b"{}")
                    client.send_now()
                    r = await client.wait(sid)
                    await asyncio.wait_for(client.handshake_done.wait(), 10)
                    assert client.handshake is not None and client.handshake.early_data_accepted
            finally:
                relay.close()
            assert r.status == 200 and len(first.seen) == 2  # fresh_ticket's, then this one
            assert any(len(d) >= 1200 for d in relay.first_flight)
            await wait_until(lambda: not a.connections())
            for server in (b, a):
                _replay(server.port, relay.first_flight)
                # The Initial makes a connection, whose TLS engine asks for the ticket.
                await wait_until(partial(_zero_rtt_is, server, "replay_refused", 1))
            await asyncio.sleep(0.3)  # what the 0-RTT packets would start, they start at once
            assert len(first.seen) == 2 and not other.seen
            assert _zero_rtt(a, "accepted") == 1 and _zero_rtt(b, "accepted") == 0
    finally:
        for store in stores:
            store.close()
