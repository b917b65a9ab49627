"""A lean HTTP/1.1 ASGI server on an asyncio ``Protocol``: the plain-HTTP and admin listeners.

hypercorn costs ~45% of the edge's CPU per request on the plain listener (a task per request,
its keep-alive task restarted per request, a lock and a socket write per ASGI message). Here
httptools (llhttp, the C parser uvicorn uses) parses the requests: one parser per connection,
one ``feed_data`` per read, its callbacks building the scope. Parsing and dispatching a request
takes ~14 µs on the 2-core VM; h11 took ~100 µs (a fresh parser per request and its event
objects). The response is framed by hand and each ASGI message is at most one socket write. The
TLS listener stays on hypercorn: it needs h2 via ALPN.

The parts: ``h1_protocol.H1Protocol`` (one connection: parsing, pipelining, read pauses, the
idle timeout and the head and body deadlines), ``h1_cycle._Cycle`` (one request's ASGI channel
and response writer), and here ``H1Listener`` (the listening socket, connection caps, drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

from transport.asgi import ASGIApp
from transport.h1_protocol import BODY_BUFFER, H1Protocol
from transport.tcp import TcpOptions, tcp_socket

__all__ = ["BODY_BUFFER", "H1Listener", "H1Protocol"]


class H1Listener:
    """A plain-HTTP/1.1 listener for one ASGI app; the same surface as ``TcpListener``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str,
        port: int,
        reuse_port: bool = False,
        options: TcpOptions | None = None,
    ) -> None:
        self.app = app
        self.options = options or TcpOptions()
        self._sock: socket.socket | None = tcp_socket(host, port, reuse_port=reuse_port)
        name = self._sock.getsockname()
        self.address = (str(name[0]), int(name[1]))
        self.scheme = "http"
        self.connections: set[H1Protocol] = set()
        self.gate = self.options.gate()
        """Connection caps; its `on_refused` is called for each connection closed at once."""
        self.on_timeout: Callable[[str], None] | None = None
        """Called with `head`, `body` or `send` for each request cut off by its deadline."""
        self.on_refused_request: Callable[[int], None] | None = None
        """Called with the status of each request refused before the app saw it (not 408:
        `on_timeout`'s)."""
        o = self.options
        self.timer_period = (
            min(o.keep_alive_timeout, o.head_timeout, o.body_timeout, o.send_timeout) / 4
        )
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None
        self._stopped = asyncio.Event()
        self._empty: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"<H1Listener {self.url}>"

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address[0]}:{self.address[1]}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock, self._sock = self._sock, None
        assert sock is not None, "started twice"
        self._server = await loop.create_server(
            lambda: H1Protocol(self, loop), sock=sock, backlog=1024
        )

    def spawn(self, coro: Any, loop: asyncio.AbstractEventLoop) -> None:
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def timed_out(self, phase: str) -> None:
        if self.on_timeout is not None:
            self.on_timeout(phase)

    def refused_request(self, status: int) -> None:
        if self.on_refused_request is not None and status != 408:
            self.on_refused_request(status)

    def forget(self, conn: H1Protocol) -> None:
        if conn.admitted:
            conn.admitted = False
            self.gate.release(conn.host)
        self.connections.discard(conn)
        if not self.connections and self._empty is not None:
            self._empty.set()

    async def stop(self) -> None:
        """Stop accepting, close idle connections, let responses finish, then cut the rest."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._server is None:
            self._stopped.set()
            return
        server, self._server = self._server, None
        self.draining = True
        server.close()
        self._empty = asyncio.Event()
        for conn in list(self.connections):
            if conn.idle:
                conn.close()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._empty.wait(), self.options.graceful_timeout)
        for conn in list(self.connections):
            conn.abort()  # the apps get http.disconnect
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=1.0)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        await server.wait_closed()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()
