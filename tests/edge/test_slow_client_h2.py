"""The edge on its TLS listener in front of the stand-in, with an HTTP/2 client that opens
several streamed generations on one connection and never grants flow-control credit.

Each stream's answer must stop at the client's window and the stream buffer's mark, so that
the relay stops reading the backend; after the send timeout each stream is reset and the
stand-in sees each generation aborted.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h2.errors
import h2.events
from prometheus_client import CollectorRegistry

from backends.sim import SimConfig, SimServer
from edge.wiring import build
from tests.edge.conftest import fast_config
from tests.helpers import wait_until
from tests.transport.test_deadlines_and_caps import h2_client
from transport.tcp import TcpListener, TcpOptions
from transport.tls import CertificateFiles, TlsMaterial

STREAMS = 4
BODY = json.dumps({
    "model": "default", "stream": True, "max_tokens": 60_000, "ignore_eos": True,
    "messages": [{"role": "user", "content": "go on for ever"}],
}).encode()  # fmt: skip


async def test_streams_a_client_grants_no_credit_are_reset_and_their_generations_aborted(
    dev_certs: Any,
) -> None:
    async with SimServer(SimConfig(name="s", port=0, profile="instant")) as sim:
        wiring = await build(fast_config([sim.url]), registry=CollectorRegistry())
        await wiring.start()
        tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))
        timeouts: list[str] = []
        served = TcpListener(wiring.app, host="127.0.0.1", port=0, tls=tls,
                             options=TcpOptions(send_timeout=0.5),
                             on_timeout=timeouts.append)  # fmt: skip
        await served.start()
        conn, reader, writer = await h2_client(served.port, dev_certs.ca_cert)
        try:
            for _ in range(STREAMS):
                stream_id = conn.get_next_available_stream_id()
                conn.send_headers(stream_id, [
                    (":method", "POST"), (":scheme", "https"), (":authority", "localhost"),
                    (":path", "/v1/chat/completions"), ("content-type", "application/json"),
                    ("content-length", str(len(BODY))),
                ])  # fmt: skip
                conn.send_data(stream_id, BODY, end_stream=True)
            writer.write(conn.data_to_send())
            resets: dict[int, int] = {}
            received = 0
            async with asyncio.timeout(15):
                while len(resets) < STREAMS:
                    data = await reader.read(65536)
                    assert data, "the connection closed; only the streams should have"
                    for event in conn.receive_data(data):  # no acknowledge: no credit
                        if isinstance(event, h2.events.StreamReset):
                            resets[event.stream_id] = event.error_code
                        elif isinstance(event, h2.events.DataReceived):
                            received += len(event.data)
                    writer.write(conn.data_to_send())
            assert set(resets.values()) == {h2.errors.ErrorCodes.CANCEL}
            assert received <= 65535  # the connection's window, shared by the streams
            assert timeouts == ["send"] * STREAMS
            scheduler = sim.scheduler
            assert scheduler is not None
            backend = wiring.registry.backends[0]
            await wait_until(
                lambda: (
                    scheduler.stats.num_aborted_requests_total == STREAMS and backend.in_flight == 0
                ),
                timeout=10,
            )
        finally:
            writer.close()
            await served.stop()
            await wiring.aclose()
