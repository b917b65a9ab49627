"""An h2 server connection whose request `content-length` errors belong to the stream.

RFC 9113 §8.1.1 makes a request malformed when its `content-length` is not a number, is given
twice with different values, or differs from the length of the body that arrives; a malformed
request is a stream error. h2 4.x raises each of these out of `receive_data`, in its loop over
the frames of one read, where the caller cannot tell it from an error of the whole connection
(hypercorn then ends the connection, and every other request on it). On a connection a proxy
in front shares among many users, one client's bad request would cut everyone's answers.

Here the stream records what is wrong (`body_length_error`) instead of raising, and the
protocol (`transport.hypercorn_h2`) resets that stream with PROTOCOL_ERROR. h2 also accepts a
request that ends with its headers while its `content-length` promises a body; that is
recorded too. The checks stay h2's own: this module only moves where their verdict goes.

h2 builds its streams in one private method, `_begin_new_stream`; the connection hypercorn
built gets this class (`adopt`), and each stream it begins gets `_LengthCheckedStream`. Both
keep h2's state as it is, adding one attribute. The methods overridden are private to h2 (the
same since h2 3); `tests/transport/test_h2_malformed.py` fails if their behaviour moves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import h2.connection
import h2.exceptions
import h2.stream
from hpack.struct import Header


class _LengthCheckedStream(h2.stream.H2Stream):
    """An h2 stream that records a body-length error instead of raising it."""

    body_length_error: str | None = None
    """Why the request's `content-length` is wrong (None: nothing wrong seen so far)."""

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


class LengthCheckedConnection(h2.connection.H2Connection):
    """An h2 connection whose streams record body-length errors (`body_length_error()`)."""

    def _begin_new_stream(
        self, stream_id: int, allowed_ids: h2.connection.AllowedStreamIDs
    ) -> h2.stream.H2Stream:
        stream = super()._begin_new_stream(stream_id, allowed_ids)
        stream.__class__ = _LengthCheckedStream  # same state, one more attribute
        return stream


def body_length_error(connection: h2.connection.H2Connection, stream_id: int) -> str | None:
    """What is wrong with the `content-length` of a request on an adopted connection, if
    anything."""
    return getattr(connection.streams.get(stream_id), "body_length_error", None)


def adopt(connection: h2.connection.H2Connection) -> None:
    """Make `connection`, as built and configured by its owner, begin checked streams. Call
    before it has received anything."""
    assert not connection.streams, "adopt a connection before it has streams"
    connection.__class__ = LengthCheckedConnection


__all__ = ["LengthCheckedConnection", "adopt", "body_length_error"]
