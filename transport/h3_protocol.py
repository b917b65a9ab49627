"""One QUIC connection's asyncio protocol for ``h3_server.H3Server``.

Each datagram goes ``QuicConnection.receive_datagram`` → events → ``H3Session.handle`` →
actions, which `H3Protocol` executes: start an app task, feed its receive queue, deliver
``http.disconnect``. Every write (an ASGI ``send``, or the ``quicedge.body_writer`` scope
extension's, which needs no await) goes to the session and transmits at once, so each response
chunk leaves in its own flush; with several responses in flight, once per loop turn. A stream's
writer waits while its unacknowledged bytes are over `SEND_HIGH_WATER`.
``quicedge.on_disconnect`` calls back when a request is aborted. Requests started on early data
are aborted the same way if their handshake is not complete by
``H3Limits.early_data_handshake_deadline``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic.connection import NetworkAddress, QuicConnection, QuicErrorCode
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)
from aioquic.quic.packet import QuicFrameType

from transport import aioquic_patches
from transport.aioquic_private import (
    process_events,
    route_connection_id,
    set_active_connection_id_limit,
    set_initial_congestion_window,
    set_max_streams_bidi,
    unacked_bytes,
)
from transport.asgi import Message
from transport.h3_session import (
    Action,
    EarlyRequest,
    H3Session,
    RequestAborted,
    RequestBody,
    RequestRefused,
    SentAway,
    StartRequest,
)

if TYPE_CHECKING:
    from transport.h3_server import H3Server

log = logging.getLogger("quicedge.transport.h3")

_DISCONNECT: Message = {"type": "http.disconnect"}

# Per-stream send buffer bounds: a `send` returns only once the stream's unacknowledged bytes
# are under the high-water mark; it resumes when acknowledgements bring them under the low one.
SEND_HIGH_WATER = 1024 * 1024
SEND_LOW_WATER = 256 * 1024

HANDSHAKE_TIMEOUT = "handshake_timeout"
"""The reason a connection closed for a handshake past its deadline is counted under."""


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
        if sent and not more:
            proto.watch_end(self.stream_id)  # the end's write does not wait: it is timed apart
            return True
        return not sent or proto.writable(self.stream_id)

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


def _route(protocol: weakref.ref[QuicConnectionProtocol], connection_id: bytes) -> None:
    """Route a connection ID the connection just made to it, while it is alive."""
    alive = protocol()
    if alive is not None:
        route_connection_id(alive, connection_id)


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
        set_active_connection_id_limit(quic, limits.active_connection_ids)
        set_initial_congestion_window(quic, limits.initial_congestion_window)
        if server.connection_ids is not None:  # before the server routes the first one
            aioquic_patches.make_connection_ids(quic, server.connection_ids.new)
        if server.stateless_resets is not None:  # before the transport parameters are written
            # A weak reference: the patches hold this per connection for as long as the
            # connection lives, and a strong one to the protocol would keep both forever.
            aioquic_patches.derive_reset_tokens(
                quic, server.stateless_resets.token, partial(_route, weakref.ref(self))
            )
        self._server = server
        self._session = H3Session(
            quic, policy=server.policy, limits=limits, server=server.address,
            on_overdue=self._run_actions,
        )  # fmt: skip
        self._channels: dict[int, _StreamChannel] = {}
        # The receive windows grow with the body bytes the app has read, not those queued.
        self._unread = aioquic_patches.track_unread(quic)
        self._writable: dict[int, asyncio.Future[None]] = {}
        # Streams whose response ended with bytes unacknowledged: (bytes at the last progress,
        # when), looked at every quarter of `send_timeout` while there are any.
        self._ends: dict[int, tuple[int, float]] = {}
        self._ends_timer: asyncio.TimerHandle | None = None
        self._flush: asyncio.Handle | None = None
        self._flush_since = 0.0  # when the write the pending flush is for was made
        self._early: set[int] = set()  # started in 0-RTT, handshake not yet complete
        self._early_deadline: asyncio.TimerHandle | None = None
        # Our own references: aioquic's (`_quic`, `_loop`) are private.
        self._connection = quic
        self._event_loop = asyncio.get_running_loop()
        self._started_at = self._event_loop.time()
        # A client that never completes its handshake would otherwise hold the connection, and
        # the requests deferred on it, for as long as it sends anything (a PING resets the idle
        # timer).
        self._handshake_deadline: asyncio.TimerHandle | None = self._event_loop.call_later(
            limits.handshake_timeout, self._handshake_overdue
        )
        self.on_closed: Callable[[], None] | None = None
        """Called once, when the connection has ended (the listener's gate forgets it)."""

    @property
    def quic(self) -> QuicConnection:
        """The connection's QUIC state (aioquic's own)."""
        return self._connection

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
            self._stop_handshake_deadline()
        elif isinstance(event, ConnectionTerminated) and self.on_closed is not None:
            on_closed, self.on_closed = self.on_closed, None
            on_closed()
        elif self._ends and isinstance(event, StopSendingReceived | StreamReset):
            self._ends.pop(event.stream_id, None)  # the client ended it: nothing left to time
        for action in self._session.handle(event, self._event_loop.time()):
            self._execute(action)
        if self._session.terminated:
            self._release_writers(everyone=True)
            self._stop_early_watch()
            self._stop_handshake_deadline()
            self._stop_ends_watch()

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
        """Back-pressure: bound what one stream may have buffered (style: bound every buffer),
        and how long it may wait for the client to take some (`send_timeout`)."""
        if self.writable(stream_id):
            return
        waiter = self._writable.get(stream_id)
        if waiter is None:
            waiter = self._writable[stream_id] = self._event_loop.create_future()
        try:
            async with asyncio.timeout(self._server.limits.send_timeout):
                await waiter
        except TimeoutError:
            self._stalled(stream_id)

    def _stalled(self, stream_id: int) -> None:
        """The client took none of this stream's response within `send_timeout`: reset it,
        and the app learns it as the client's going."""
        metrics = self._server.metrics
        if metrics is not None:
            metrics.request_timeouts.labels("h3", "send").inc()
        self._writable.pop(stream_id, None)
        if self._session.response_done(stream_id):  # its last send waited
            self._ends.pop(stream_id, None)
            self._session.abandon(stream_id)
        else:
            self._session.cancel(stream_id)
        channel = self._channels.get(stream_id)
        if channel is not None:
            channel.gone()
        self.transmit()

    def watch_end(self, stream_id: int) -> None:
        """The stream's response has ended: its last write waited for nothing, so the client
        must take the rest within `send_timeout` of each step forward, else the stream is
        reset. aioquic holds what is unacknowledged (and the stream, under the connection's
        MAX_STREAMS) until the client takes it: a client that granted no credit kept a whole
        answer, of any size, for as long as it kept the connection."""
        self._ends[stream_id] = (-1, 0.0)
        if self._ends_timer is None:
            self._ends_timer = self._event_loop.call_later(
                self._server.limits.send_timeout / 4, self._check_ends
            )

    def _check_ends(self) -> None:
        self._ends_timer = None
        if self._session.terminated:
            self._ends.clear()
            return
        now = self._event_loop.time()
        limit = self._server.limits.send_timeout
        stalled = []
        for stream_id, (last, since) in list(self._ends.items()):
            left = self._unacked(stream_id)  # 0 once acknowledged whole: the stream is gone
            if not left:
                del self._ends[stream_id]
            elif last < 0 or left < last:
                self._ends[stream_id] = (left, now)
            elif now - since >= limit:
                del self._ends[stream_id]
                stalled.append(stream_id)
        for stream_id in stalled:
            self._session.abandon(stream_id)
        if stalled:
            metrics = self._server.metrics
            if metrics is not None:
                metrics.request_timeouts.labels("h3", "send").inc(len(stalled))
            self.transmit()
        if self._ends:
            self._ends_timer = self._event_loop.call_later(limit / 4, self._check_ends)

    def _stop_ends_watch(self) -> None:
        self._ends.clear()
        if self._ends_timer is not None:
            self._ends_timer.cancel()
            self._ends_timer = None

    def _execute(self, action: Action) -> None:
        if isinstance(action, RequestBody):
            channel = self._channels.get(action.stream_id)
            if channel is not None:
                if action.body:
                    self._unread.delivered(action.stream_id, len(action.body))
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
        elif isinstance(action, SentAway):
            self._server.sent_away(action.reason)

    def _watch_early(self, stream_id: int) -> None:
        """A request runs on early data: unless the handshake completes within the deadline,
        it is cancelled. A replayed first flight never completes one, nor does a client that
        vanished, and their generation would otherwise run until the idle timeout."""
        self._early.add(stream_id)
        if self._early_deadline is None:
            self._early_deadline = self._event_loop.call_later(
                self._server.limits.early_data_handshake_deadline, self._early_data_expired
            )

    def _stop_handshake_deadline(self) -> None:
        if self._handshake_deadline is not None:
            self._handshake_deadline.cancel()
            self._handshake_deadline = None

    def _handshake_overdue(self) -> None:
        """The handshake is not complete `handshake_timeout` after the first datagram: the
        connection is closed (CONNECTION_REFUSED: it was never accepted), and so its requests
        deferred for the handshake go too; those running on early data heard `http.disconnect`
        at `early_data_handshake_deadline` already."""
        self._handshake_deadline = None
        if self._session.handshake_complete or self._session.terminated:
            return
        metrics = self._server.metrics
        if metrics is not None:
            metrics.connections_refused.labels("h3", HANDSHAKE_TIMEOUT).inc()
        self._connection.close(
            error_code=QuicErrorCode.CONNECTION_REFUSED,
            frame_type=QuicFrameType.PADDING,  # a transport close: no frame caused it
            reason_phrase="handshake not completed in time",
        )
        self.transmit()

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

        unread = self._unread

        async def receive() -> Message:
            if channel.queue.empty() and session.response_done(stream_id):
                return _DISCONNECT
            message = await channel.queue.get()
            body = message.get("body")
            if body and unread.read(stream_id, len(body)):
                self.transmit_soon()  # a window held back for these bytes grows
            return message

        async def send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                channel.write_head(message)
            elif kind == "http.response.body":
                body = message.get("body", b"")
                more = bool(message.get("more_body", False))
                if not channel.write_body(body, more) or (
                    not more and not self.writable(stream_id)
                ):
                    # The last one too: what the client has not taken stays the app's to
                    # account for (a non-streamed answer is counted in the edge's budget until
                    # `send` returns).
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
            held_back = unread.forget(stream_id)
            if not self._session.terminated:
                self._send_written()  # before a reset that would drop it
                if session.app_finished(stream_id) or held_back:
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
