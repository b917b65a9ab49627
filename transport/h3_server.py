"""The HTTP/3 listener: aioquic's QUIC endpoint, one thin asyncio protocol per connection.

Each datagram goes ``QuicConnection.receive_datagram`` → events → ``H3Session.handle`` →
actions, which this module executes: start an app task, feed its receive queue, deliver
``http.disconnect``. Every write (an ASGI ``send``, or the ``quicedge.body_writer`` scope
extension's, which needs no await) goes to the session and transmits at once, so each response
chunk leaves in its own flush. ``quicedge.on_disconnect`` calls back when a request is aborted.
Requests started on early data are aborted the same way if their handshake is not complete by
``H3Limits.early_data_handshake_deadline``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.quic.connection import NetworkAddress, QuicConnection
from aioquic.quic.events import HandshakeCompleted, QuicEvent
from aioquic.quic.packet import pull_quic_header
from aioquic.tls import SessionTicket

from transport import aioquic_patches  # noqa: F401  (before any connection: see the module)
from transport.aioquic_private import (
    has_connection,
    process_events,
    server_configuration,
    server_protocols,
    set_max_streams_bidi,
    set_retry_handler,
    set_server_configuration,
    unacked_bytes,
)
from transport.asgi import ASGIApp, Message
from transport.early_data import EarlyDataPolicy
from transport.h3_session import (
    Action,
    EarlyRequest,
    H3Limits,
    H3Session,
    RequestAborted,
    RequestBody,
    RequestRefused,
    StartRequest,
)
from transport.metrics import TransportMetrics
from transport.retry import SharedRetryTokenHandler
from transport.tickets import TicketStore, TicketStoreError
from transport.tls import TlsMaterial

log = logging.getLogger("quicedge.transport.h3")

_DISCONNECT: Message = {"type": "http.disconnect"}

# Per-stream send buffer bounds: a `send` returns only once the stream's unacknowledged bytes
# are under the high-water mark; it resumes when acknowledgements bring them under the low one.
SEND_HIGH_WATER = 1024 * 1024
SEND_LOW_WATER = 256 * 1024


class _StreamChannel:
    """One request's ASGI channel: a receive queue, the app task, and the response's writer
    (the ``quicedge.body_writer`` and ``quicedge.on_disconnect`` scope extensions)."""

    __slots__ = ("on_gone", "proto", "queue", "stream_id", "task")

    def __init__(self, proto: H3Protocol, stream_id: int) -> None:
        self.proto = proto
        self.stream_id = stream_id
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.on_gone: Callable[[], None] | None = None

    def write_head(self, start: Message, body: bytes = b"", more: bool = True) -> bool:
        """HEADERS and the first DATA in one flush; False when the stream's send buffer is over
        its high-water mark (await `drained`)."""
        session = self.proto.session
        session.send_start(self.stream_id, int(start["status"]), start.get("headers") or [])
        return self._send(body, more)

    def write_body(self, body: bytes, more: bool = True) -> bool:
        return self._send(body, more)

    def _send(self, body: bytes, more: bool) -> bool:
        proto = self.proto
        sent = proto.session.send_body(self.stream_id, body, more)
        proto.transmit_soon()
        return not (sent and more) or proto.writable(self.stream_id)

    async def drained(self) -> None:
        await self.proto.wait_writable(self.stream_id)

    def notify_disconnect(self, callback: Callable[[], None] | None) -> None:
        self.on_gone = callback

    def gone(self) -> None:
        """The request was aborted (reset, connection closed, body over the limit)."""
        self.queue.put_nowait(_DISCONNECT)
        callback, self.on_gone = self.on_gone, None
        if callback is not None:
            callback()


class H3Protocol(QuicConnectionProtocol):
    """One QUIC connection: feeds events to its ``H3Session`` and runs the app per request."""

    def __init__(
        self, quic: QuicConnection, stream_handler: Any = None, *, server: H3Server
    ) -> None:
        super().__init__(quic, stream_handler)
        limits = server.limits
        # aioquic has no public knob for MAX_STREAMS; set the initial credit before the
        # transport parameters are sent. Credit returns as streams finish, so this bounds
        # the number of concurrent request streams (RFC 9000 §4.6).
        set_max_streams_bidi(quic, limits.max_concurrent_streams)
        self._server = server
        self._session = H3Session(
            quic, policy=server.policy, limits=limits, server=server.address,
            on_overdue=self._run_actions,
        )  # fmt: skip
        self._channels: dict[int, _StreamChannel] = {}
        self._writable: dict[int, asyncio.Future[None]] = {}
        self._flush: asyncio.Handle | None = None
        self._flush_since = 0.0  # when the write the pending flush is for was made
        self._early: set[int] = set()  # started in 0-RTT, handshake not yet complete
        self._early_deadline: asyncio.TimerHandle | None = None
        # Our own references: aioquic's (`_quic`, `_loop`) are private.
        self._connection = quic
        self._event_loop = asyncio.get_running_loop()
        self._started_at = self._event_loop.time()

    @property
    def session(self) -> H3Session:
        return self._session

    @property
    def active(self) -> int:
        return len(self._channels) + self._session.open_requests

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self._server.handshake_completed(event, self._event_loop.time() - self._started_at)
            self._stop_early_watch()
        for action in self._session.handle(event, self._event_loop.time()):
            self._execute(action)
        if self._session.terminated:
            self._release_writers(everyone=True)
            self._stop_early_watch()

    def _run_actions(self, actions: list[Action]) -> None:
        """Actions the session took outside an event (a request's body deadline)."""
        for action in actions:
            self._execute(action)
        self.transmit()

    def transmit(self) -> None:
        if self._flush is not None:  # this one sends what it was scheduled for
            self._flush.cancel()
            self._flush = None
            self._flushed()
        super().transmit()
        if self._writable:
            self._release_writers()

    def transmit_soon(self) -> None:
        """Send what the streams have buffered: now if this connection carries one response,
        else once the callbacks that are ready now have run.

        Each transmit walks every stream of the connection (aioquic builds packets that way),
        and the acknowledgements of a busy connection arrive in bursts of datagrams. With many
        responses in flight on one connection, their chunks and the replies to those
        acknowledgements share one transmit per loop turn: with 32 streams, a transmit per
        chunk and per datagram kept the loop from reading its sockets for up to ~90 ms
        (docs/benchmarks.md, "Seventh pass"). A lone response has nothing to share a turn with,
        and its chunks leave at once."""
        if len(self._channels) <= 1:
            self.transmit()
            return
        if not self._flush_since:
            self._flush_since = time.perf_counter()
        if self._flush is None:
            self._flush = self._event_loop.call_soon(self._flush_now)

    def _reply_soon(self) -> None:
        """Send the reply to what arrived (acknowledgements, the handshake's next flight, data
        the peer's credit now lets through) once the callbacks that are ready now have run.

        A client's flight comes as several datagrams read in one loop turn, and an early
        request's app task is ready in the same turn: they share one transmit, and where they
        fit, datagrams (a transmit that finds nothing to send still walks every packet number
        space and stream)."""
        if self._flush is None:
            self._flush = self._event_loop.call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush = None
        self._flushed()
        self.transmit()

    def _flushed(self) -> None:
        """The wait a write had for its transmit (writes on a connection with several
        responses in flight; a reply to a datagram is not a write)."""
        if not self._flush_since:
            return
        metrics = self._server.metrics
        if metrics is not None:
            metrics.h3_flush_delay.observe(time.perf_counter() - self._flush_since)
        self._flush_since = 0.0

    def _send_written(self) -> None:
        """Send what is written and waiting for `transmit_soon` now: a stream reset takes the
        place of the stream's unsent data, and what the app wrote before it failed must go."""
        if self._flush is not None:
            self.transmit()

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        # As aioquic's, but the reply goes out with whatever else this turn writes.
        self._connection.receive_datagram(cast(bytes, data), addr, now=self._event_loop.time())
        process_events(self)
        self._reply_soon()

    def _unacked(self, stream_id: int) -> int:
        return unacked_bytes(self._connection, stream_id)

    def _release_writers(self, *, everyone: bool = False) -> None:
        for stream_id, waiter in list(self._writable.items()):
            if everyone or self._unacked(stream_id) <= SEND_LOW_WATER:
                del self._writable[stream_id]
                if not waiter.done():
                    waiter.set_result(None)

    def writable(self, stream_id: int) -> bool:
        return self._session.terminated or self._unacked(stream_id) <= SEND_HIGH_WATER

    async def wait_writable(self, stream_id: int) -> None:
        """Back-pressure: bound what one stream may have buffered (style: bound every buffer)."""
        if self.writable(stream_id):
            return
        waiter = self._writable.get(stream_id)
        if waiter is None:
            waiter = self._writable[stream_id] = self._event_loop.create_future()
        await waiter

    def _execute(self, action: Action) -> None:
        if isinstance(action, RequestBody):
            channel = self._channels.get(action.stream_id)
            if channel is not None:
                channel.queue.put_nowait(
                    {"type": "http.request", "body": action.body, "more_body": action.more_body}
                )
        elif isinstance(action, StartRequest):
            channel = _StreamChannel(self, action.stream_id)
            self._channels[action.stream_id] = channel
            extensions = action.scope["extensions"]
            extensions["quicedge.body_writer"] = channel
            extensions["quicedge.on_disconnect"] = channel.notify_disconnect
            channel.task = self._event_loop.create_task(
                self._run_app(action.stream_id, action.scope, channel)
            )
            if extensions["early_data"] and not self._session.handshake_complete:
                self._watch_early(action.stream_id)
        elif isinstance(action, RequestAborted):
            channel = self._channels.get(action.stream_id)
            if channel is not None:
                channel.gone()
            waiter = self._writable.pop(action.stream_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif isinstance(action, RequestRefused):
            self._server.request_refused(action)
        elif isinstance(action, EarlyRequest):
            self._server.early_request(action)

    def _watch_early(self, stream_id: int) -> None:
        """A request runs on early data: unless the handshake completes within the deadline,
        it is cancelled. A replayed first flight never completes one, nor does a client that
        vanished, and their generation would otherwise run until the idle timeout."""
        self._early.add(stream_id)
        if self._early_deadline is None:
            self._early_deadline = self._event_loop.call_later(
                self._server.limits.early_data_handshake_deadline, self._early_data_expired
            )

    def _stop_early_watch(self) -> None:
        self._early.clear()
        if self._early_deadline is not None:
            self._early_deadline.cancel()
            self._early_deadline = None

    def _early_data_expired(self) -> None:
        self._early_deadline = None
        if self._session.handshake_complete or self._session.terminated:
            return
        expired = [(sid, self._channels[sid]) for sid in self._early if sid in self._channels]
        self._early.clear()
        if not expired:
            return
        self._send_written()
        for stream_id, channel in expired:
            self._session.cancel(stream_id)
            # As for a client's reset: `http.disconnect`, and the `quicedge.on_disconnect`
            # callback, with which the proxy cancels its task and so the upstream request.
            channel.gone()
        self._server.early_data_expired(len(expired))
        self.transmit()

    async def _run_app(
        self, stream_id: int, scope: dict[str, Any], channel: _StreamChannel
    ) -> None:
        session = self._session

        async def receive() -> Message:
            if channel.queue.empty() and session.response_done(stream_id):
                return _DISCONNECT
            return await channel.queue.get()

        async def send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                channel.write_head(message)
            elif kind == "http.response.body":
                body = message.get("body", b"")
                if not channel.write_body(body, bool(message.get("more_body", False))):
                    await channel.drained()
            else:
                raise ValueError(f"unsupported ASGI message type {kind!r}")

        try:
            await self._server.app(scope, receive, send)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("ASGI app failed on %s %s", scope["method"], scope["path"])
        finally:
            self._channels.pop(stream_id, None)
            self._early.discard(stream_id)
            if not self._session.terminated:
                self._send_written()  # before a reset that would drop it
                if session.app_finished(stream_id):
                    self.transmit()

    def app_tasks(self) -> list[asyncio.Task[None]]:
        return [e.task for e in self._channels.values() if e.task is not None]

    def goaway(self) -> None:
        self._session.goaway()
        self.transmit()

    def cancel_all(self) -> None:
        self._send_written()
        for stream_id, channel in list(self._channels.items()):
            self._session.cancel(stream_id)
            if channel.task is not None:
                channel.task.cancel()
        self.transmit()


class _Endpoint(QuicServer):
    """aioquic's QuicServer that can stop admitting new connections and swap its config."""

    draining = False

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        if self.draining:
            try:
                header = pull_quic_header(
                    Buffer(data=data if isinstance(data, bytes) else data.encode()),
                    host_cid_length=server_configuration(self).connection_id_length,
                )
            except ValueError:
                return
            if not has_connection(self, header.destination_cid):
                return  # no new connections while draining
        super().datagram_received(data, addr)

    def protocols(self) -> list[H3Protocol]:
        unique = {id(p): p for p in server_protocols(self) if isinstance(p, H3Protocol)}
        return list(unique.values())


class H3Server:
    """An HTTP/3 listener serving one ASGI app."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tls: TlsMaterial,
        tickets: TicketStore | None,
        policy: EarlyDataPolicy | None = None,
        limits: H3Limits | None = None,
        retry_secret: bytes | None = None,
        metrics: TransportMetrics | None = None,
    ) -> None:
        self.app = app
        self.tls = tls
        self.tickets = tickets
        self.policy = policy or EarlyDataPolicy()
        self.limits = limits or H3Limits()
        self.retry_secret = retry_secret
        self.metrics = metrics
        self.address: tuple[str, int] | None = None
        self._endpoint: _Endpoint | None = None
        self._transport: asyncio.DatagramTransport | None = None

    def __repr__(self) -> str:
        conns = len(self._endpoint.protocols()) if self._endpoint else 0
        return f"<H3Server {self.address} connections={conns}>"

    @property
    def port(self) -> int:
        assert self.address is not None, "not started"
        return self.address[1]

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        if reuse_port:
            # Workers share the port; the kernel spreads clients by 4-tuple hash.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        configuration = self.tls.quic_configuration(idle_timeout=self.limits.idle_timeout)
        fetcher = self._take_ticket if self.tickets is not None else None
        handler = self._keep_ticket if self.tickets is not None else None
        transport, endpoint = await loop.create_datagram_endpoint(
            lambda: _Endpoint(
                configuration=configuration,
                create_protocol=partial(H3Protocol, server=self),
                session_ticket_fetcher=fetcher,
                session_ticket_handler=handler,
                retry=self.retry_secret is not None,
            ),
            sock=sock,
        )
        if self.retry_secret is not None:
            set_retry_handler(endpoint, SharedRetryTokenHandler(self.retry_secret))
        self._transport = transport
        self._endpoint = endpoint
        name = sock.getsockname()
        self.address = (str(name[0]), int(name[1]))
        self.tls.on_reload(self._reload)

    def _reload(self) -> None:
        if self._endpoint is not None:
            # New connections take the new certificate; live ones keep theirs.
            set_server_configuration(
                self._endpoint, self.tls.quic_configuration(idle_timeout=self.limits.idle_timeout)
            )

    # session tickets: called synchronously by aioquic's TLS engine

    def _take_ticket(self, ticket_id: bytes) -> SessionTicket | None:
        assert self.tickets is not None
        try:
            ticket = self.tickets.take(ticket_id)
        except TicketStoreError as exc:
            # Fail closed: no ticket, no resumption, no early data without replay protection.
            log.warning("resumption refused: %s", exc)
            if self.metrics is not None:
                self.metrics.ticket_store_errors.labels("take").inc()
                self.metrics.zero_rtt.labels("rejected").inc()
            return None
        if ticket is None and self.metrics is not None:
            self.metrics.zero_rtt.labels("replay_refused").inc()
        return ticket

    def _keep_ticket(self, ticket: SessionTicket) -> None:
        assert self.tickets is not None
        try:
            self.tickets.put(ticket)
        except TicketStoreError as exc:
            log.warning("session ticket not kept: %s", exc)
            if self.metrics is not None:
                self.metrics.ticket_store_errors.labels("put").inc()

    # metrics hooks

    def handshake_completed(self, event: HandshakeCompleted, seconds: float) -> None:
        if self.metrics is None:
            return
        self.metrics.handshake_seconds.observe(seconds)
        self.metrics.handshakes.labels("true" if event.session_resumed else "false").inc()
        if event.early_data_accepted:
            self.metrics.zero_rtt.labels("accepted").inc()

    def request_refused(self, action: RequestRefused) -> None:
        if self.metrics is not None:
            self.metrics.stream_errors.labels(str(action.status or "reset")).inc()
        log.debug("stream %d refused: %s", action.stream_id, action.reason)

    def early_data_expired(self, requests: int) -> None:
        log.debug("%d early-data request(s) cancelled: handshake past its deadline", requests)
        if self.metrics is not None:
            self.metrics.early_data_expired.inc(requests)

    def early_request(self, action: EarlyRequest) -> None:
        if self.metrics is not None:
            self.metrics.early_requests.labels(action.action.value).inc()

    # shutdown

    def connections(self) -> list[H3Protocol]:
        return self._endpoint.protocols() if self._endpoint is not None else []

    async def drain(self, timeout: float) -> None:
        """Stop admitting connections, GOAWAY all, wait up to ``timeout`` for open requests."""
        if self._endpoint is None:
            return
        self._endpoint.draining = True
        for protocol in self.connections():
            protocol.goaway()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            tasks = [t for p in self.connections() for t in p.app_tasks()]
            remaining = deadline - loop.time()
            if not tasks or remaining <= 0:
                break
            await asyncio.wait(tasks, timeout=remaining)
        for protocol in self.connections():
            protocol.cancel_all()

    async def aclose(self) -> None:
        if self._endpoint is None:
            return
        for protocol in self.connections():
            protocol.cancel_all()
        self._endpoint.close()  # CONNECTION_CLOSE to every client, then the socket
        self._endpoint = None
        await asyncio.sleep(0)
