"""A request accepted in 0-RTT whose handshake never completes is cancelled at the deadline, and
the stand-in backend sees its generation aborted: a client sends its request in 0-RTT and then goes
silent (a relay drops everything it sends after the server's first reply)."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry

from backends.sim import SimConfig, SimServer
from edge.wiring import build
from tests.edge.conftest import fast_config
from tests.helpers import wait_until
from tests.transport.h3client import h3_connect
from tests.transport.udp_holdback import UdpHoldback
from transport.h3_server import H3Server
from transport.h3_session import H3Limits
from transport.metrics import TransportMetrics
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial

LONG = {
    "model": "default", "stream": True, "max_tokens": 5000, "ignore_eos": True,
    "messages": [{"role": "user", "content": "Say hello"}],
}  # fmt: skip


async def test_a_silent_zero_rtt_client_aborts_the_upstream_generation(dev_certs: Any) -> None:
    slow = SimConfig(name="s", port=0, profile="h100-llama3-8b", time_scale=1.0)
    async with SimServer(slow) as sim:
        wiring = await build(fast_config([sim.url]), registry=CollectorRegistry())
        await wiring.start()
        tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))
        metrics = TransportMetrics(CollectorRegistry())
        server = H3Server(
            wiring.app,
            tls=tls,
            tickets=MemoryTicketStore(),
            limits=H3Limits(early_data_handshake_deadline=1.0),
            metrics=metrics,
        )
        await server.start("127.0.0.1", 0)
        relay = UdpHoldback(server.port, hold_after_reply=True)
        try:
            tickets: list[Any] = []
            async with h3_connect(server.port, dev_certs.ca_cert, tickets=tickets) as first:
                await first.fetch("GET", "/v1/models")
                await wait_until(lambda: tickets)
            port = await relay.start()
            async with h3_connect(
                port, dev_certs.ca_cert, ticket=tickets[-1], wait_connected=False
            ) as client:
                client.request(
                    "POST", "/v1/chat/completions", body=json.dumps(LONG).encode(),
                    headers=[(b"content-type", b"application/json")],
                )  # fmt: skip
                client.send_now()
                # The generation starts on early data alone...
                await wait_until(lambda: sim.scheduler.num_running == 1)
                # ...and is aborted once the handshake is past its deadline.
                await wait_until(lambda: sim.scheduler.stats.num_aborted_requests_total == 1)
                await wait_until(lambda: sim.scheduler.num_running == 0)
                await wait_until(lambda: wiring.registry.backends[0].in_flight == 0)
                assert relay.holding.is_set()
                assert all(not p.session.handshake_complete for p in server.connections())
        finally:
            relay.close()
            await server.aclose()
            await wiring.aclose()
    assert metrics.early_data_expired._value.get() == 1
    assert metrics.early_requests.labels("accept")._value.get() == 1
    assert wiring.metrics.disconnects.labels().value == 1
