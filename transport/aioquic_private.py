"""Every private aioquic attribute quicedge relies on, and the one place that touches them.

aioquic has no public API for a few things the transport needs (a MAX_STREAMS limit, a stream's
unacknowledged bytes, GOAWAY, stream errors for malformed requests, a shared Retry key, a
configuration swapped on certificate reload). The code reaches into aioquic's internals only
through the functions here, `pyproject.toml` pins aioquic to the minor version these were checked
against, and `tests/transport/test_aioquic_private.py` checks each name in `ATTRIBUTES` on the
installed aioquic, so an upgrade that renames one fails there, in one test, rather than deep
inside a request. Each entry says what an upstream API would replace it with.

`aioquic_patches.py` changes a few of aioquic's own objects, once, to cut per-connection and
per-packet work; `PATCHED` lists them, and `tests/transport/test_aioquic_patches.py` checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pylsqpack
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import H3Connection, H3Stream, HeadersState
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketRecovery
from aioquic.quic.retry import QuicRetryTokenHandler
from aioquic.quic.stream import QuicStream, QuicStreamSender
from cryptography.hazmat.primitives.ciphers.aead import AESGCM


@dataclass(frozen=True, slots=True)
class Private:
    """One attribute of an aioquic class that quicedge reads, writes or overrides."""

    owner: type
    name: str
    upstream: str
    """The public API that would make this entry unnecessary."""


ATTRIBUTES: tuple[Private, ...] = (
    Private(QuicConnection, "_local_max_streams_bidi",
            "a QuicConfiguration field for the initial MAX_STREAMS (bidi) credit"),
    Private(QuicConnection, "_local_active_connection_id_limit",
            "a QuicConfiguration field for active_connection_id_limit"),
    Private(QuicConnection, "_remote_active_connection_id_limit", "as above"),
    Private(QuicConnection, "_host_cids", "as above"),
    Private(QuicConnection, "_host_cid_seq", "as above"),
    Private(QuicConnection, "_streams", "a per-stream query of unacknowledged send bytes"),
    Private(QuicConnection, "_retry_count", "HandshakeCompleted saying whether Retry happened"),
    Private(QuicConnection, "_loss", "a QuicConfiguration field for the initial congestion window"),
    Private(QuicPacketRecovery, "_cc", "as for QuicConnection._loss"),
    Private(QuicPacketRecovery, "_pacer", "QuicPacketPacer.update_after_send taking the size"),
    Private(QuicPacketBuilder, "_buffer", "as for QuicPacketRecovery._pacer"),
    Private(QuicPacketBuilder, "_packet_start", "as for QuicPacketRecovery._pacer"),
    Private(QuicConnection, "_network_paths", "a server-side NEW_TOKEN validation API"),
    Private(QuicConnection, "_local_initial_source_connection_id",
            "a connection-ID generator on QuicConfiguration"),
    Private(QuicConnection, "_peer_cid",
            "stateless reset detection in receive_datagram (RFC 9000 §10.3.1)"),
    Private(QuicConnection, "_state", "as for QuicConnection._peer_cid"),
    Private(QuicConnection, "_close_event", "as for QuicConnection._peer_cid"),
    Private(QuicConnection, "_close_begin", "as for QuicConnection._peer_cid"),
    Private(QuicConnection, "_local_max_data",
            "MAX_DATA raised by the bytes delivered in order, in aioquic itself"),
    Private(QuicStream, "sender", "as for QuicConnection._streams"),
    Private(QuicStream, "receiver", "MAX_STREAM_DATA raised by the bytes delivered in order"),
    Private(QuicStreamSender, "_buffer", "as for QuicConnection._streams"),
    Private(QuicConnection, "_remote_max_idle_timeout",
            "a max_idle_timeout of 0 taken as none in QuicConnection._idle_timeout"),
    Private(QuicConnection, "_configuration", "as for QuicConnection._remote_max_idle_timeout"),
    Private(QuicStreamSender, "_reset_error_code",
            "a query of whether a connection's requests are all answered and acknowledged"),
    Private(QuicConnectionProtocol, "_connection_id_issued_handler",
            "connection IDs routed by the server as they are made, not once their frame is sent"),
    Private(QuicConnectionProtocol, "_process_events",
            "a hook to choose when datagram_received transmits (it always transmits at once)"),
    Private(QuicServer, "_protocols", "a public view of the server's connections"),
    Private(QuicServer, "_configuration", "a setter for the configuration of new connections"),
    Private(QuicServer, "_retry", "a retry token handler argument to QuicServer / serve()"),
    Private(QuicRetryTokenHandler, "_aead", "a key argument to QuicRetryTokenHandler"),
    Private(H3Connection, "_stream", "a per-stream state query and a way to discard one"),
    Private(H3Connection, "_local_control_stream_id", "H3Connection.send_goaway()"),
    Private(H3Connection, "_receive_request_or_push_data",
            "a header size limit setting (RFC 9114 §4.2.2) and stream-level request errors"),
    Private(H3Connection, "_check_request_or_push_frame_type", "as above"),
    Private(H3Connection, "_decode_headers", "as above"),
    Private(H3Connection, "_handle_request_or_push_frame",
            "malformed requests as stream errors (RFC 9114 §4.1.2), not connection errors"),
    Private(H3Connection, "_check_control_frame_type",
            "a bound on the control-stream frames H3Connection buffers whole"),
    Private(H3Connection, "_peer_control_stream_id", "as above"),
    Private(H3Connection, "_receive_stream_data_uni",
            "a bound on the frames and streams that carry nothing a connection reads"),
    Private(H3Connection, "_abort_incomplete_request", "as above"),
    Private(H3Stream, "stream_type", "as above"),
    Private(H3Connection, "_init_connection",
            "QPACK_MAX_TABLE_CAPACITY and QPACK_BLOCKED_STREAMS arguments to H3Connection"),
    Private(H3Connection, "_is_client", "as above"),
    Private(H3Connection, "_blocked_streams", "as above"),
    Private(H3Connection, "_max_table_capacity", "as above"),
    Private(H3Connection, "_decoder", "as above"),
    Private(H3Stream, "headers_recv_state", "a per-stream query: has its HEADERS arrived"),
    Private(H3Stream, "buffer", "a way to stop reading a request stream (STOP_SENDING)"),
    Private(H3Stream, "frame_size", "as for H3Connection._receive_request_or_push_data"),
    Private(H3Stream, "frame_type", "as for H3Stream.buffer"),
    Private(H3Stream, "sending_ended", "H3Connection resetting a stream itself"),
    Private(H3Stream, "receiving_ended", "as for H3Stream.buffer"),
)  # fmt: skip

PATCHED: tuple[tuple[str, str, str], ...] = (
    ("aioquic.quic.connection", "EPOCHS", "memoized: one frozenset per epoch string, shared"),
    ("aioquic.tls", "Epoch.__hash__", "the identity hash (Epoch is a plain Enum)"),
    ("aioquic.tls", "pull_block", "a class with the same steps, not a @contextmanager generator"),
    ("aioquic.tls", "push_block", "as for pull_block"),
    ("aioquic.tls", "push_extension", "as for pull_block"),
    ("aioquic.tls", "push_message", "as for pull_block"),
    ("aioquic.quic.connection", "QuicConnection._replenish_connection_ids",
     "issues no more connection IDs than the connection's own active_connection_id_limit;"
     " the connection's own IDs and derived reset tokens, each ID routed as it is made"),
    ("aioquic.quic.connection", "QuicConnection._write_new_connection_id_frame",
     "aioquic's own, remembering the highest sequence number sent"),
    ("aioquic.quic.connection", "QuicConnection._handle_retire_connection_id_frame",
     "aioquic's own, after a check that the ID retired was sent (RFC 9000 §19.16)"),
    ("aioquic.tls", "Context._server_handle_hello",
     "reads certificate.public_bytes(DER): given pre-encoded certificates"),
    ("aioquic.quic.recovery", "QuicPacketPacer",
     "BytePacer: charged by each packet's bytes, a burst of up to 10 datagrams"),
    ("aioquic.quic.connection", "QuicConnection._write_application",
     "aioquic's own, with the pacer told the packet builder"),
    ("aioquic.quic.connection", "QuicConnection._write_handshake_done_frame",
     "aioquic's own, then a NEW_TOKEN frame where the connection has a token to send"),
    ("aioquic.quic.connection", "QuicConnection.receive_datagram",
     "aioquic's own, after a check for a stateless reset (draining if it is one)"),
    ("aioquic.quic.connection", "QuicConnection._write_stream_limits",
     "the window doubled by the offset delivered in order; aioquic's own writes the frame"),
    ("aioquic.quic.connection", "QuicConnection._write_connection_limits",
     "aioquic's own, shown the bytes delivered in order as MAX_DATA's used credit"),
    ("aioquic.quic.connection", "MAX_PENDING_CRYPTO", "16 KiB, not 512 KiB"),
    ("aioquic.tls", "Context.handle_message",
     "aioquic's own, on a server's engine once it took at most 16 KiB from its client"),
    ("aioquic.quic.connection", "QuicConnection._idle_timeout",
     "aioquic's own, where the peer's max_idle_timeout of 0 is none, not the smaller"),
)  # fmt: skip
"""What `aioquic_patches` changes: (module, name, how)."""

H3_HOOK_PARAMETERS: dict[str, tuple[str, ...]] = {
    "_init_connection": ("self",),
    "_receive_stream_data_uni": ("self", "stream", "data", "stream_ended"),
    "_abort_incomplete_request": ("self", "stream_id"),
    "_check_control_frame_type": ("self", "frame_type"),
    "_receive_request_or_push_data": ("self", "stream", "data", "stream_ended"),
    "_check_request_or_push_frame_type": ("self", "frame_type", "stream"),
    "_decode_headers": ("self", "stream_id", "frame_data"),
    "_handle_request_or_push_frame": ("self", "frame_type", "frame_data", "stream", "stream_ended"),
}
"""The private H3Connection methods `StreamConfinedH3Connection` overrides, with the parameters
it calls them with: a renamed hook would silently stop being called, so the test checks both."""


# QuicConnection


def set_max_streams_bidi(quic: QuicConnection, limit: int) -> None:
    """The initial MAX_STREAMS (bidi) credit, before the transport parameters are sent."""
    quic._local_max_streams_bidi.value = limit
    quic._local_max_streams_bidi.sent = limit


def set_active_connection_id_limit(quic: QuicConnection, limit: int) -> None:
    """How many connection IDs the peer may have us hold, and (with `aioquic_patches`) how many
    we issue to it, at most: set before the transport parameters are sent (RFC 9000 §5.1.1)."""
    quic._local_active_connection_id_limit = limit


def set_initial_congestion_window(quic: QuicConnection, datagrams: int) -> None:
    """The congestion window a connection starts with, in datagrams of its size: set before it
    sends (aioquic starts every connection at 10)."""
    quic._loss._cc.congestion_window = datagrams * quic.configuration.max_datagram_size


def unacked_bytes(quic: QuicConnection, stream_id: int) -> int:
    """Bytes the stream's sender holds: written and not yet acknowledged (0: no such stream)."""
    stream = quic._streams.get(stream_id)
    return len(stream.sender._buffer) if stream is not None else 0


def answering(quic: QuicConnection) -> bool:
    """Whether a client's request stream still waits for its answer: one neither sent whole
    and acknowledged, with its FIN, nor reset from this side (a closing connection answers
    nothing more). Unidirectional streams (control, QPACK) are not requests."""
    return quic._close_event is None and any(
        stream_id % 4 == 0  # client-initiated, bidirectional (RFC 9000 §2.1)
        and not stream.sender.is_finished
        and stream.sender._reset_error_code is None
        for stream_id, stream in quic._streams.items()
    )


def peer_reset_token(quic: QuicConnection) -> bytes | None:
    """The stateless reset token of the connection ID this connection sends to (None: the peer
    gave none), for a client that checks for resets itself (RFC 9000 §10.3.1)."""
    return quic._peer_cid.stateless_reset_token


def retry_count(quic: QuicConnection) -> int:
    """How many Retry packets a client connection answered."""
    return quic._retry_count


# QuicConnectionProtocol


def process_events(protocol: QuicConnectionProtocol) -> None:
    """Deliver the connection's pending events to `quic_event_received`, without transmitting."""
    protocol._process_events()


# QuicServer


def server_protocols(server: QuicServer) -> list[QuicConnectionProtocol]:
    """The server's connection protocols, one entry per connection ID (so repeats)."""
    return list(server._protocols.values())


def route_connection_id(protocol: QuicConnectionProtocol, connection_id: bytes) -> None:
    """Have the server send this connection's datagrams for `connection_id` to `protocol` (what
    aioquic does when it processes the ConnectionIdIssued event, later)."""
    protocol._connection_id_issued_handler(connection_id)


def has_connection(server: QuicServer, connection_id: bytes) -> bool:
    """Whether a datagram for this destination connection ID belongs to a known connection."""
    return connection_id in server._protocols


def connection_for(server: QuicServer, connection_id: bytes) -> QuicConnectionProtocol | None:
    """The connection a datagram for this destination connection ID goes to, if any."""
    return server._protocols.get(connection_id)


def server_configuration(server: QuicServer) -> QuicConfiguration:
    """The configuration new connections get."""
    return server._configuration


def set_server_configuration(server: QuicServer, configuration: QuicConfiguration) -> None:
    """New connections take `configuration`; live ones keep theirs."""
    server._configuration = configuration


def set_retry_handler(server: QuicServer, handler: QuicRetryTokenHandler | None) -> None:
    """Mint and check Retry tokens with `handler` (the server must be created with retry=True);
    None: no Retry for the connections made until it is set again."""
    cast(Any, server)._retry = handler


def retry_handler(server: QuicServer) -> QuicRetryTokenHandler | None:
    """The server's Retry token handler (None: Retry is off)."""
    return server._retry


def mark_address_validated(quic: QuicConnection) -> None:
    """The client's address is proven (a valid address token): no anti-amplification limit on
    the connection's path. Call it after the first datagram, before the first transmit; a first
    datagram aioquic dropped before it made the path leaves nothing to validate."""
    for path in quic._network_paths[:1]:
        path.is_validated = True


def set_retry_key(handler: QuicRetryTokenHandler, aead: AESGCM) -> None:
    """Seal Retry tokens with `aead` instead of the handler's random per-process key."""
    handler._aead = aead


# H3Connection


def h3_stream(h3: H3Connection, stream_id: int) -> H3Stream | None:
    """The HTTP/3 layer's state of a stream, if it has any."""
    return h3._stream.get(stream_id)


def forget_h3_stream(h3: H3Connection, stream_id: int) -> None:
    """Drop the HTTP/3 layer's state of a finished stream."""
    h3._stream.pop(stream_id, None)


def local_control_stream_id(h3: H3Connection) -> int | None:
    """Our control stream, where GOAWAY goes (None before the connection is set up)."""
    return h3._local_control_stream_id


def peer_control_stream(h3: H3Connection) -> H3Stream | None:
    """The peer's control stream, once it is open."""
    stream_id = h3._peer_control_stream_id
    return None if stream_id is None else h3._stream.get(stream_id)


def refuse_qpack_table(h3: H3Connection) -> None:
    """Allow the peer neither a QPACK dynamic table nor a blocked stream
    (SETTINGS_QPACK_MAX_TABLE_CAPACITY 0, SETTINGS_QPACK_BLOCKED_STREAMS 0) on a server
    connection; call from `_init_connection`, before the settings are sent."""
    if not h3._is_client:
        h3._max_table_capacity = 0
        h3._blocked_streams = 0
        h3._decoder = pylsqpack.Decoder(0, 0)


def head_received(stream: H3Stream) -> bool:
    """Whether the stream's HEADERS frame has been read."""
    return stream.headers_recv_state is not HeadersState.INITIAL
