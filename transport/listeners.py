"""The listeners one worker runs: HTTP/3, HTTP/2 + HTTP/1.1 over TLS, plain HTTP/1.1, admin.

`Listeners` binds and starts them from a `TransportConfig`, says where they are (the lines
`serve` prints), drains them on shutdown (GOAWAY on HTTP/3 and HTTP/2, open requests get
`drain_timeout` seconds) and closes whatever is left, even after a failed start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from functools import partial

from transport.asgi import ASGIApp
from transport.config import TransportConfig, format_address
from transport.h1_server import H1Listener
from transport.h3_server import H3Server
from transport.metrics import TransportMetrics
from transport.qlog import QlogWriter, check_directory
from transport.stateless_reset import StatelessResets, instance_label
from transport.steering import WorkerConnectionIds
from transport.tcp import TcpListener, TcpOptions
from transport.tickets import MemoryTicketStore, RedisTicketStore, TicketStore
from transport.tls import TlsMaterial

log = logging.getLogger("quicedge.serve")


def ticket_store(config: TransportConfig) -> TicketStore:
    """Redis when configured (shared by every worker and machine), else this process's memory."""
    if not config.redis:
        return MemoryTicketStore(max_ttl=config.ticket_ttl)
    secret = config.ticket_secret.encode() if config.ticket_secret else None
    return RedisTicketStore(
        config.redis, timeout=config.redis_timeout, secret=secret, max_ttl=config.ticket_ttl
    )


class Listeners:
    """Every listener of one worker, started and stopped together."""

    def __init__(
        self,
        config: TransportConfig,
        *,
        app: ASGIApp,
        admin_app: ASGIApp,
        tls: TlsMaterial,
        tickets: TicketStore,
        metrics: TransportMetrics,
        reuse_port: bool,
        worker: int = 0,
        h3_socket: socket.socket | None = None,
    ) -> None:
        self._config = config
        self._app = app
        self._admin_app = admin_app
        self._tls = tls
        self._reuse_port = reuse_port
        self._h3_socket = h3_socket
        self._metrics = metrics
        secret = config.quic_retry_secret.encode() if config.quic_retry_secret else None
        resets = (
            StatelessResets(secret, instance=instance_label(worker))
            if config.quic_stateless_reset
            else None
        )
        if secret is None:
            secret = os.urandom(32)  # one process: a random key is as good as a shared one
        self.qlog = (
            QlogWriter(check_directory(config.qlog_dir), outcome=self._count_trace)
            if config.qlog_dir is not None
            else None
        )
        self.h3 = H3Server(
            app,
            tls=tls,
            tickets=tickets,
            policy=config.early_data,
            limits=config.limits,
            retry_secret=secret if config.quic_retry else None,
            token_secret=secret,
            address_tokens=config.quic_address_tokens,
            stateless_resets=resets,
            qlog=self.qlog,
            connection_ids=WorkerConnectionIds(worker, config.workers) if h3_socket else None,
            metrics=metrics,
            max_connections=config.max_connections,
            max_connections_per_client=config.max_connections_per_client,
            new_connections_per_client=config.new_connections_per_client,
            new_connection_burst=config.new_connection_burst,
        )
        self.h3.gate.on_refused = partial(self._refused, "h3")
        self._proxies: list[TcpListener | H1Listener] = []
        self._admin: H1Listener | None = None

    async def start(self) -> list[str]:
        """Bind and start every listener; the lines that say where each one is."""
        t = self._config
        await self.h3.start(*t.h3, reuse_port=self._reuse_port, sock=self._h3_socket)
        options = TcpOptions(
            graceful_timeout=t.drain_timeout,
            head_timeout=t.limits.request_head_timeout,
            body_timeout=t.limits.request_body_timeout,
            send_timeout=t.limits.send_timeout,
            max_connections=t.max_connections,
            max_connections_per_client=t.max_connections_per_client,
            new_connections_per_client=t.new_connections_per_client,
            new_connection_burst=t.new_connection_burst,
            max_requests=t.max_requests_per_connection,
        )
        lines = [f"h3     https://{format_address(self.h3.address or t.h3)} (QUIC, UDP)"]
        if t.tcp is not None:
            self._proxies.append(
                TcpListener(
                    self._app, host=t.tcp[0], port=t.tcp[1], tls=self._tls,
                    alt_svc_port=self.h3.port, reuse_port=self._reuse_port, options=options,
                    on_refused=partial(self._refused, "tcp"),
                    on_timeout=partial(self._timed_out, "tcp"),
                    on_refused_request=partial(self._refused_request, "tcp"),
                )
            )  # fmt: skip
            alt_svc = f"alt-svc h3 :{self.h3.port}"
            lines.append(f"tcp    {self._proxies[-1].url} (h2, http/1.1; {alt_svc})")
        if t.http is not None:
            self._proxies.append(self._watched(
                H1Listener(
                    self._app, host=t.http[0], port=t.http[1], reuse_port=self._reuse_port,
                    options=options,
                ), "http",
            ))  # fmt: skip
            lines.append(f"http   {self._proxies[-1].url} (plain HTTP/1.1)")
        if t.admin is not None:
            self._admin = self._watched(
                H1Listener(
                    self._admin_app, host=t.admin[0], port=t.admin[1],
                    reuse_port=self._reuse_port, options=options,
                ), "admin",
            )  # fmt: skip
            lines.append(f"admin  {self._admin.url} (/health /ready /metrics)")
        for listener in [*self._proxies, *([self._admin] if self._admin else [])]:
            await listener.start()
        return lines

    def _watched(self, listener: H1Listener, name: str) -> H1Listener:
        listener.gate.on_refused = partial(self._refused, name)
        listener.on_timeout = partial(self._timed_out, name)
        listener.on_refused_request = partial(self._refused_request, name)
        return listener

    def _refused(self, listener: str, reason: str) -> None:
        self._metrics.connections_refused.labels(listener, reason).inc()

    def _count_trace(self, outcome: str) -> None:
        self._metrics.qlog_traces.labels(outcome).inc()

    def _timed_out(self, listener: str, phase: str) -> None:
        self._metrics.request_timeouts.labels(listener, phase).inc()

    def _refused_request(self, listener: str, status: int) -> None:
        self._metrics.requests_refused.labels(listener, str(status)).inc()

    async def drain(self) -> None:
        """Stop accepting; let open requests finish for up to `drain_timeout` seconds. The admin
        listener stops last, so health checks see the drain to its end."""
        timeout = self._config.drain_timeout
        log.info("draining for up to %.1fs", timeout)
        await asyncio.gather(self.h3.drain(timeout), *(lst.stop() for lst in self._proxies))
        if self._admin is not None:
            await self._admin.stop()

    async def aclose(self) -> None:
        """Close whatever is still open (after a drain, or a start that failed half-way)."""
        await self.h3.aclose()
        if self.qlog is not None:
            self.qlog.close()
        for listener in [*self._proxies, *([self._admin] if self._admin else [])]:
            with contextlib.suppress(Exception):
                await listener.stop()


__all__ = ["Listeners", "ticket_store"]
