"""aioquic's H3Connection with bad requests confined to their own stream.

aioquic raises ``MessageError`` for a malformed request (missing, duplicated or unknown
pseudo-headers, bad header characters, a content-length that does not match the body) and turns
it into a *connection* error, killing every other request on the connection. RFC 9114 §4.1.2
says a malformed request is a *stream* error of type H3_MESSAGE_ERROR; this subclass does that.
It also refuses a HEADERS frame larger than the header limit before buffering it (RFC 9114
§4.2.2, §10.5), so an oversize header block costs neither memory nor the connection, and a
field section that decodes to more than the limit before aioquic checks each of its bytes.

What a client can make it buffer is bounded too (RFC 9114 §10.5). aioquic waits for a whole
SETTINGS or MAX_PUSH_ID frame on the control stream, appending each packet to what it holds
(a copy of all of it each time): a frame declaring a length of 2^40 held a core at 100 % for
as long as the client sent, with no timer to end it. Such a frame over `MAX_CONTROL_FRAME` ends
the connection with H3_EXCESSIVE_LOAD. The listener keeps no QPACK dynamic table for its
clients (SETTINGS_QPACK_MAX_TABLE_CAPACITY 0 and QPACK_BLOCKED_STREAMS 0, as quic-go): with
one, a byte of a header block stands for an entry of up to 4 KB, and 16 KiB of block decoded
to 64 MB (43 ms of CPU in the decoder alone, a core held by a client sending 400 KB/s); and a
request whose HEADERS refer to an entry not yet received waits ("blocked") while aioquic
appends everything sent on it, with the same copying. A client that inserts an entry anyway
ends its connection with QPACK_ENCODER_STREAM_ERROR, one that refers to one with
QPACK_DECOMPRESSION_FAILED (RFC 9204 §2.1.2, §4.3.1).

A client can make the listener parse what carries nothing, without bound and at 2 to 25 µs a
piece: frames of unknown or reserved types (PRIORITY_UPDATE among them) on the control stream
or a request's, DATA frames of a byte or none, request streams ended before any HEADERS,
unidirectional streams of unknown types. Two bytes a frame, one client held a core with 1 MB/s,
40 times the CPU its bytes cost as a request body. They are counted together and weighed
against the requests as HTTP/2's control frames are (`caps.floods_control`): past 1,000, and
more than ten a request, the connection ends with H3_EXCESSIVE_LOAD and `flooded` is set.

Each change overrides a private ``H3Connection`` hook, listed with the rest in
``transport.aioquic_private``.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import (
    ErrorCode,
    FrameType,
    H3Connection,
    H3Stream,
    MessageError,
    ProtocolError,
    StreamType,
    encode_frame,
    stream_is_request_response,
)
from aioquic.h3.events import H3Event, Headers
from aioquic.quic.connection import QuicConnection

from transport.aioquic_private import (
    forget_h3_stream,
    h3_stream,
    head_received,
    local_control_stream_id,
    peer_control_stream,
    refuse_qpack_table,
)
from transport.caps import CONTROL_FRAMES_FREE, floods_control

MAX_CONTROL_FRAME = 16 * 1024
"""Bytes of a SETTINGS or MAX_PUSH_ID frame (a handful of varints each) the listener reads."""
SMALL_DATA = 64
"""A DATA frame with fewer bytes than this is counted with the frames that carry nothing: it
costs the listener what an empty one does, and a body sent in them 3 to 40 times what the same
bytes cost in large frames."""
_HEADERS = int(FrameType.HEADERS)
_DATA = int(FrameType.DATA)
_KNOWN_UNI_STREAMS = frozenset(
    int(kind)
    for kind in (
        StreamType.CONTROL, StreamType.PUSH, StreamType.QPACK_ENCODER, StreamType.QPACK_DECODER
    )
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class StreamFailed:
    """A request stream the connection refused before the application saw it."""

    stream_id: int
    status: int | None
    """HTTP status to answer with, or None when the stream was reset."""
    reason: str


class _HeaderBlockTooLarge(Exception):
    pass


class ControlFrameTooLarge(ProtocolError):
    """A control-stream frame the connection would have to buffer whole, over the bound."""

    error_code = ErrorCode.H3_EXCESSIVE_LOAD


class FrameFlood(ProtocolError):
    """Frames that carry nothing, out of all proportion to the requests (`caps.floods_control`)."""

    error_code = ErrorCode.H3_EXCESSIVE_LOAD


class StreamConfinedH3Connection(H3Connection):
    """A server-side H3Connection that answers bad requests with a stream error."""

    def __init__(self, quic: QuicConnection, *, max_header_bytes: int) -> None:
        super().__init__(quic)
        self._connection = quic  # aioquic's own reference (`_quic`) is private
        self._serving = not quic.configuration.is_client
        self._failed: set[int] = set()
        self._max_header_bytes = max_header_bytes
        self.failed_streams: list[StreamFailed] = []
        """Streams refused since the caller last drained this list."""
        self._idle = 0  # frames (and streams) received that carry nothing
        self._heads = 0  # HEADERS frames received on request streams
        self.flooded = False
        """The connection was closed for frames that carry nothing (`FrameFlood`)."""

    def head_pending(self, stream_id: int) -> bool:
        """Whether a request stream has started but its HEADERS are still to come (not
        refused, not forgotten)."""
        stream = h3_stream(self, stream_id)
        return stream is not None and stream_id not in self._failed and not head_received(stream)

    def stop_reading(self, stream_id: int, error_code: int) -> None:
        """Ask the peer to stop sending (STOP_SENDING) and ignore whatever still arrives."""
        self._failed.add(stream_id)
        stream = h3_stream(self, stream_id)
        if stream is not None:
            stream.buffer = b""
            stream.frame_size = None
            stream.frame_type = None
        try:
            self._connection.stop_stream(stream_id, error_code)
        except ValueError:
            pass  # the receiving side is already finished and discarded

    def abort_stream(self, stream_id: int, error_code: int) -> None:
        """Reset our side (RESET_STREAM) and stop reading the peer's."""
        self.stop_reading(stream_id, error_code)
        self._connection.reset_stream(stream_id, error_code)
        stream = h3_stream(self, stream_id)
        if stream is not None:
            stream.sending_ended = True

    def send_goaway(self, stream_id: int) -> None:
        """GOAWAY on our control stream (RFC 9114 §5.2, §7.2.6); aioquic has no API for it."""
        control = local_control_stream_id(self)
        assert control is not None
        self._connection.send_stream_data(
            control,
            encode_frame(FrameType.GOAWAY, encode_uint_var(stream_id)),
        )

    def forget(self, stream_id: int) -> None:
        """Drop all state of a finished stream."""
        self._failed.discard(stream_id)
        forget_h3_stream(self, stream_id)

    def _idle_frame(self) -> None:
        """One more frame (or stream) that carries nothing: past the free ones, weighed against
        the requests."""
        self._idle += 1
        if self._idle > CONTROL_FRAMES_FREE and floods_control(self._idle, self._heads):
            self.flooded = True
            raise FrameFlood(f"{self._idle} frames that carry nothing, {self._heads} requests")

    def _init_connection(self) -> None:
        refuse_qpack_table(self)  # before the settings go out
        super()._init_connection()

    def _receive_stream_data_uni(
        self, stream: H3Stream, data: bytes, stream_ended: bool
    ) -> list[H3Event]:
        typed = stream.stream_type is not None
        events = super()._receive_stream_data_uni(stream, data, stream_ended)
        if not typed and self._serving and stream.stream_type is not None:
            if stream.stream_type not in _KNOWN_UNI_STREAMS:
                self._idle_frame()  # a stream whose bytes are all discarded
        return events

    def _abort_incomplete_request(self, stream_id: int) -> None:
        if self._serving:
            self._idle_frame()  # a request stream that ended, or was reset, before its HEADERS
        super()._abort_incomplete_request(stream_id)

    def _check_control_frame_type(self, frame_type: int) -> None:
        super()._check_control_frame_type(frame_type)
        if self._serving:
            self._idle_frame()  # what a client sends here is SETTINGS, then next to nothing
        if frame_type in (FrameType.SETTINGS, FrameType.MAX_PUSH_ID):
            control = peer_control_stream(self)
            size = None if control is None else control.frame_size
            if size is not None and size > MAX_CONTROL_FRAME:
                raise ControlFrameTooLarge(f"control frame of {size} bytes")

    def _receive_request_or_push_data(
        self, stream: H3Stream, data: bytes, stream_ended: bool
    ) -> list[H3Event]:
        if stream.stream_id in self._failed:
            if stream_ended:
                stream.receiving_ended = True
            return []
        try:
            return super()._receive_request_or_push_data(stream, data, stream_ended)
        except _HeaderBlockTooLarge:
            self.stop_reading(stream.stream_id, ErrorCode.H3_EXCESSIVE_LOAD)
            self.failed_streams.append(
                StreamFailed(stream.stream_id, 431, "request header block too large")
            )
            return []

    def _decode_headers(self, stream_id: int, frame_data: bytes | None) -> Headers:
        headers = super()._decode_headers(stream_id, frame_data)
        if self._serving:
            # Counted as RFC 9114 §4.2.2 counts it, before aioquic checks every byte of every
            # field in Python (~30 ns a byte): QPACK can make 16 KiB of block decode to
            # megabytes, and a 431 should not cost that check first.
            size = 0
            for name, value in headers:
                size += len(name) + len(value) + 32
            if size > self._max_header_bytes:
                raise _HeaderBlockTooLarge
        return headers

    def _check_request_or_push_frame_type(self, frame_type: int, stream: H3Stream) -> None:
        super()._check_request_or_push_frame_type(frame_type, stream)
        if not self._serving:
            return
        size = stream.frame_size  # read with the type: never None here
        if frame_type == _HEADERS:
            self._heads += 1
            if size is not None and size > self._max_header_bytes:
                # The encoded block is never larger than the decoded field section, so this
                # refuses only requests that are over the limit anyway.
                raise _HeaderBlockTooLarge
        elif frame_type != _DATA or (size is not None and size < SMALL_DATA):
            self._idle_frame()

    def _handle_request_or_push_frame(
        self,
        frame_type: int,
        frame_data: bytes | None,
        stream: H3Stream,
        stream_ended: bool,
    ) -> list[H3Event]:
        if stream.stream_id in self._failed:
            return []
        try:
            return super()._handle_request_or_push_frame(
                frame_type, frame_data, stream, stream_ended
            )
        except MessageError as exc:
            if not self._serving or not stream_is_request_response(stream.stream_id):
                raise
            # RFC 9114 §4.1.2: a malformed request is a stream error H3_MESSAGE_ERROR.
            self.abort_stream(stream.stream_id, ErrorCode.H3_MESSAGE_ERROR)
            self.failed_streams.append(StreamFailed(stream.stream_id, None, exc.reason_phrase))
            return []
