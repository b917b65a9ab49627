"""A non-streamed answer to a client that takes none of it, through the edge on our HTTP/1.1
listener: the answer stays counted in `max_pending_answer_bytes` while the listener holds it
for the client, not only while it arrives. It is written to the client in one send, which the
listener took whole into its transport and returned from at once; the edge then gave its
bytes back to the budget, and clients that never read could make it hold any number of such
answers (up to 64 MiB each) for `send_timeout` with the budget showing none.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from prometheus_client import CollectorRegistry

from edge.wiring import build
from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, health_ok
from tests.helpers import wait_until
from tests.transport.h3client import h3_connect
from tests.transport.test_slow_client_ends import withhold_credit
from transport.aioquic_private import unacked_bytes
from transport.h1_server import H1Listener
from transport.h3_server import H3Server
from transport.h3_session import H3Limits
from transport.tcp import TcpOptions
from transport.tickets import MemoryTicketStore
from transport.tls import CertificateFiles, TlsMaterial

TEXT = 4 * 1024 * 1024
ANSWER = json.dumps({
    "id": "cmpl-1", "object": "text_completion", "model": "default",
    "choices": [{"index": 0, "text": "x" * TEXT, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode()  # fmt: skip


def answer(recorded: Recorded) -> Reply:
    return health_ok(recorded) or Reply(
        headers=[("content-type", "application/json")], chunks=[ANSWER], chunked=False
    )


async def test_an_answer_the_client_has_not_taken_stays_counted() -> None:
    async with TinyUpstream(answer) as up:
        registry = CollectorRegistry()
        wiring = await build(fast_config([up.url]), registry=registry)
        await wiring.start()
        listener = H1Listener(wiring.app, host="127.0.0.1", port=0,
                              options=TcpOptions(send_timeout=30))  # fmt: skip
        await listener.start()

        def pending() -> float:
            return registry.get_sample_value("quicedge_pending_answer_bytes") or 0.0

        def unsent() -> int:
            return sum(c._transport.get_write_buffer_size() for c in listener.connections)  # type: ignore[union-attr]

        sock = socket.socket()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", listener.port))
            body = json.dumps({"prompt": "hi", "max_tokens": 16}).encode()
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(body), body)
            )  # and never reads
            await wait_until(lambda: unsent() > 1024 * 1024, timeout=10)
            assert pending() >= unsent()  # what waits for the client is still counted
        finally:
            sock.close()
        await wait_until(lambda: pending() == 0, timeout=10)  # given back once it has gone
        await listener.stop()
        await wiring.aclose()


async def test_an_answer_an_http3_client_has_not_taken_stays_counted(dev_certs: Any) -> None:
    """The same over HTTP/3, with a client that acknowledges what it gets but grants no more
    credit: the answer waits in the stream's send buffer, counted."""
    async with TinyUpstream(answer) as up:
        registry = CollectorRegistry()
        wiring = await build(fast_config([up.url]), registry=registry)
        await wiring.start()
        tls = TlsMaterial(CertificateFiles(dev_certs.cert, dev_certs.key))
        server = H3Server(wiring.app, tls=tls, tickets=MemoryTicketStore(),
                          limits=H3Limits(send_timeout=30))  # fmt: skip
        await server.start("127.0.0.1", 0)

        def pending() -> float:
            return registry.get_sample_value("quicedge_pending_answer_bytes") or 0.0

        try:
            async with h3_connect(server.port, dev_certs.ca_cert) as client:
                withhold_credit(client)
                body = json.dumps({"prompt": "hi", "max_tokens": 16}).encode()
                json_type = [(b"content-type", b"application/json")]
                stream_id = client.request("POST", "/v1/completions", body=body, headers=json_type)
                client.transmit()
                (connection,) = server.connections()
                await wait_until(
                    lambda: unacked_bytes(connection.quic, stream_id) > 1024 * 1024, timeout=10
                )
                assert pending() >= len(ANSWER)  # all of it, as none was acknowledged
            await wait_until(lambda: pending() == 0, timeout=10)  # the connection is gone
        finally:
            await server.aclose()
            await wiring.aclose()
