"""Helpers for the app's end-to-end tests: the edge served by hypercorn over real sockets, in
front of real `SimServer`s or a tiny scripted HTTP/1.1 upstream that records what it received."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from edge.config import ProxyConfig
from edge.routing.breakers import BreakerConfig
from edge.wiring import Wiring, build
from tests.helpers import async_wait_for_tcp, free_port
from transport.h1_server import H1Listener


@contextlib.asynccontextmanager
async def hypercorn_app(
    app: Any, *, certfile: Path | None = None, keyfile: Path | None = None
) -> AsyncIterator[str]:
    """Serve an ASGI app on 127.0.0.1 (TLS with ALPN h2/http1.1 when certs are given)."""
    port = free_port()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 0.5
    if certfile is not None:
        config.certfile = str(certfile)
        config.keyfile = str(keyfile)
    stop = asyncio.Event()
    task = asyncio.ensure_future(serve(app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    try:
        await async_wait_for_tcp("127.0.0.1", port)
        yield f"{'https' if certfile else 'http'}://127.0.0.1:{port}"
    finally:
        stop.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


@contextlib.asynccontextmanager
async def h1_app(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app on our own plain HTTP/1.1 listener on 127.0.0.1."""
    listener = H1Listener(app, host="127.0.0.1", port=0)
    await listener.start()
    try:
        yield listener.url
    finally:
        await listener.stop()


LISTENERS = pytest.mark.parametrize("listener", ["hypercorn", "h1"])
"""Run a streaming test on both plain listeners: hypercorn (the relay sends ASGI messages) and
ours (the relay writes from the upstream read callback)."""


@dataclass
class Edge:
    url: str
    admin_url: str
    wiring: Wiring
    registry: CollectorRegistry
    spans: InMemorySpanExporter | None


def fast_config(backends: Sequence[str], **overrides: Any) -> ProxyConfig:
    """Defaults sized for tests: quick health checks, short timeouts, a small pool."""
    values: dict[str, Any] = {
        "backends": list(backends),
        "policy": "round_robin",
        "health_interval": 0.1,
        "health_timeout": 1.0,
        "health_failure_threshold": 2,
        "health_success_threshold": 1,
        "loads_interval": 0.2,
        "pool_warm_connections": 2,
        "first_byte_timeout": 10.0,
        "chunk_timeout": 10.0,
        "connect_timeout": 1.0,
        # Tests watch where requests went through the response header; off by default in serve.
        "expose_backend_names": True,
    }
    values.update(overrides)
    return ProxyConfig.from_mapping(values).validate()


@contextlib.asynccontextmanager
async def run_edge(
    config: ProxyConfig,
    *,
    trace: bool = False,
    certs: Any = None,
    start: bool = True,
    listener: str = "hypercorn",
    **build_options: Any,
) -> AsyncIterator[Edge]:
    """The app on hypercorn (TLS when `certs` are given), or on our own plain HTTP/1.1 listener
    (`listener="h1"`, what `quicedge serve --http` runs, where the relay writes through the
    listener's body writer). `build_options` go to `edge.wiring.build` (`prewarm=`, ...)."""
    registry = CollectorRegistry()
    exporter: InMemorySpanExporter | None = None
    tracer = None
    if trace:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("test")
    # The breakers open a domain on a slow TTFT p99, which a loaded test machine can reach:
    # only the tests that pass their own `breakers=` run with them.
    build_options.setdefault("breakers", BreakerConfig(enabled=False))
    wiring = await build(config, registry=registry, tracer=tracer, **build_options)
    if start:
        await wiring.start()
    try:
        tls = {"certfile": certs.cert, "keyfile": certs.key} if certs is not None else {}
        serving = h1_app(wiring.app) if listener == "h1" else hypercorn_app(wiring.app, **tls)
        async with serving as url, hypercorn_app(wiring.admin_app) as admin:
            yield Edge(url, admin, wiring, registry, exporter)
    finally:
        await wiring.aclose()


# -- a tiny scripted upstream ---------------------------------------------------------------


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Reply:
    """What the scripted upstream answers: status, headers, body chunks (with optional pauses)."""

    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    delay: float = 0.0
    """Pause before each chunk."""
    delays: Sequence[float] = ()
    """Pause before each chunk, chunk by chunk (in place of `delay` where given)."""
    die_after: int | None = None
    """Close the connection abruptly after this many chunks (mid-body death)."""
    chunked: bool = True
    hold: asyncio.Event | None = None
    """The last chunk waits for it: an answer held at all but its end."""


Script = Callable[[Recorded], Awaitable[Reply] | Reply]


class TinyUpstream:
    """An HTTP/1.1 server that records every request and answers as the script says."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[Recorded] = []
        self.body_bytes_sent: dict[str, int] = {}
        """Body bytes handed to the socket per path (each write waits for it to drain)."""
        self.replies_cut: list[str] = []
        """Paths whose reply the peer cut off (the connection closed while it was being sent)."""
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> TinyUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        replying: str | None = None
        try:
            while True:
                request: h11.Request | None = None
                body = b""
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await reader.read(65536)
                        conn.receive_data(data)
                        if not data and request is None:
                            return
                        continue
                    if isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    elif isinstance(event, h11.ConnectionClosed):
                        return
                assert request is not None
                recorded = Recorded(
                    request.method.decode(),
                    request.target.decode(),
                    {k.decode(): v.decode() for k, v in request.headers},
                    body,
                )
                self.requests.append(recorded)
                reply = self.script(recorded)
                if asyncio.iscoroutine(reply):
                    reply = await reply
                assert isinstance(reply, Reply)
                headers = list(reply.headers)
                if reply.chunked:
                    headers.append(("transfer-encoding", "chunked"))
                else:
                    headers.append(("content-length", str(sum(map(len, reply.chunks)))))
                replying = recorded.path
                writer.write(conn.send(h11.Response(status_code=reply.status, headers=headers)))
                await writer.drain()
                for i, chunk in enumerate(reply.chunks):
                    if reply.die_after is not None and i >= reply.die_after:
                        writer.transport.abort()
                        return
                    pause = reply.delays[i] if i < len(reply.delays) else reply.delay
                    if pause:
                        await asyncio.sleep(pause)
                    if reply.hold is not None and i == len(reply.chunks) - 1:
                        await reply.hold.wait()
                    writer.write(conn.send(h11.Data(data=chunk)))
                    await writer.drain()
                    sent = self.body_bytes_sent
                    sent[recorded.path] = sent.get(recorded.path, 0) + len(chunk)
                if reply.die_after is not None:
                    writer.transport.abort()
                    return
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                replying = None
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except ConnectionError:
            if replying is not None:
                self.replies_cut.append(replying)
        except (h11.ProtocolError, asyncio.CancelledError):
            return  # a cancelled handler at teardown is expected, not an error to log
        finally:
            writer.close()


def sse_reply(texts: Sequence[str], *, delay: float = 0.0, die_after: int | None = None) -> Reply:
    """A /v1/completions-style stream of the given token texts, then [DONE]."""
    chunks = [
        b"data: " + json.dumps({"choices": [{"index": 0, "text": t}]}).encode() + b"\n\n"
        for t in texts
    ]
    chunks.append(b"data: [DONE]\n\n")
    return Reply(
        headers=[("content-type", "text/event-stream")],
        chunks=chunks,
        delay=delay,
        die_after=die_after,
    )


def held_sse(release: asyncio.Event, texts: Sequence[str] = ("ok",)) -> Script:
    """A scripted upstream that is healthy and answers each inference request (`texts` as an SSE
    stream) only once `release` is set: requests that stay in flight."""

    async def held(recorded: Recorded) -> Reply:
        reply = health_ok(recorded)
        if reply is not None:
            return reply
        await release.wait()
        return sse_reply(texts)

    return held


def health_ok(recorded: Recorded) -> Reply | None:
    """Answers for the routes the registry polls, so a scripted upstream counts as healthy."""
    if recorded.path == "/health":
        return Reply(status=200, chunked=False)
    if recorded.path in ("/v1/loads", "/get_load"):
        rank = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
                "token_usage": 0.0, "max_total_num_tokens": 100000}  # fmt: skip
        return Reply(chunks=[json.dumps({"loads": [rank]}).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip
    if recorded.path == "/v1/models":
        models = {"object": "list", "data": [{"id": "tiny-model", "object": "model"}]}
        return Reply(chunks=[json.dumps(models).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip
    if recorded.path == "/get_model_info":  # the model catalog reads its weight_version
        info = {"model_path": "tiny-model", "weight_version": "default"}
        return Reply(chunks=[json.dumps(info).encode()], chunked=False,
                     headers=[("content-type", "application/json")])  # fmt: skip
    if recorded.path == "/abort_request":
        return Reply(status=200, chunked=False)
    return None


def client(edge: Edge, **kwargs: Any) -> httpx.AsyncClient:
    kwargs.setdefault("timeout", 20.0)
    return httpx.AsyncClient(base_url=edge.url, **kwargs)
