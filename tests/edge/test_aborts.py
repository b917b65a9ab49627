"""Aborts of a backend's generation, against a real (scripted) upstream: the abort queue is
bounded (`/abort_request` calls past `max_pending_aborts` are dropped and counted), and a client
that stops reading gets its backend request aborted after the send timeout."""

from __future__ import annotations

import asyncio
import json
import socket

from prometheus_client import CollectorRegistry

from edge.wiring import build
from tests.edge.conftest import Recorded, Reply, TinyUpstream, fast_config, health_ok
from tests.helpers import wait_until
from transport.h1_server import H1Listener
from transport.tcp import TcpOptions


async def test_aborts_past_the_cap_are_dropped_and_counted() -> None:
    release = asyncio.Event()

    async def answer(recorded: Recorded) -> Reply:
        if recorded.path == "/abort_request":
            await release.wait()
            return Reply(status=200, chunked=False)
        return health_ok(recorded) or Reply(status=404, chunked=False)

    async with TinyUpstream(answer) as up:
        registry = CollectorRegistry()
        wiring = await build(fast_config([up.url], max_pending_aborts=2), registry=registry)
        try:
            backend = wiring.registry.backends[0]
            for i in range(5):
                wiring.abort(backend, f"rid-{i}")

            def count(outcome: str) -> float:
                value = registry.get_sample_value(
                    "quicedge_abort_requests_total", {"outcome": outcome}
                )
                return value or 0.0

            assert count("dropped") == 3
            # the two admitted reach the backend (its one client sends them in turn)
            await wait_until(lambda: any(r.path == "/abort_request" for r in up.requests))
            release.set()
            await wait_until(lambda: count("sent") == 2)
            assert (
                sorted(r.path for r in up.requests if r.path == "/abort_request")
                == ["/abort_request"] * 2
            )
            wiring.abort(backend, "rid-after")  # room again
            await wait_until(lambda: count("sent") == 3)
        finally:
            await wiring.aclose()


async def test_a_client_that_stops_reading_frees_its_backend_after_the_send_timeout() -> None:
    """A streamed answer to a client that reads none of it: after the listener's send timeout
    the edge aborts the backend's generation and frees the backend, as for a client that left."""
    aborted: list[str] = []

    def answer(recorded: Recorded) -> Reply:
        if recorded.path == "/abort_request":
            aborted.append(json.loads(recorded.body)["rid"])
            return Reply(status=200, chunked=False)
        token = b'data: {"choices": [{"index": 0, "text": "' + b"x" * 4000 + b'"}]}\n\n'
        return health_ok(recorded) or Reply(
            headers=[("content-type", "text/event-stream")], chunks=[token] * 20_000
        )

    async with TinyUpstream(answer) as up:
        wiring = await build(fast_config([up.url]), registry=CollectorRegistry())
        await wiring.start()
        listener = H1Listener(wiring.app, host="127.0.0.1", port=0,
                              options=TcpOptions(send_timeout=0.5))  # fmt: skip
        await listener.start()
        sock = socket.socket()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", listener.port))
            body = json.dumps({"prompt": "hi", "stream": True}).encode()
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(body), body)
            )  # and never reads
            backend = wiring.registry.backends[0]
            await wait_until(lambda: backend.in_flight == 1)
            await wait_until(lambda: bool(aborted) and backend.in_flight == 0, timeout=10)
            (sent,) = [r for r in up.requests if r.path == "/v1/completions"]
            assert aborted == [json.loads(sent.body)["rid"]]
        finally:
            sock.close()
            await listener.stop()
            await wiring.aclose()


async def test_a_backend_that_left_does_not_keep_its_abort_client() -> None:
    """Each backend's abort client holds a connection to it: one for every pod address a
    fleet ever had would pile up. A backend that left has its client closed when the next
    backend's is made."""
    async with (
        TinyUpstream(health_ok) as a,
        TinyUpstream(health_ok) as b,
        TinyUpstream(health_ok) as c,
    ):
        wiring = await build(fast_config([a.url, b.url]), registry=CollectorRegistry())
        try:
            for backend in wiring.registry.backends:
                wiring.abort(backend, "rid")
            await wait_until(lambda: len([r for u in (a, b) for r in u.requests
                                          if r.path == "/abort_request"]) == 2)  # fmt: skip
            await wiring.set_backends([b.url, c.url], drain_timeout=0.0)
            await wait_until(lambda: [x.url for x in wiring.registry.backends] == [b.url, c.url])
            wiring.abort(wiring.registry.backends[1], "rid")
            await wait_until(lambda: any(r.path == "/abort_request" for r in c.requests))
            assert sorted(wiring._clients) == sorted([b.url, c.url])
        finally:
            await wiring.aclose()
