"""hypercorn's HTTP/2 protocol, kept alive when request data arrives for a stream it closed.

When the app answers before reading the request body (a 404, 405, 413 or 415 from the edge),
hypercorn closes the stream while the client is still sending that body. hypercorn 0.18's
`H2Protocol._handle_events` then looks the stream up for the next DATA frame
(`self.streams[event.stream_id]`) and the `KeyError` ends the whole connection: every other
stream on it is cut and the client's next request fails. Upstream reports:
pgjones/hypercorn#329 (issue), #312 and #334 (the same one-line guard, not merged as of 0.18.0).

`GuardedH2Protocol` handles DATA for an unknown stream itself: it discards the bytes and returns
them to the stream's and the connection's flow-control windows, so the client can finish its
upload and the other streams keep their credit. It does not reset the stream (RFC 9113 §8.1
allows RST_STREAM NO_ERROR after a complete response): httpx/httpcore then waits for a response
it already has until its read timeout. Every other event goes to hypercorn unchanged.

It closes a connection whose client resets most of the requests it opens (the "rapid reset"
attack, CVE-2023-44487): a reset stream frees its place among the concurrent streams at once,
so without a check one connection could start requests, and the backend work behind them,
faster than `max_concurrent_streams` would ever let it. Past `caps.RAPID_RESETS` streams reset
before their response ended, and when they are more than half the connection's requests
(`caps.resets_most`), it gets GOAWAY with ENHANCE_YOUR_CALM and closes; the listener counts it
(`rapid_reset`). So does a connection whose control frames (PING, SETTINGS, WINDOW_UPDATE,
PRIORITY, empty DATA, unknown types) pass 1,000 and ten per request received and DATA frame
sent (`caps.floods_control`, counted `control_flood`): each costs the listener several
microseconds, and a client sending only those held a core and slowed every other connection
of the worker from 0.6 ms to about a second a request.

It also bounds how long a response waits for the client's flow-control window: a stream whose
send buffer stays full for the listener's send timeout (`transport.hypercorn_send`) is reset
with CANCEL, and the app gets `http.disconnect`.

A connection that has served `keep_alive_max_requests` (`TcpOptions.max_requests`) retires
without cutting an answer (hypercorn's own check closes it at once: h2 then refuses to send on
any stream, every answer in flight is lost, and its GOAWAY tells the client those requests
were processed). It goes on serving until it is idle, then sends GOAWAY: a client that sent a
request meanwhile sees it above the GOAWAY's last stream and retries it elsewhere. A client
that never leaves it idle gets, `h2_max_concurrent_streams` requests later, a graceful GOAWAY
(RFC 9113 §6.8) naming the last request taken: those in flight are answered to their end and
later ones refused with REFUSED_STREAM, and the final GOAWAY follows the last answer. Either
way the client then closes the connection, or hypercorn's idle timer does. The idle moment
comes first because python-h2 clients (httpx with `http2=True`) fail every stream in flight
when a GOAWAY arrives (python-hyper/h2#1181).

A malformed request (RFC 9113 §8.1.1: an uppercase or connection-specific header, a missing
or misplaced pseudo-header, a forbidden character, a `content-length` that is not a number or
that its body does not match) is reset with PROTOCOL_ERROR, checked by h2's own code
(`transport.h2_stream_errors` for the lengths); h2 would raise it as an error of the whole
connection, and hypercorn would end the connection with every other request's answer on it.

The client's stream priorities (RFC 7540 §5.3: PRIORITY frames, and dependencies in HEADERS)
are ignored, as RFC 9113 §5.3.2 allows; every stream is served in turn. hypercorn kept them in
a `priority.PriorityTree` and never removed an entry made for a stream that was not open: 1,001
PRIORITY frames for idle streams, a chain of 111 with a loop, or a client naming each finished
request as the parent of the next (as browsers do) ended the connection (a `TooManyStreamsError`,
`PriorityLoop` or `RecursionError` out of hypercorn's loop; with a request in flight the
connection hung, holding its slot), and each entry slowed every later send.

A request body goes back to the client's flow-control windows as its app reads it
(`transport.h2_body_credit`), not as it is queued for the app: hypercorn's queue of 10
messages made the connection's read loop wait for an app that read late, and every other
request on the connection with it. The same queue, full, once left a stream's
`http.disconnect` (a 401 or 413 to a large upload) waiting for room for ever, with the
connection's sending behind it and its slot held; the queue that replaces it is never full.

The HPACK table of the connection's answers stays within 4 KiB (`_CappedEncoder`): h2 sized it
to the client's SETTINGS_HEADER_TABLE_SIZE, up to 4 GiB, and kept in it every answer's unique
headers (`x-request-id`, ~70 bytes each) for as long as the connection lasted.

While the server drains, a request that arrives is refused with REFUSED_STREAM, which tells
the client it was not processed and may go to another edge (hypercorn's reset says NO_ERROR,
which leaves the client to guess); as in hypercorn, the client is told to open no more streams
and the connection closes once its last answer is out.

`install()` swaps it in where hypercorn's `ProtocolWrapper` looks the class up, once per
process; `transport.tcp` calls it. The override is tied to hypercorn's internals
(`streams`, `connection`, `_handle_events`), so `pyproject.toml` pins hypercorn's minor version
and `install()` refuses another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from functools import partial
from typing import Any

import h2.errors
import h2.events
import h2.exceptions
import hpack
import hypercorn
import hypercorn.protocol
import priority
from h2.settings import SettingCodes
from h2.utilities import HeaderValidationFlags, validate_headers
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Body, Data, EndBody, EndData
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h2 import BUFFER_HIGH_WATER, H2Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hyperframe.frame import GoAwayFrame

from transport import hypercorn_send
from transport.caps import CONTROL_FLOOD, RAPID_RESET, floods_control, resets_most
from transport.h2_body_credit import AppQueue, connection_window, take_over
from transport.h2_stream_errors import adopt, body_length_error, header_list_over
from transport.hypercorn_send import send_timeout_of
from transport.pins import off_pin

TESTED_MINOR = "0.18"
"""hypercorn version whose `H2Protocol` this override was written and tested against."""


_REQUEST_HEADERS = HeaderValidationFlags(
    is_client=False, is_trailer=False, is_response_header=False, is_push_promise=False
)
"""How h2 checks the headers of a request a server receives."""

_TOO_LARGE = [(b":status", b"431"), (b"content-length", b"0")]
"""The answer to a request whose header list is over the advertised size (RFC 6585 §5)."""

ON_SENT_AWAY_ATTRIBUTE = "quicedge_on_sent_away"
"""The hypercorn `Config` attribute that holds the listener's count of connections sent away
for how their client behaved (rapid resets, control-frame floods)."""


ENCODER_TABLE_MAX = 4096
"""Bytes of HPACK dynamic table the encoder of a connection's answers keeps at most (RFC 7541
§4.2 lets an encoder use less than the client's SETTINGS_HEADER_TABLE_SIZE; 4,096 is the
protocol's default)."""


class _CappedEncoder(hpack.Encoder):
    """hpack's encoder, whose table stays within `ENCODER_TABLE_MAX` whatever the client
    advertises: h2 sized it to the client's setting (up to 4 GiB), and the table then kept
    every answer's unique headers (`x-request-id`) for the connection's life."""

    @property
    def header_table_size(self) -> int:
        return self.header_table.maxsize

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        inherited: property = vars(hpack.Encoder)["header_table_size"]
        assert inherited.fset is not None
        inherited.fset(self, min(value, ENCODER_TABLE_MAX))  # announced in the next block


class GuardedH2Protocol(H2Protocol):
    """`H2Protocol` that survives request data for a stream it already closed and malformed
    requests, closes a connection that resets most of its requests or floods control frames,
    ignores stream priorities, never lets a stream's end wait on its app's queue, bounds its
    waits for flow control, refuses requests as unprocessed while the server drains, and goes
    away gracefully after its last allowed request."""

    _cancelled = 0
    """Streams the client reset before their response ended."""

    _control = 0
    """Control frames the client sent (`caps.floods_control`)."""

    _data_frames = 0
    """DATA frames sent, each of which a client may answer with a WINDOW_UPDATE."""

    _retiring = False
    """The connection has served `keep_alive_max_requests`: it closes when next idle."""

    _last_stream: int | None = None
    """The last request taken after the connection announced it is going away (None: it has
    not)."""

    _retired = False
    """The final GOAWAY went out: h2 takes no more frames."""

    _draining = False
    """The server is shutting down and the client was told to open no more streams."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # h2 would raise a malformed request's headers out of `receive_data`, and hypercorn
        # then ends the connection; `_request` checks them per stream instead.
        self.connection.config.validate_inbound_headers = False
        adopt(self.connection)  # and it records a wrong content-length; the checks are below
        self.connection.encoder.__class__ = _CappedEncoder
        self._app_queues: dict[int, AppQueue] = {}
        """Streams' queues into their apps, which return body credit as the app reads."""

    async def initiate(
        self, headers: list[tuple[bytes, bytes]] | None = None, settings: bytes | None = None
    ) -> None:
        await super().initiate(headers, settings)
        connection = self.connection
        window = connection_window(
            connection.local_settings.initial_window_size, self.config.h2_max_concurrent_streams
        )
        if window > connection.inbound_flow_control_window:
            connection.increment_flow_control_window(
                window - connection.inbound_flow_control_window
            )
            await self._flush()

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        # One event at a time: a stream can close while hypercorn awaits an earlier event of
        # the same batch, so checking the whole batch up front would not be enough.
        for event in events:
            if isinstance(event, _CONTROL_EVENTS) or (
                isinstance(event, h2.events.DataReceived)
                and not event.data
                and event.stream_ended is None
            ):
                self._control += 1
                if floods_control(self._control, self.keep_alive_requests + self._data_frames):
                    await self._calm(CONTROL_FLOOD)
                    return
            if isinstance(event, h2.events.PriorityUpdated):
                continue  # RFC 9113 §5.3.2: the client's priority tree is ignored (below)
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                self._discard(event)
                await self._flush()
                continue
            if isinstance(event, h2.events.DataReceived) and self._malformed_body(event):
                self._discard(event)
                await self._reset(event.stream_id, h2.errors.ErrorCodes.PROTOCOL_ERROR)
                continue
            if isinstance(event, h2.events.StreamReset) and event.stream_id in self.streams:
                self._cancelled += 1
                if resets_most(self._cancelled, self.keep_alive_requests):
                    await self._calm(RAPID_RESET)
                    return
            if isinstance(event, h2.events.RequestReceived):
                await self._request(event)
                continue
            if isinstance(event, h2.events.DataReceived) and event.stream_id in self._app_queues:
                await self._body(event)
                continue
            await super()._handle_events([event])
            if self._retiring and not self._retired:
                await self._retire_if_idle()

    async def _request(self, event: h2.events.RequestReceived) -> None:
        """hypercorn's handling of a new request, refusing it as unprocessed while the
        server drains, and with a retirement that loses no answer in place of its close
        after `keep_alive_max_requests`."""
        stream_id = event.stream_id
        assert stream_id is not None
        draining = self.context.terminated.is_set()
        if draining or self._last_stream is not None:
            # REFUSED_STREAM says the request was not processed, so a client may send it
            # again elsewhere (RFC 9113 §8.7); hypercorn's reset says NO_ERROR.
            self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            if draining and not self._draining:
                self._draining = True  # and no more, as hypercorn says
                self.connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: 0})
            await self._flush()
            return
        if header_list_over(self.connection, stream_id):
            # Checked first: the fields past the size were dropped, the rest may not be a
            # whole request. With an `x-request-id` to quote, as every answer of the edge
            # carries one.
            rid = (b"x-request-id", os.urandom(16).hex().encode())
            self.connection.send_headers(stream_id, [*_TOO_LARGE, rid], end_stream=True)
            await self._flush()
            return
        try:
            for _ in validate_headers(event.headers, _REQUEST_HEADERS):
                pass
            malformed = body_length_error(self.connection, stream_id) is not None
        except h2.exceptions.ProtocolError:
            malformed = True
        if malformed:
            # A stream error, not a connection error (RFC 9113 §8.1.1): the client's other
            # requests on the connection go on.
            self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.PROTOCOL_ERROR)
            await self._flush()
            return
        await self._create_stream(event)
        stream = self.streams.get(stream_id)
        if isinstance(stream, HTTPStream) and stream.app_put is not None:
            queue = take_over(stream.app_put, partial(self._body_read, stream_id))
            if queue is not None:
                self._app_queues[stream_id] = queue
        await self.send(Updated(idle=False))
        served, most = self.keep_alive_requests, self.config.keep_alive_max_requests
        if served >= most:
            self._retiring = True
        if served >= most + self.config.h2_max_concurrent_streams:
            self._last_stream = stream_id
            await self._flush()  # h2's frames so far go first
            goaway = GoAwayFrame(stream_id=0, last_stream_id=stream_id)
            # Past h2's state machine, which after a GOAWAY of its own refuses to send
            # anything more on the streams in flight.
            await self.send(RawData(data=goaway.serialize()))

    async def _body(self, event: h2.events.DataReceived) -> None:
        """hypercorn's handling of request data, with the bytes returned to the windows as the
        app reads them (`_body_read`), not here; padding goes back at once."""
        stream_id = event.stream_id
        assert stream_id is not None
        data = event.data or b""
        await self.streams[stream_id].handle(Body(stream_id=stream_id, data=data))
        padding = (event.flow_controlled_length or 0) - len(data)
        if padding > 0:
            self.connection.acknowledge_received_data(padding, stream_id)
            await self._flush()

    def _body_read(self, stream_id: int, size: int) -> None:
        """The app read `size` bytes of `stream_id`'s body: they go back to its windows."""
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.connection.acknowledge_received_data(size, stream_id)
        if self.connection._data_to_send:  # a WINDOW_UPDATE is due
            self.task_group.spawn(self._flush)

    async def _close_stream(self, stream_id: int) -> None:
        queue = self._app_queues.pop(stream_id, None)
        if queue is not None and (unread := queue.settle()):
            # What its app never read goes back to the connection's window (the stream's
            # own is closed).
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.connection.acknowledge_received_data(unread, stream_id)
            await self._flush()
        await super()._close_stream(stream_id)

    async def _retire_if_idle(self) -> None:
        """GOAWAY once a retiring connection's last answer is wholly sent. The client closes
        the connection then (as it must not open another stream on it), or hypercorn's idle
        timer does; closing it from here would race the client's last frames (its window
        updates), which TLS then reports as data after close_notify."""
        if self._retired or self.streams or self.stream_buffers:
            return
        self._retired = True
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.connection.close_connection(last_stream_id=self._last_stream)
            await self._flush()

    async def _send_data(self, stream_id: int) -> None:
        self._data_frames += 1  # one at most
        await super()._send_data(stream_id)
        if self._retiring and not self._retired:
            await self._retire_if_idle()

    async def _calm(self, reason: str) -> None:
        """GOAWAY with ENHANCE_YOUR_CALM, and close: every open stream's app hears the client
        is gone. The listener counts the connection as sent away for `reason`."""
        counted = getattr(self.config, ON_SENT_AWAY_ATTRIBUTE, None)
        if counted is not None:
            counted(reason)
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.connection.close_connection(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
            await self._flush()
        await self.handle(Closed())  # the streams first, while the connection's server runs
        await self.send(Closed())

    async def stream_send(self, event: StreamEvent) -> None:
        limit = send_timeout_of(self.config)
        if limit is None or not self._would_wait(event):
            await super().stream_send(event)
        else:
            try:
                async with asyncio.timeout(limit.seconds):
                    await super().stream_send(event)
            except TimeoutError:
                limit.stalled()
                await self._reset(event.stream_id, h2.errors.ErrorCodes.CANCEL)
        if self._retiring and not self._retired:
            await self._retire_if_idle()

    def _would_wait(self, event: StreamEvent) -> bool:
        """Whether hypercorn would wait for the client to send `event`: a body over its
        buffer's high-water mark, or the stream's end while the buffer still holds data."""
        if isinstance(event, Body | Data):
            buffer = self.stream_buffers.get(event.stream_id)
            return buffer is not None and len(buffer.buffer) + len(event.data) >= BUFFER_HIGH_WATER
        if isinstance(event, EndBody | EndData):
            buffer = self.stream_buffers.get(event.stream_id)
            return buffer is not None and bool(buffer.buffer)
        return False

    def _malformed_body(self, event: h2.events.DataReceived) -> bool:
        """Whether the request body `event` belongs to does not match its `content-length`
        (RFC 9113 §8.1.1)."""
        assert event.stream_id is not None
        return body_length_error(self.connection, event.stream_id) is not None

    async def _reset(self, stream_id: int, code: h2.errors.ErrorCodes) -> None:
        """Reset a stream the app is serving, drop what it buffered, and tell the app
        (`http.disconnect`)."""
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.connection.reset_stream(stream_id, code)
            await self._flush()
        buffer = self.stream_buffers.pop(stream_id, None)
        if buffer is not None:
            await buffer.close()
        with contextlib.suppress(priority.MissingStreamError):
            self.priority.remove_stream(stream_id)
        await self._close_stream(stream_id)

    def _discard(self, event: h2.events.DataReceived) -> None:
        stream_id = event.stream_id
        assert stream_id is not None
        # h2 still tracks the stream (half-closed on our side); it ignores a stream it forgot.
        self.connection.acknowledge_received_data(event.flow_controlled_length, stream_id)


_CONTROL_EVENTS = (
    h2.events.PingReceived,
    h2.events.PingAckReceived,
    h2.events.RemoteSettingsChanged,
    h2.events.WindowUpdated,
    h2.events.PriorityUpdated,
    h2.events.UnknownFrameReceived,
)
"""What h2 makes of the frames `caps.floods_control` counts (with empty DATA that does not end
its stream)."""


def install() -> None:
    """Make hypercorn's HTTP/2 connections use `GuardedH2Protocol` (idempotent)."""
    found = off_pin("hypercorn", TESTED_MINOR)
    if found is not None:
        raise RuntimeError(
            f"transport.hypercorn_h2 is written for hypercorn {TESTED_MINOR}.x, found {found}: "
            "check whether upstream fixed data on a closed stream (pgjones/hypercorn#329) and "
            "re-test before moving the pin"
        )
    hypercorn.protocol.H2Protocol = GuardedH2Protocol  # type: ignore[misc]
    hypercorn_send.install()  # each stream's send buffer, bounded


__all__ = [
    "ON_SENT_AWAY_ATTRIBUTE",
    "TESTED_MINOR",
    "GuardedH2Protocol",
    "install",
]
