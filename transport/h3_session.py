"""HTTP/3 → ASGI for one QUIC connection, without I/O: QUIC events in, request actions out.

``H3Session.handle(event, now)`` turns aioquic events into ``StartRequest`` / ``RequestBody`` /
``RequestAborted`` actions for the asyncio layer, which runs the app. Responses go back through
``send_start`` / ``send_body``; the caller transmits after each (one flush per ASGI ``send``).

Theory of operation for early data: aioquic has no per-frame 0-RTT flag, but a request whose
HEADERS arrive before ``HandshakeCompleted`` can only have come in 0-RTT packets (the client's
Finished precedes its 1-RTT data). Such requests meet the early-data policy: ``accept`` starts
the app at once with ``early_data`` True; ``defer`` holds the request (and its body) until the
handshake completes; ``reject`` answers 425 (RFC 8470 §5.2) without the app. A rare 1-RTT
request reordered ahead of the Finished is treated as early: the safe side.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

from aioquic.h3.connection import ErrorCode
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)

from transport.caps import CONTROL_FLOOD, RAPID_RESET, resets_most
from transport.early_data import EarlyDataPolicy, Mode
from transport.h3_connection import StreamConfinedH3Connection

KiB = 1024
MiB = 1024 * KiB
SECONDS = 1.0

Address = tuple[str, int]
Scope = dict[str, Any]

# RFC 9114 §4.2: connection-specific fields MUST NOT appear in HTTP/3 messages.
_HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)


@dataclass(frozen=True, slots=True)
class H3Limits:
    """Per-connection limits of the HTTP/3 listener."""

    max_concurrent_streams: int = 128
    """Request streams a client may have open at once (QUIC MAX_STREAMS, RFC 9000 §4.6)."""
    max_header_bytes: int = 16 * KiB
    """Request field section size, counted as in RFC 9114 §4.2.2 (name + value + 32 each); 431."""
    max_body_bytes: int = 8 * MiB
    """Request body size; beyond it 413 (or a stream reset once the response has started)."""
    active_connection_ids: int = 4
    """Connection IDs each side holds for the other (QUIC active_connection_id_limit, RFC 9000
    §5.1.1): the spares a client moves to when its address changes. 2 to 8; aioquic's own 8
    costs 14 NEW_CONNECTION_ID frames a connection where 4 costs 6 (docs/transport.md)."""
    initial_congestion_window: int = 32
    """Datagrams a connection may have in flight before its first acknowledgement: an answer a
    backend (or the response cache) writes at once leaves in the first round trip up to this
    much (~38 KB). quic-go (Caddy) starts at 32 too; RFC 9002 §7.2 suggests 10, aioquic's own,
    with which a 64-token answer waited a round trip more (docs/transport.md, "Pacing and the
    first round trip"). 2 to 64."""
    idle_timeout: float = 60 * SECONDS
    """A connection with no traffic for this long is closed (QUIC max_idle_timeout)."""
    early_data_handshake_deadline: float = 2 * SECONDS
    """Seconds a request accepted in 0-RTT may run before its handshake completes; past it the
    request is cancelled (a replayed first flight, or a client that vanished, never completes
    it). Default 2 s: a handshake takes one round trip after the server's first flight."""
    request_head_timeout: float = 10 * SECONDS
    """A request head must arrive whole within this many seconds of its first byte, else 408
    and close (a slowloris holds no worker); HTTP/3: 408 on the stream. On the TLS listener
    hypercorn counts it from the connection's start or its last response, and it is the idle
    keep-alive timeout there too."""
    handshake_timeout: float = 10 * SECONDS
    """An HTTP/3 connection whose handshake is not complete this many seconds after its first
    datagram is closed (CONNECTION_REFUSED), with the requests deferred for it: a client that
    never sent its Finished held both for as long as it sent a PING now and then, past the
    idle timeout. quic-go's is 10 s too; a handshake whose flights are lost twice on a slow
    path takes a few seconds."""
    request_body_timeout: float = 60 * SECONDS
    """A request body must arrive whole within this many seconds of its head, on every
    listener: else 408 (HTTP/3: on the stream; once a response began, a reset or a close)."""
    send_timeout: float = 60 * SECONDS
    """A response the client takes none of for this many seconds (its buffer full, or its
    flow-control window closed) is cut off, on every listener: the stream is reset or the
    connection closed, and the app gets `http.disconnect` (the proxy aborts the backend's
    request). nginx's `send_timeout`; without it a client that stops reading would hold its
    request, and a backend connection, for ever."""

    def __post_init__(self) -> None:
        for name in ("max_concurrent_streams", "max_header_bytes", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 2 <= self.active_connection_ids <= 8:
            raise ValueError(
                f"active_connection_ids must be from 2 to 8, got {self.active_connection_ids}"
            )
        if not 2 <= self.initial_congestion_window <= 64:
            raise ValueError(
                "initial_congestion_window must be from 2 to 64 datagrams, got "
                f"{self.initial_congestion_window}"
            )
        seconds = (
            "idle_timeout", "early_data_handshake_deadline", "request_head_timeout",
            "handshake_timeout", "request_body_timeout", "send_timeout",
        )  # fmt: skip
        for name in seconds:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # NaN passed `<= 0`, then broke timers
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")


@dataclass(frozen=True, slots=True)
class StartRequest:
    """Call the app for this request now."""

    stream_id: int
    scope: Scope


@dataclass(frozen=True, slots=True)
class RequestBody:
    """A piece of a started request's body (``http.request``)."""

    stream_id: int
    body: bytes
    more_body: bool


@dataclass(frozen=True, slots=True)
class RequestAborted:
    """The client reset the stream or the connection closed (``http.disconnect``)."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class RequestRefused:
    """The transport answered (or reset) a request itself; for metrics and logs."""

    stream_id: int
    status: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class EarlyRequest:
    """A request arrived in 0-RTT and the policy applied ``action``."""

    stream_id: int
    action: Mode


@dataclass(frozen=True, slots=True)
class SentAway:
    """The connection was closed for how its client behaved (`reason`: `caps.RAPID_RESET`,
    `caps.CONTROL_FLOOD`)."""

    reason: str


Action = StartRequest | RequestBody | RequestAborted | RequestRefused | EarlyRequest | SentAway


@dataclass(slots=True)
class _Request:
    scope: Scope
    arrived_at: float
    body_limit: int
    """The content-length the request declared, else `max_body_bytes`: no more is taken."""
    started: bool = False
    body_done: bool = False
    received: int = 0
    pending: list[RequestBody] = field(default_factory=list)
    response_started: bool = False
    response_done: bool = False
    body_timer: asyncio.TimerHandle | None = None


class H3Session:
    """One connection's HTTP/3 request handling."""

    def __init__(
        self,
        quic: QuicConnection,
        *,
        policy: EarlyDataPolicy,
        limits: H3Limits,
        server: Address | None,
        on_overdue: Callable[[list[Action]], None] | None = None,
    ) -> None:
        self._quic = quic
        # Runs the actions of a request whose body missed its deadline (a timer's, outside
        # `handle`); without it no body deadline is kept (an I/O-free session in tests).
        self._on_overdue = on_overdue
        self._heads: dict[int, asyncio.TimerHandle] = {}
        """Request streams whose HEADERS are arriving in pieces → their deadline."""
        self._h3 = StreamConfinedH3Connection(quic, max_header_bytes=limits.max_header_bytes)
        self._policy = policy
        self._limits = limits
        self._server = server
        self._requests: dict[int, _Request] = {}
        self._deferred: list[int] = []
        self._goaway_id: int | None = None
        self._max_seen_id = -4
        self._opened = 0  # requests whose head arrived
        self._cancelled = 0  # of them, reset by the client before their response ended
        self.handshake_complete = False
        self.terminated = False

    def __repr__(self) -> str:
        return (
            f"<H3Session requests={len(self._requests)} deferred={len(self._deferred)}"
            f" handshake_complete={self.handshake_complete}>"
        )

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    # events in

    def handle(self, event: QuicEvent, now: float) -> list[Action]:
        actions: list[Action] = []
        if isinstance(event, HandshakeCompleted):
            self.handshake_complete = True
            self._release_deferred(now, actions)
            return actions
        if isinstance(event, ConnectionTerminated):
            self._end(actions)
            return actions
        for h3_event in self._h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                self._on_headers(h3_event, now, actions)
            elif isinstance(h3_event, DataReceived):
                self._on_data(h3_event.stream_id, h3_event.data, h3_event.stream_ended, actions)
        if self._h3.flooded and not self.terminated:
            # Counted now: QUIC reports its own close only three probe timeouts later, and a
            # listener that stops first would never count it.
            actions.append(SentAway(CONTROL_FLOOD))
            self._end(actions)
            return actions
        if (
            isinstance(event, StreamDataReceived)
            and self._on_overdue is not None
            and (event.stream_id > self._max_seen_id or self._head_late(event.stream_id))
        ):
            self._head_arriving(event)
        if isinstance(event, StreamReset | StopSendingReceived):
            self._on_reset(event.stream_id, actions)
        if self._h3.failed_streams:
            failed_streams, self._h3.failed_streams = self._h3.failed_streams, []
            for failed in failed_streams:
                self._on_failed(failed.stream_id, failed.status, failed.reason, actions)
        return actions

    def _head_late(self, stream_id: int) -> bool:
        """Whether a request stream older than the newest with a head still waits for its
        own (a client may send its streams' HEADERS in any order)."""
        return (
            stream_id % 4 == 0
            and stream_id not in self._requests
            and self._h3.head_pending(stream_id)
        )

    def _head_arriving(self, event: StreamDataReceived) -> None:
        """Data on a request stream newer than any whose HEADERS were read, or on an older
        one whose HEADERS have not come: its head is still coming (the usual request brings it
        whole in one event, and no timer is armed)."""
        stream_id = event.stream_id
        if stream_id % 4 or event.end_stream or stream_id in self._heads:
            return  # not a client request stream, or already timed
        self._heads[stream_id] = asyncio.get_running_loop().call_later(
            self._limits.request_head_timeout, self._head_overdue, stream_id
        )

    def _head_overdue(self, stream_id: int) -> None:
        """A request head missed its deadline: 408, and the rest of the stream is not read."""
        self._heads.pop(stream_id, None)
        if self._on_overdue is None or self.terminated or not self._h3.head_pending(stream_id):
            return  # its HEADERS arrived meanwhile (or the stream or the connection is gone)
        self._max_seen_id = max(self._max_seen_id, stream_id)  # what still arrives: no new head
        actions: list[Action] = []
        self._respond(stream_id, 408, "request head not received in time")
        actions.append(RequestRefused(stream_id, 408, "request head not received in time"))
        self._on_overdue(actions)

    def _on_headers(self, event: HeadersReceived, now: float, actions: list[Action]) -> None:
        stream_id = event.stream_id
        head_timer = self._heads.pop(stream_id, None) if self._heads else None
        if head_timer is not None:
            head_timer.cancel()
        req = self._requests.get(stream_id)
        if req is not None:
            # Trailers (RFC 9114 §4.1): dropped; they can only end the body.
            if event.stream_ended:
                self._on_data(stream_id, b"", True, actions)
            return
        self._max_seen_id = max(self._max_seen_id, stream_id)
        if self._goaway_id is not None and stream_id >= self._goaway_id:
            # RFC 9114 §5.2: requests past the GOAWAY identifier are not processed.
            self._h3.abort_stream(stream_id, ErrorCode.H3_REQUEST_REJECTED)
            actions.append(RequestRefused(stream_id, None, "after GOAWAY"))
            return
        self._opened += 1
        # The section's size was checked as it was decoded (`StreamConfinedH3Connection`).
        method = path = authority = b""
        scheme = b"https"
        headers: list[tuple[bytes, bytes]] = []
        for name, value in event.headers:
            if name.startswith(b":"):
                if name == b":method":
                    method = value
                elif name == b":path":
                    path = value
                elif name == b":authority":
                    authority = value
                elif name == b":scheme":
                    scheme = value
            else:
                headers.append((name, value))
        if not path.startswith(b"/"):
            # CONNECT, or an asterisk/absolute form: not served by this proxy.
            self._refuse(stream_id, 400, "request target must be an origin-form path", actions)
            return
        length = _content_length(headers)
        if length is not None and length > self._limits.max_body_bytes:
            self._refuse(stream_id, 413, "request body too large", actions)
            return
        if authority and not any(n == b"host" for n, _ in headers):
            headers.insert(0, (b"host", authority))
        raw_path, _, query = path.partition(b"?")
        early = not self.handshake_complete
        peer = self._quic.get_peer_address()
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "3",
            "method": method.decode("latin-1"),
            "scheme": scheme.decode("latin-1"),
            "path": unquote_to_bytes(raw_path).decode("utf-8", "replace"),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": _addr(peer) if peer is not None else None,
            "server": self._server,
            "extensions": {
                "transport": "h3",
                "early_data": early,
                "handshake_wait_s": 0.0,
                "arrived_at": time.perf_counter(),
            },
        }
        limit = self._limits.max_body_bytes if length is None else length
        req = _Request(scope=scope, arrived_at=now, body_limit=limit)
        self._requests[stream_id] = req
        if early:
            mode = self._policy.mode_for(scope["path"])
            actions.append(EarlyRequest(stream_id, mode))
            if mode is Mode.REJECT:
                self._refuse(stream_id, 425, "too early: retry after the handshake", actions)
                return
            if mode is Mode.DEFER:
                scope["extensions"]["early_data"] = False
                self._deferred.append(stream_id)
            else:
                req.started = True
                actions.append(StartRequest(stream_id, scope))
        else:
            req.started = True
            actions.append(StartRequest(stream_id, scope))
        if not event.stream_ended and self._on_overdue is not None:
            req.body_timer = asyncio.get_running_loop().call_later(
                self._limits.request_body_timeout, self._overdue, stream_id
            )
        if event.stream_ended:
            self._on_data(stream_id, b"", True, actions)

    def _on_data(self, stream_id: int, data: bytes, ended: bool, actions: list[Action]) -> None:
        req = self._requests.get(stream_id)
        if req is None or req.body_done:
            return
        req.received += len(data)
        if req.received > req.body_limit:
            self._body_over_limit(stream_id, req, actions)
            return
        if not data and not ended:
            return
        req.body_done = ended
        if ended and req.body_timer is not None:
            req.body_timer.cancel()
            req.body_timer = None
        piece = RequestBody(stream_id, data, not ended)
        if req.started:
            actions.append(piece)
        else:
            req.pending.append(piece)

    def _body_over_limit(self, stream_id: int, req: _Request, actions: list[Action]) -> None:
        """More body than the request declared (malformed, RFC 9114 §4.1.2: a stream error at
        once, not at the stream's end, when the app would have read it all), or than the
        listener takes (413)."""
        if _content_length(req.scope["headers"]) is not None:
            self._h3.abort_stream(stream_id, ErrorCode.H3_MESSAGE_ERROR)
            self._on_failed(stream_id, None, "body longer than its content-length", actions)
            return
        if req.started:
            actions.append(RequestAborted(stream_id))
        self._refuse(stream_id, 413, "request body too large", actions)

    def _overdue(self, stream_id: int) -> None:
        """The body deadline of `stream_id` passed (a slowloris): 408, the app sees it gone."""
        req = self._requests.get(stream_id)
        if req is None or req.body_done or self._on_overdue is None:
            return
        req.body_timer = None
        actions: list[Action] = []
        if req.started:
            actions.append(RequestAborted(stream_id))
        self._refuse(stream_id, 408, "request body not received in time", actions)
        self._on_overdue(actions)

    def _on_reset(self, stream_id: int, actions: list[Action]) -> None:
        req = self._requests.pop(stream_id, None)
        if req is None:
            self._h3.forget(stream_id)
            if stream_id % 4 == 0 and stream_id > self._max_seen_id:
                # a request stream reset before its head arrived: opened and cancelled too
                self._opened += 1
                self._cancelled += 1
                self._sent_away_if_rapid(actions)
            return
        if not req.response_done:
            # RFC 9114 §4.1.2: the client cancelled; abandon the response too, which also
            # lets QUIC retire the stream and return its credit.
            self._h3.abort_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            self._cancelled += 1
        self._h3.forget(stream_id)
        if req.started:
            actions.append(RequestAborted(stream_id))
        else:
            self._deferred.remove(stream_id)
        self._sent_away_if_rapid(actions)

    def _sent_away_if_rapid(self, actions: list[Action]) -> None:
        """Close a connection that opens and resets requests as fast as the stream credit
        comes back (`caps.resets_most`)."""
        if resets_most(self._cancelled, self._opened) and not self.terminated:
            self._quic.close(error_code=ErrorCode.H3_EXCESSIVE_LOAD,
                             reason_phrase="most requests reset")  # fmt: skip
            actions.append(SentAway(RAPID_RESET))
            self._end(actions)

    def _end(self, actions: list[Action]) -> None:
        """The connection is over: every started request is aborted, nothing more is read."""
        self.terminated = True
        for stream_id, req in list(self._requests.items()):
            if req.started:
                actions.append(RequestAborted(stream_id))
        self._requests.clear()
        self._deferred.clear()
        for timer in self._heads.values():
            timer.cancel()
        self._heads.clear()

    def _on_failed(
        self, stream_id: int, status: int | None, reason: str, actions: list[Action]
    ) -> None:
        req = self._requests.pop(stream_id, None)
        if req is not None and req.started:
            actions.append(RequestAborted(stream_id))
        if stream_id in self._deferred:
            self._deferred.remove(stream_id)
        if status is not None:
            if req is not None and req.response_started:
                # An answer has begun (the refusal is of trailers): no status can follow it.
                self._h3.abort_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            else:
                self._respond(stream_id, status, reason)
        actions.append(RequestRefused(stream_id, status, reason))

    def _release_deferred(self, now: float, actions: list[Action]) -> None:
        for stream_id in self._deferred:
            req = self._requests[stream_id]
            req.started = True
            req.scope["extensions"]["handshake_wait_s"] = max(0.0, now - req.arrived_at)
            actions.append(StartRequest(stream_id, req.scope))
            actions.extend(req.pending)
            req.pending.clear()
        self._deferred.clear()

    def _refuse(self, stream_id: int, status: int, reason: str, actions: list[Action]) -> None:
        """Answer ``status`` ourselves and stop reading the request (RFC 9114 §4.1.1)."""
        req = self._requests.pop(stream_id, None)
        if stream_id in self._deferred:
            self._deferred.remove(stream_id)
        if req is not None and req.response_started:
            self._h3.abort_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        else:
            self._respond(stream_id, status, reason)
        actions.append(RequestRefused(stream_id, status, reason))

    def _respond(self, stream_id: int, status: int, reason: str) -> None:
        body = reason.encode() + b"\n"
        self._h3.send_headers(
            stream_id,
            [
                (b":status", str(status).encode()),
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", os.urandom(16).hex().encode()),  # to quote, as the app's
            ],
        )
        self._h3.send_data(stream_id, body, end_stream=True)
        self._h3.stop_reading(stream_id, ErrorCode.H3_NO_ERROR)

    # responses out

    def send_start(self, stream_id: int, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
        """Send the response HEADERS; False if the request is gone (reset, refused)."""
        req = self._requests.get(stream_id)
        if req is None or req.response_started:
            return False
        req.response_started = True
        fields = [(b":status", str(status).encode())]
        fields.extend((n.lower(), v) for n, v in headers if n.lower() not in _HOP_BY_HOP)
        self._h3.send_headers(stream_id, fields)
        return True

    def send_body(self, stream_id: int, body: bytes, more_body: bool) -> bool:
        """Send a DATA frame (and FIN when done); False if the request is gone."""
        req = self._requests.get(stream_id)
        if req is None or not req.response_started or req.response_done:
            return False
        if body or not more_body:
            self._h3.send_data(stream_id, body, end_stream=not more_body)
        if not more_body:
            req.response_done = True
            if req.body_done:
                self._finish(stream_id)
            else:
                # RFC 9114 §4.1.1: a complete response may end the request early.
                self._h3.stop_reading(stream_id, ErrorCode.H3_NO_ERROR)
                self._finish(stream_id)
        return True

    def app_finished(self, stream_id: int) -> bool:
        """The app returned; fix up a response it left incomplete. True if that wrote
        something to send (a 500, or a reset)."""
        req = self._requests.get(stream_id)
        if req is None:
            return False
        if not req.response_started:
            self._respond(stream_id, 500, "internal server error")
            self._requests.pop(stream_id, None)
            return True
        if not req.response_done:
            self._h3.abort_stream(stream_id, ErrorCode.H3_INTERNAL_ERROR)
            self._requests.pop(stream_id, None)
            return True
        return False

    def _finish(self, stream_id: int) -> None:
        self._requests.pop(stream_id, None)

    def response_done(self, stream_id: int) -> bool:
        req = self._requests.get(stream_id)
        return req is None or req.response_done

    def cancel(self, stream_id: int) -> None:
        """Abort a request from our side (shutdown past the drain timeout)."""
        if self._requests.pop(stream_id, None) is not None:
            self._h3.abort_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)

    def abandon(self, stream_id: int) -> None:
        """Reset a stream whose response has ended but which the client has not taken (the
        send timeout): what is unacknowledged is never sent."""
        if not self.terminated:
            self._h3.abort_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)

    def goaway(self) -> None:
        """Send GOAWAY (RFC 9114 §5.2): requests already received finish, later ones are refused."""
        if self._goaway_id is not None:
            return
        self._goaway_id = self._max_seen_id + 4
        self._h3.send_goaway(self._goaway_id)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)  # aioquic already checked it is a non-negative integer
    return None


def _addr(addr: tuple[Any, ...]) -> Address:
    return (str(addr[0]), int(addr[1]))
