"""An h2 server connection whose request errors belong to the stream, not the connection.

RFC 9113 makes each of these a stream error, and h2 4.x raises each as an error of the whole
connection, in its loop over the frames of one read, where the caller cannot tell one from the
other (hypercorn then ends the connection, and every other request on it). On a connection a
proxy in front shares among many users, one client's bad request would cut everyone's answers.

- **A wrong `content-length`** (§8.1.1): not a number, given twice with two values, or not the
  length of the body that arrives. The stream records what is wrong (`body_length_error`)
  instead of raising, and the protocol (`transport.hypercorn_h2`) resets it with
  PROTOCOL_ERROR. h2 also accepts a request that ends with its headers while its
  `content-length` promises a body; that is recorded too.
- **A header list over the advertised size** (`SETTINGS_MAX_HEADER_LIST_SIZE`, §10.5.1): h2's
  HPACK decoder stopped at that size, mid-block, after which the table could no longer be
  trusted and only the connection could end (GOAWAY ENHANCE_YOUR_CALM, every answer on it
  lost). The decoder (`_DroppingDecoder`) now decodes the whole block, keeping the table in
  step, and drops the fields past that size; the request is answered 431 on its own stream
  (`header_list_over`). Decoding is slow in Python (a field of one byte, an index, costs
  microseconds), so past `DECODE_FACTOR` times the advertised size (1 MiB by default, about
  the most h2 buffers of a block: 64 frames of 16 KiB) the connection still ends.
  Each literal field is decoded from its own bytes: hpack copied the rest of the block for
  each, which made a block of many small fields cost its size squared.
- **A stream past the advertised limit** (§5.1.2): its HEADERS are decoded all the same (the
  HPACK state must stay in step with the client's) and the stream is refused with
  REFUSED_STREAM, which tells the client to send it again. A client may open more streams
  than the limit before it has read the server's SETTINGS (the initial limit is unlimited), and
  101 requests in a first flight ended the connection with none of them answered.

h2 builds its streams in one private method, `_begin_new_stream`, and dispatches frames
through a table of bound methods it makes when the connection is made; the connection
hypercorn built gets this class and that table's HEADERS entry (`adopt`), and each stream it
begins gets `_LengthCheckedStream`. Both keep h2's state as it is, adding one attribute. The
methods overridden are private to h2 (the same since h2 3); `tests/transport/test_h2_malformed.py`
fails if their behaviour moves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import h2.connection
import h2.errors
import h2.exceptions
import h2.stream
from hpack import Decoder
from hpack.exceptions import OversizedHeaderListError
from hpack.hpack import decode_integer
from hpack.struct import Header, HeaderTuple
from hpack.table import table_entry_size
from hyperframe.frame import HeadersFrame, RstStreamFrame

DECODE_FACTOR = 16
"""Times the advertised header list size a block may decode to before the connection ends
(below it, a list over the advertised size is refused on its stream alone)."""


class _DroppingDecoder(Decoder):
    """hpack's decoder, which drops the fields of a block past `max_header_list_size` instead
    of raising there (the block is decoded whole, so the dynamic table stays in step with the
    client's) and records it in `over`; past `DECODE_FACTOR` times that size it raises."""

    over = False
    """The last block decoded was over `max_header_list_size`: fields were dropped."""

    _size = 0
    """What the block decoded so far counts (RFC 7541 §4.1)."""

    def decode(self, data: bytes, raw: bool = False) -> list[HeaderTuple]:
        self.over = False
        self._size = 0
        return super().decode(data, raw)  # type: ignore[return-value]

    def _kept(self, header: HeaderTuple, consumed: int) -> tuple[HeaderTuple | None, int]:
        """`header`, or None (hpack then neither keeps nor counts it) past the limit."""
        self._size += table_entry_size(header[0], header[1])
        if self._size <= self.max_header_list_size:
            return header, consumed
        if self._size > DECODE_FACTOR * self.max_header_list_size:
            raise OversizedHeaderListError(
                f"a header list over {DECODE_FACTOR * self.max_header_list_size} bytes"
            )
        self.over = True
        return None, consumed

    def _decode_indexed(self, data: bytes | memoryview) -> tuple[HeaderTuple, int]:
        return self._kept(*super()._decode_indexed(data))  # type: ignore[return-value]

    def _decode_literal(
        self, data: bytes | memoryview, should_index: bool
    ) -> tuple[HeaderTuple, int]:
        # hpack copies `data`, the rest of the block, for each literal: only its own bytes here.
        header, consumed = super()._decode_literal(
            data[: _literal_length(data, should_index)], should_index
        )
        return self._kept(header, consumed)  # type: ignore[return-value]


def _literal_length(data: bytes | memoryview, should_index: bool) -> int:
    """The encoded length of the literal field `data` begins with (RFC 7541 §6.2): its name's
    index or string, then its value's string; the lengths are HPACK integers."""
    name_index, end = decode_integer(data, 6 if should_index else 4)
    if not name_index:  # a literal name: its length, then its bytes
        length, used = decode_integer(data[end:], 7)
        end += used + length
    length, used = decode_integer(data[end:], 7)
    return end + used + length


class _LengthCheckedStream(h2.stream.H2Stream):
    """An h2 stream that records a body-length error instead of raising it."""

    body_length_error: str | None = None
    """Why the request's `content-length` is wrong (None: nothing wrong seen so far)."""

    header_list_over = False
    """The request's header list was over the advertised size: fields were dropped."""

    def receive_headers(
        self, headers: Iterable[Header], end_stream: bool, header_encoding: bool | str | None
    ) -> tuple[list[Any], list[Any]]:
        result = super().receive_headers(headers, end_stream, header_encoding)
        if end_stream:
            self._track_content_length(0, end_stream=True)  # h2 checks this only on DATA
        return result

    def _initialize_content_length(self, headers: Iterable[Header]) -> None:
        try:
            super()._initialize_content_length(headers)
        except h2.exceptions.ProtocolError as exc:
            self.body_length_error = str(exc)
            self._expected_content_length = None

    def _track_content_length(self, length: int, end_stream: bool) -> None:
        try:
            super()._track_content_length(length, end_stream)
        except h2.exceptions.InvalidBodyLengthError as exc:
            self.body_length_error = str(exc)
            self._expected_content_length = None  # said once is enough


class StreamErrorConnection(h2.connection.H2Connection):
    """An h2 connection whose streams record body-length errors (`body_length_error()`) and
    that refuses a stream past its limit instead of ending."""

    def _begin_new_stream(
        self, stream_id: int, allowed_ids: h2.connection.AllowedStreamIDs
    ) -> h2.stream.H2Stream:
        stream = super()._begin_new_stream(stream_id, allowed_ids)
        stream.__class__ = _LengthCheckedStream  # same state, one more attribute
        return stream

    def _receive_headers_frame(self, frame: HeadersFrame) -> tuple[list[Any], list[Any]]:
        try:
            result = super()._receive_headers_frame(frame)
        except h2.exceptions.TooManyStreamsError:
            pass  # raised before anything was decoded or changed
        else:
            stream = self.streams.get(frame.stream_id)
            if getattr(self.decoder, "over", False) and isinstance(stream, _LengthCheckedStream):
                stream.header_list_over = True
            return result
        stream_id = frame.stream_id
        if stream_id % 2 == 0 or stream_id <= self.highest_inbound_stream_id:
            raise h2.exceptions.ProtocolError(f"invalid stream ID {stream_id} for a request")
        h2.connection._decode_headers(self.decoder, frame.data)
        self.highest_inbound_stream_id = stream_id  # what still comes on it: a closed stream
        self._prepare_for_sending(
            [RstStreamFrame(stream_id, error_code=h2.errors.ErrorCodes.REFUSED_STREAM)]
        )
        return [], []


def body_length_error(connection: h2.connection.H2Connection, stream_id: int) -> str | None:
    """What is wrong with the `content-length` of a request on an adopted connection, if
    anything."""
    return getattr(connection.streams.get(stream_id), "body_length_error", None)


def header_list_over(connection: h2.connection.H2Connection, stream_id: int) -> bool:
    """Whether the header list of a request on an adopted connection was over the size the
    connection advertised (each field its name, value and 32 bytes, as HPACK counts it:
    RFC 7541 §4.1); the fields past it were dropped."""
    return getattr(connection.streams.get(stream_id), "header_list_over", False)


def adopt(connection: h2.connection.H2Connection) -> None:
    """Make `connection`, as built and configured by its owner, a `StreamErrorConnection`. Call
    before it has received anything."""
    assert not connection.streams, "adopt a connection before it has streams"
    connection.__class__ = StreamErrorConnection
    table = connection._frame_dispatch_table  # bound when h2 made the connection
    table[HeadersFrame] = connection._receive_headers_frame
    connection.decoder.__class__ = _DroppingDecoder
    advertised = connection.local_settings.max_header_list_size
    if advertised is not None:  # else h2's default, 64 KiB; h2 updates it if it changes
        connection.decoder.max_header_list_size = advertised


__all__ = ["StreamErrorConnection", "adopt", "body_length_error", "header_list_over"]
