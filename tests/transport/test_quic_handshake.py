"""A QUIC handshake that never completes is not held past `handshake_timeout`, nor are the
requests deferred for it: a real aioquic client that never sends its Finished, against the real
listener."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aioquic.quic.connection import QuicErrorCode
from prometheus_client import CollectorRegistry

from tests.transport.apps import RecordingApp
from tests.transport.conftest import H3Factory
from tests.transport.h3client import fresh_ticket, h3_connect
from transport.metrics import TransportMetrics


async def test_a_handshake_never_completed_is_closed_with_its_deferred_request(
    h3_server: H3Factory, dev_certs: Any
) -> None:
    """The client sends a request in 0-RTT on a route the policy defers, then never finishes
    its handshake and probes now and then: the listener held the connection and the request
    for as long as the client sent anything, past the idle timeout too."""
    registry = CollectorRegistry()
    app = RecordingApp()
    async with h3_server(app=app, metrics=TransportMetrics(registry)) as server:
        ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        app.seen.clear()
        # Short for the connection that never completes (this one took the usual 10 s).
        server.limits = dataclasses.replace(server.limits, handshake_timeout=0.3)
        async with h3_connect(
            server.port, dev_certs.ca_cert, ticket=ticket, wait_connected=False
        ) as c:
            # The client's TLS never reads the server's Finished, so it sends none of its own.
            c.quic.tls._client_handle_finished = lambda *_: None  # type: ignore[method-assign]
            deferred = c.request("POST", "/echo", body=b"held")  # not an inference route
            c.send_now()
            async with asyncio.timeout(10):
                while c.quic._close_event is None:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            assert c.quic._close_event.error_code == QuicErrorCode.CONNECTION_REFUSED
            assert c.quic._close_event.reason_phrase == "handshake not completed in time"
            assert c.responses[deferred].status is None
    assert app.seen == []  # the deferred request never reached the app
    refused = registry.get_sample_value(
        "quicedge_connections_refused_total", {"listener": "h3", "reason": "handshake_timeout"}
    )
    assert refused == 1
