"""The TLS listener on hypercorn: HTTP/2 and HTTP/1.1 (ALPN ``h2``, ``http/1.1``) with Alt-Svc.

`TcpListener` binds its own socket (TCP_NODELAY, optional SO_REUSEPORT for workers) and hands it
to hypercorn as ``fd://N``, so the bound port is known even when asked for port 0. It shares
``TlsMaterial``'s one ``SSLContext``, so a SIGHUP reload reaches new handshakes. Every response
carries ``Alt-Svc`` naming the HTTP/3 port (``alt_svc_port``), which is how a client learns to
come back over QUIC. Without ``tls`` it serves plain HTTP through hypercorn (the tests use that);
``quicedge serve``'s plain-HTTP and admin listeners are ``h1_server.H1Listener`` instead.
Shutdown: hypercorn stops accepting, closes idle HTTP/2 connections with GOAWAY and lets open
requests finish for ``graceful_timeout`` seconds. A request's head deadline is hypercorn's idle
timer, its body deadline ``transport.deadlines``'s, and the connection caps
``transport.caps``'s (docs/transport.md, "Deadlines and caps"). HTTP/2 runs on
`transport.hypercorn_h2`'s protocol, which keeps a connection alive when the app answers before
reading a request's body; HTTP/1.1 on `transport.hypercorn_h11`'s, which refuses ambiguous
framing and never switches to h2c.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import sys
from collections.abc import Callable
from dataclasses import dataclass

from hypercorn.asyncio import serve
from hypercorn.config import Config

from transport import hypercorn_h2, hypercorn_h11
from transport.asgi import ASGIApp, Receive, Scope, Send, with_tcp_extensions
from transport.caps import GATE_ATTRIBUTE, ConnectionGate, gate_hypercorn
from transport.deadlines import with_body_deadline
from transport.hypercorn_send import SEND_TIMEOUT_ATTRIBUTE, SendTimeout
from transport.sockets import bind_naming
from transport.tls import TlsMaterial

ALT_SVC_MAX_AGE = 86400  # one day, as NGINX's documented example


def alt_svc_value(h3_port: int) -> str:
    """RFC 7838 / RFC 9114 §3.1.1: the same host serves HTTP/3 on ``h3_port``."""
    return f'h3=":{h3_port}"; ma={ALT_SVC_MAX_AGE}'


def tcp_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # Accepted sockets inherit TCP_NODELAY from the listener on Linux: no Nagle delay on
    # token-sized writes.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bind_naming(sock, host, port, "TCP")
    # Listen now: clients that connect before hypercorn's accept loop runs wait in the backlog.
    sock.listen(1024)
    return sock


def without_lifespan(app: ASGIApp) -> ASGIApp:
    """Answer ASGI lifespan events ourselves: our apps are started by ``transport.workers``."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await app(scope, receive, send)

    return wrapped


class _Config(Config):
    """hypercorn Config whose TLS context is the shared, reloadable one."""

    def __init__(self, context: ssl.SSLContext | None) -> None:
        super().__init__()
        self._context = context

    @property
    def ssl_enabled(self) -> bool:
        return self._context is not None

    def create_ssl_context(self) -> ssl.SSLContext | None:
        return self._context


@dataclass(frozen=True, slots=True)
class TcpOptions:
    graceful_timeout: float = 10.0
    """Seconds open requests may take to finish after shutdown begins."""
    keep_alive_timeout: float = 60.0
    """Idle keep-alive connections are closed after this long."""
    max_header_bytes: int = 16 * 1024
    """HTTP/1.1 request line + headers (h11 max incomplete event size)."""
    head_timeout: float = 10.0
    """A request head must arrive whole within this many seconds of its first byte (or, on
    hypercorn, of the connection going idle): else 408 and close."""
    body_timeout: float = 60.0
    """A request body must arrive whole within this many seconds of its head: else 408 (or a
    close, once the response began)."""
    send_timeout: float = 60.0
    """A response the client takes none of for this many seconds is cut off (a close; HTTP/2:
    the stream reset), and the app gets `http.disconnect`."""
    max_connections: int = 0
    """Open connections this listener keeps; one more is closed at once (0: no cap)."""
    max_requests: int = 0
    """Requests one connection serves before it retires (HTTP/1.1: `connection: close` on the
    last answer; HTTP/2: `transport.hypercorn_h2`). 0: no cap."""
    max_connections_per_client: int = 0
    """Open connections from one client IP address; one more is closed at once (0: no cap)."""
    new_connections_per_client: float = 0.0
    """New connections per second one client IP address may open; one more is closed at once
    (0: no limit)."""
    new_connection_burst: int = 1
    """New connections one client IP address may open at once, at `new_connections_per_client`."""

    def gate(self, on_refused: Callable[[str], None] | None = None) -> ConnectionGate:
        """This listener's connection gate, with these caps and rate."""
        return ConnectionGate(
            self.max_connections, self.max_connections_per_client, on_refused,
            rate=self.new_connections_per_client, burst=self.new_connection_burst,
        )  # fmt: skip


class TcpListener:
    """One hypercorn listener for one ASGI app: TLS (h2 + HTTP/1.1) when given ``tls``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str,
        port: int,
        tls: TlsMaterial | None = None,
        alt_svc_port: int | None = None,
        reuse_port: bool = False,
        options: TcpOptions | None = None,
        add_extensions: bool = True,
        on_refused: Callable[[str], None] | None = None,
        on_timeout: Callable[[str], None] | None = None,
        on_refused_request: Callable[[int], None] | None = None,
    ) -> None:
        hypercorn_h2.install()
        hypercorn_h11.install()
        options = options or TcpOptions()
        app = with_body_deadline(app, options.body_timeout, on_timeout)
        self._app = without_lifespan(with_tcp_extensions(app) if add_extensions else app)
        sock = tcp_socket(host, port, reuse_port=reuse_port)
        name = sock.getsockname()
        self.address = (str(name[0]), int(name[1]))
        # hypercorn takes over the descriptor (it wraps ``fd://N`` in its own socket object).
        self._fd: int | None = sock.detach()
        self.scheme = "https" if tls is not None else "http"
        config = _Config(tls.ssl_context() if tls is not None else None)
        config.bind = [f"fd://{self._fd}"]
        config.alt_svc_headers = [alt_svc_value(alt_svc_port)] if alt_svc_port else []
        config.include_server_header = False
        config.graceful_timeout = options.graceful_timeout
        # hypercorn's idle timer runs from a connection's start (or its last response) until a
        # whole request head is parsed, and data does not re-arm it: it is the head deadline
        # too. Its `read_timeout` bounds each read, which would also cut a long response the
        # client listens to in silence, so it stays off; the body deadline is
        # `transport.deadlines`'s, at the ASGI seam.
        config.keep_alive_timeout = min(options.keep_alive_timeout, options.head_timeout)
        # The TLS handshake comes before any of that and is the head's too: hypercorn's 60 s let
        # an idle TCP connection hold ~220 KB, uncapped (the caps count it once it is done).
        config.ssl_handshake_timeout = options.head_timeout
        config.h11_max_incomplete_size = options.max_header_bytes
        # hypercorn's own default is 1,000; 0 means none here.
        config.keep_alive_max_requests = options.max_requests or sys.maxsize
        gate_hypercorn()
        self.gate = options.gate(on_refused)
        setattr(config, GATE_ATTRIBUTE, self.gate)
        setattr(config, SEND_TIMEOUT_ATTRIBUTE, SendTimeout(options.send_timeout, on_timeout))
        setattr(config, hypercorn_h2.ON_SENT_AWAY_ATTRIBUTE, on_refused)
        setattr(config, hypercorn_h11.ON_REFUSED_REQUEST_ATTRIBUTE, on_refused_request)
        config.accesslog = None
        config.errorlog = "-"
        config.loglevel = "WARNING"
        self._config = config
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<TcpListener {self.url}>"

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address[0]}:{self.address[1]}"

    async def start(self) -> None:
        self._fd = None  # owned by hypercorn from here on
        self._task = asyncio.create_task(
            serve(self._app, self._config, shutdown_trigger=self._stopping.wait),  # type: ignore[arg-type]
            name=f"hypercorn {self.url}",
        )
        await asyncio.sleep(0)

    async def stop(self) -> None:
        """Stop accepting and drain (hypercorn's graceful shutdown)."""
        self._stopping.set()
        if self._task is not None:
            await self._task
            self._task = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def wait(self) -> None:
        if self._task is not None:
            await self._task
