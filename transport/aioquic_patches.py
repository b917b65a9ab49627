"""Changes to aioquic's per-connection and per-packet work, and to its pacer, made once when
this module is imported, for the aioquic version `pyproject.toml` pins (`aioquic_private.py`
lists what they touch, and `tests/transport/test_aioquic_patches.py` checks that each still
applies and keeps aioquic's behaviour).

``tools.h3_handshake_cpu`` showed where a handshake's CPU goes; these remove the part of it that is
repeated work rather than protocol work:

- **Frame-handler epochs.** ``QuicConnection.__init__`` builds its frame table with 34 calls of
  ``EPOCHS("IH01")``-style helpers, each a new frozenset of ``Epoch`` members: about 90 µs per
  connection for 34 constant sets. ``EPOCHS`` is memoized, so every connection shares them.
  *Upstream:* build the table of epochs once at module level.
- **Epoch hashing.** ``tls.Epoch`` is a plain ``Enum``, whose ``__hash__`` is a Python function
  (``hash(self._name_)``); aioquic looks epochs up in dicts and sets for every packet and every
  frame (``_cryptos[epoch]``, ``_spaces[epoch]``, ``epoch in frame_epochs``), ~80 ns each more
  than an int key. Enum members are singletons compared by identity, so the identity hash is
  exact; it is installed only if no connection exists yet (a value hashed the old way would not
  be found again), which holds when this module is imported before any connection is made:
  `transport.h3_server` imports it first. *Upstream:* ``Epoch(IntEnum)``, or plain ints.
- **TLS message framing.** aioquic's TLS engine writes and reads every length-prefixed block,
  extension and handshake message through ``@contextmanager`` generators (``push_block``,
  ``pull_block``, ``push_extension``, ``push_message``: ~60 a handshake), each a generator plus
  a ``contextlib`` wrapper. They are replaced by small classes that do the same steps, in the
  same order, and likewise skip the closing step when the block raised.
  *Upstream:* the same classes in ``aioquic.tls``.
- **Certificate encoding.** Every full handshake DER-encodes the certificate and its chain again
  (``x.public_bytes(Encoding.DER)`` in ``tls.Context._server_handle_hello``). `pre_encoded`
  wraps the configuration's certificates so that the encoding is done once, at load.
  *Upstream:* ``QuicConfiguration`` keeping the chain's DER.
- **Connection IDs issued.** aioquic issues as many connection IDs as the peer accepts, up to 8,
  and accepts 8: with an aioquic client, 7 NEW_CONNECTION_ID frames each way per connection,
  each parsed, checked and acknowledged, and each issued one an event and a routing entry in the
  server. ``QuicConnection._replenish_connection_ids`` issues no more than the connection's own
  ``active_connection_id_limit`` either (`aioquic_private.set_active_connection_id_limit` lowers
  it per connection), which leaves aioquic's behaviour as it was where that limit is its default.
  A client may retire only an ID it was sent (RFC 9000 §19.16): aioquic checked that the ID
  was made, and makes its replacement at once, so one datagram retiring the IDs made while it
  was read churned hundreds. ``_handle_retire_connection_id_frame`` refuses one never sent with
  PROTOCOL_VIOLATION (``_write_new_connection_id_frame`` remembers the highest sent).
  *Upstream:* a ``QuicConfiguration.active_connection_id_limit`` for both directions; the
  retirement checked against the IDs sent.
- **Pacing by the bytes sent.** aioquic's pacer charges every packet a full datagram's time and
  lets at most two full datagrams (or a quarter of the congestion window) go at once. A token
  stream is a packet per token of ~100–250 bytes, so at a new connection's window (12,000
  bytes) and a 40 ms RTT, of the tokens written within one millisecond (uvloop's clock moves
  in whole milliseconds, and the bucket refills only when it moves) it let two or three out
  and held the rest ~4 ms (docs/transport.md, "Pacing and the first round trip").
  `BytePacer` charges each packet for its bytes, paces at 1.25 times the window per RTT and
  lets a burst of up to the initial window (10 datagrams) go, as RFC 9002 §7.7 describes and
  quic-go does.
  ``QuicConnection._write_application`` tells it the packet builder, whose current packet it
  measures.
  *Upstream:* ``QuicPacketPacer.update_after_send(now, size)`` and that burst.
- **NEW_TOKEN.** aioquic's server sends no address-validation token (RFC 9000 §8.1.3).
  `send_new_token` gives a server connection one; ``_write_handshake_done_frame`` writes it as
  a NEW_TOKEN frame beside HANDSHAKE_DONE, in the same packet, so that a lost packet sends both
  again (`transport.address_tokens`).
  *Upstream:* a server-side token API on ``QuicConnection``.
- **Stateless resets.** aioquic gives every connection ID a random reset token and neither
  sends nor recognises a stateless reset (RFC 9000 §10.3). `derive_reset_tokens` gives a server
  connection's IDs the tokens of `transport.stateless_reset` (the handshake's ID at once, before
  the transport parameters are written; the rest as ``_replenish_connection_ids`` issues them),
  so that a restarted listener can compute them again. Each new ID is also handed to the
  listener's routing as it is made: aioquic routes it only once the event that the frame
  carrying it was written is processed, at the connection's next datagram or timer, and a
  client that moves to it before then must not find it unknown and get a reset.
  ``QuicConnection.receive_datagram`` first checks whether a short-header datagram ends with
  the token of the connection ID in use, and if so, enters the draining period and sends
  nothing more (§10.3.1): a client of ours learns at once that its server lost the connection,
  instead of after its idle timeout.
  *Upstream:* a reset-token generator on ``QuicConfiguration``, and the receiving side in
  ``receive_datagram``.
- **Receive windows grow with what was delivered.** aioquic doubles a stream's receive window
  (MAX_STREAM_DATA) once the highest offset the peer wrote passes half of it, and the
  connection's (MAX_DATA) once the sum of those highest offsets does, whether or not the bytes
  below were ever sent; and it fills a gap with zeros as the byte past it lands. One byte
  written just under the limit, once a round trip, doubled the memory the stream held each
  time: ten such one-byte frames took a listener from 56 to 569 MB. ``_write_stream_limits``
  and ``_write_connection_limits`` now judge by the bytes delivered in order (those handed to
  HTTP/3). A window then doubles only once half of it was delivered, so what a client's gaps
  can hold stays under its connection's window: the initial 1 MiB, or less than four times
  what it delivered. Bytes delivered count once the app has read them (`UnreadBytes`): an app
  that reads a request body late, or never, holds at most its windows, not every byte each of
  its streams may carry.
  *Upstream:* the same rule in those two methods; the app's reads as ``H3Connection``'s
  consumers acknowledge them (aioquic has no such call).
- **Handshake data held.** aioquic buffers up to 512 KiB of CRYPTO data ahead of what
  it has read, filling the gap with zeros: an Initial datagram of 1,200 bytes whose ClientHello
  claims an offset of 500 KB holds half a megabyte until the idle timeout, from an address
  nobody checked. ``MAX_PENDING_CRYPTO`` is 16 KiB here, as quic-go's limit is (RFC 9000 §7.5
  asks for at least 4,096 bytes); data that arrives in order is never near it.
  Data in order had no bound of its own: aioquic's TLS engine holds a handshake message until
  it is whole, and a message's header may claim 16 MiB, so a client that sent a ClientHello
  claiming that much and then fed it held its connection's CPU, from an unchecked address:
  each CRYPTO frame's bytes are appended to everything held with a copy of it all (4 MiB took
  4.8 s of CPU, 8 MiB 20 s). A server's engine (``tls.Context.handle_message``) now takes at
  most ``MAX_HANDSHAKE_BYTES`` (16 KiB) from its client in all: a ClientHello or two (after a
  HelloRetryRequest) and a Finished are a few kilobytes.
  *Upstream:* a smaller constant, or one on ``QuicConfiguration``; a bound on the handshake
  bytes a server's ``tls.Context`` buffers.
- **A peer without an idle timeout.** A max_idle_timeout of 0 says the peer has none
  (RFC 9000 §18.2), so the connection's own applies (§10.1). aioquic took the smaller of the
  two, 0, raised to three probe timeouts: the listener dropped a connection of such a client,
  silently, after a fraction of a second of quiet on a near network. `_idle_timeout` takes the
  peer's value only where it is above 0.
  *Upstream:* the same test in ``QuicConnection._idle_timeout``.
- **Connection IDs that name their worker.** With several workers, a connection's IDs carry
  its worker's index (`transport.steering`). `make_connection_ids` replaces the handshake's ID
  before aioquic's server routes it and has ``_replenish_connection_ids`` make the rest the same
  way. *Upstream:* a connection-ID generator on ``QuicConfiguration``.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast

from aioquic import tls
from aioquic.buffer import Buffer
from aioquic.quic import connection as quic_connection
from aioquic.quic import recovery
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import (
    END_STATES,
    QuicConnection,
    QuicConnectionError,
    QuicConnectionId,
    QuicErrorCode,
    QuicNetworkPath,
)
from aioquic.quic.events import ConnectionTerminated
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicDeliveryState, QuicPacketBuilder, QuicPacketBuilderStop
from aioquic.quic.stream import QuicStream
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from transport.stateless_reset import STATELESS_RESET, looks_like_reset

log = logging.getLogger("quicedge.transport.aioquic")

ORIGINAL_FRAMING = {
    name: getattr(tls, name)
    for name in ("pull_block", "push_block", "push_extension", "push_message")
}
"""aioquic's own context managers, kept for the test that compares them with ours."""


class _PullBlock:
    """``tls.pull_block``: read a ``capacity``-byte length, then check the block used it all."""

    __slots__ = ("_buf", "_end", "_length")

    def __init__(self, buf: Buffer, capacity: int) -> None:
        self._buf = buf
        self._length = int.from_bytes(buf.pull_bytes(capacity), byteorder="big")
        self._end = buf.tell() + self._length

    def __enter__(self) -> int:
        return self._length

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None and self._buf.tell() != self._end:
            # There was trailing garbage or our parsing was bad.
            raise tls.AlertDecodeError("extra bytes at the end of a block")


class _PushBlock:
    """``tls.push_block``: leave ``capacity`` bytes for the length, write it at the end."""

    __slots__ = ("_buf", "_capacity", "_start")

    def __init__(self, buf: Buffer, capacity: int) -> None:
        self._buf = buf
        self._capacity = capacity
        self._start = buf.tell() + capacity
        buf.seek(self._start)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            return
        buf = self._buf
        end = buf.tell()
        buf.seek(self._start - self._capacity)
        buf.push_bytes((end - self._start).to_bytes(self._capacity, byteorder="big"))
        buf.seek(end)


class _PushExtension(_PushBlock):
    """``tls.push_extension``: the extension type, then a 2-byte length block."""

    __slots__ = ()

    def __init__(self, buf: Buffer, extension_type: int) -> None:
        buf.push_uint16(extension_type)
        super().__init__(buf, 2)


class _PushMessage:
    """``tls.push_message``: add the message's bytes to the transcript hash at the end."""

    __slots__ = ("_buf", "_key_schedule", "_start")

    def __init__(self, key_schedule: Any, buf: Buffer) -> None:
        self._key_schedule = key_schedule
        self._buf = buf
        self._start = buf.tell()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self._key_schedule.update_hash(self._buf.data_slice(self._start, self._buf.tell()))


FRAMING: dict[str, type] = {
    "pull_block": _PullBlock,
    "push_block": _PushBlock,
    "push_extension": _PushExtension,
    "push_message": _PushMessage,
}

_original_epochs = quic_connection.EPOCHS


class PreEncodedCertificate:
    """An ``x509.Certificate`` whose DER encoding is computed once; all else is delegated."""

    __slots__ = ("_certificate", "_der")

    def __init__(self, certificate: x509.Certificate) -> None:
        self._certificate = certificate
        self._der = certificate.public_bytes(Encoding.DER)

    def public_bytes(self, encoding: Encoding) -> bytes:
        if encoding is Encoding.DER:
            return self._der
        return self._certificate.public_bytes(encoding)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._certificate, name)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PreEncodedCertificate):
            other = other._certificate
        return self._certificate == other

    def __hash__(self) -> int:
        return hash(self._certificate)


def pre_encoded(configuration: QuicConfiguration) -> QuicConfiguration:
    """The same configuration, its certificate and chain DER-encoded once (for servers)."""
    if configuration.certificate is not None and not isinstance(
        configuration.certificate, PreEncodedCertificate
    ):
        configuration.certificate = PreEncodedCertificate(configuration.certificate)
        configuration.certificate_chain = [
            c if isinstance(c, PreEncodedCertificate) else PreEncodedCertificate(c)
            for c in configuration.certificate_chain
        ]
    return configuration


def epochs_hashed(objects: Iterable[object] | None = None) -> bool:
    """Whether any of these (default: every object the collector tracks) holds an Epoch hashed
    the old way: a QUIC connection or TLS context (aioquic keeps its Epoch-keyed dicts there),
    or a set of epochs. Other dicts are not looked into: walking every dict's keys would add
    ~3x the start-up time, for containers only aioquic's own objects hold."""
    holders = (QuicConnection, tls.Context)
    containers: tuple[type, ...] = (frozenset, set) if objects is None else (frozenset, set, dict)
    for obj in gc.get_objects() if objects is None else objects:
        kind = type(obj)
        if kind in holders:
            return True
        if kind in containers:
            try:
                if any(type(k) is tls.Epoch for k in cast(Iterable[object], obj)):
                    return True
            except RuntimeError:  # changed size while we looked: another thread's
                return True
    return False


ORIGINAL_REPLENISH = QuicConnection._replenish_connection_ids
"""aioquic's own, kept for the test that compares it with ours."""


ResetToken = Callable[[bytes], bytes]
"""A connection ID's stateless reset token."""
Route = Callable[[bytes], None]
"""Makes a listener send the datagrams of a connection ID to its connection."""
_RESET_TOKENS: weakref.WeakKeyDictionary[QuicConnection, tuple[ResetToken, Route]] = (
    weakref.WeakKeyDictionary()
)
"""Server connections whose IDs get derived reset tokens: how each token is derived, and how
a new ID is routed."""


def derive_reset_tokens(quic: QuicConnection, token: ResetToken, route: Route) -> None:
    """Give the connection's IDs the tokens `token` derives, the one it has now and those it
    issues later, and `route` each later one as it is made, before any frame carries it; call
    it before the connection sends its transport parameters."""
    _RESET_TOKENS[quic] = (token, route)
    for connection_id in quic._host_cids:
        connection_id.stateless_reset_token = token(connection_id.cid)


NewConnectionId = Callable[[int], bytes]
"""A new connection ID of the given length."""
_CID_MAKERS: weakref.WeakKeyDictionary[QuicConnection, NewConnectionId] = (
    weakref.WeakKeyDictionary()
)
"""Server connections whose IDs are not aioquic's random bytes, and what makes them."""


def make_connection_ids(quic: QuicConnection, new: NewConnectionId) -> None:
    """Make the connection's IDs with `new`: the handshake's one at once (call this before the
    server routes it and before any packet is sent), and those it issues later."""
    _CID_MAKERS[quic] = new
    first = quic._host_cids[0]
    first.cid = new(len(first.cid))
    quic.host_cid = first.cid
    quic._local_initial_source_connection_id = first.cid


def _replenish_connection_ids(self: QuicConnection) -> None:
    """aioquic's own loop, bounded by our limit as well as the peer's, with the connection's
    own IDs and derived tokens where it has them."""
    limit = min(8, self._remote_active_connection_id_limit, self._local_active_connection_id_limit)
    derived = _RESET_TOKENS.get(self)
    maker = _CID_MAKERS.get(self)
    length = self._configuration.connection_id_length
    while len(self._host_cids) < limit:
        cid = maker(length) if maker is not None else os.urandom(length)
        self._host_cids.append(
            QuicConnectionId(
                cid=cid,
                sequence_number=self._host_cid_seq,
                stateless_reset_token=derived[0](cid) if derived is not None else os.urandom(16),
            )
        )
        self._host_cid_seq += 1
        if derived is not None:
            derived[1](cid)


ORIGINAL_WRITE_NEW_CONNECTION_ID = QuicConnection._write_new_connection_id_frame
ORIGINAL_HANDLE_RETIRE_CONNECTION_ID = QuicConnection._handle_retire_connection_id_frame


def _write_new_connection_id_frame(
    self: QuicConnection, builder: QuicPacketBuilder, connection_id: QuicConnectionId
) -> None:
    """aioquic's own, remembering the highest sequence number it has sent."""
    ORIGINAL_WRITE_NEW_CONNECTION_ID(self, builder, connection_id)
    sent = cast(int, getattr(self, "_quicedge_sent_cid_seq", 0))
    if connection_id.sequence_number > sent:
        cast(Any, self)._quicedge_sent_cid_seq = connection_id.sequence_number


def _handle_retire_connection_id_frame(
    self: QuicConnection, context: Any, frame_type: int, buf: Buffer
) -> None:
    """aioquic's own, after RFC 9000 §19.16's check that the ID retired was sent: aioquic checks
    only that it was made, and makes a new one for each it retires, at once. A datagram of
    RETIRE_CONNECTION_ID frames for the IDs made while it is read retired hundreds (2.5 ms of
    CPU a datagram), and without stateless resets each failed an assertion in aioquic's
    server, which routes an ID only once its frame is written, logged at every datagram."""
    start = buf.tell()
    sequence_number = buf.pull_uint_var()
    buf.seek(start)
    if sequence_number > cast(int, getattr(self, "_quicedge_sent_cid_seq", 0)):
        raise QuicConnectionError(
            error_code=QuicErrorCode.PROTOCOL_VIOLATION,
            frame_type=frame_type,
            reason_phrase="Cannot retire a connection ID never sent",
        )
    ORIGINAL_HANDLE_RETIRE_CONNECTION_ID(self, context, frame_type, buf)


ORIGINAL_RECEIVE_DATAGRAM = QuicConnection.receive_datagram


def _receive_datagram(self: QuicConnection, data: bytes, addr: Any, now: float) -> None:
    """aioquic's own, after a check for a stateless reset (RFC 9000 §10.3.1)."""
    token = self._peer_cid.stateless_reset_token  # None for most a server holds: first
    if (
        token is not None
        and data
        and not data[0] & 0x80
        and looks_like_reset(data, token)
        and self._state not in END_STATES
    ):
        log.debug("stateless reset received on connection %s", self.host_cid.hex())
        self._close_event = ConnectionTerminated(
            error_code=QuicErrorCode.NO_ERROR, frame_type=None, reason_phrase=STATELESS_RESET
        )
        self._close_begin(is_initiator=False, now=now)  # draining: nothing more is sent
        return
    ORIGINAL_RECEIVE_DATAGRAM(self, data, addr, now)


PACING_GAIN = 1.25
"""Pacing rate over the congestion window per smoothed RTT (RFC 9002 §7.7's N, quic-go's 5/4):
a little above the window's rate, so that pacing does not leave the window unused."""
BURST_DATAGRAMS = 10
"""Datagrams' worth of bytes that may leave at once: RFC 9002 §7.7 asks that bursts stay
within the initial congestion window, which is 10 datagrams (§7.2); quic-go's burst too."""
AEAD_TAG_BYTES = 16
"""Bytes packet protection adds to a packet (AES-GCM and ChaCha20-Poly1305)."""

ORIGINAL_PACER = recovery.QuicPacketPacer
ORIGINAL_WRITE_APPLICATION = QuicConnection._write_application
"""aioquic's own, kept for the tests that compare them with ours."""


class BytePacer(ORIGINAL_PACER):
    """aioquic's leaky bucket, charged by each packet's size and holding a larger burst."""

    def __init__(self, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self.builder: QuicPacketBuilder | None = None
        """The builder of the transmit in progress (`_write_application` sets it)."""

    def update_after_send(self, now: float) -> None:
        packet_time = self.packet_time
        if packet_time is None:
            return
        self.update_bucket(now=now)
        full = self._max_datagram_size
        builder = self.builder
        size = full
        if builder is not None:  # its packet is not ended yet: header and frames so far
            size = min(full, builder._buffer.tell() - builder._packet_start + AEAD_TAG_BYTES)
        self.bucket_time = max(0.0, self.bucket_time - packet_time * size / full)

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        full = self._max_datagram_size
        rate = PACING_GAIN * congestion_window / max(smoothed_rtt, recovery.K_MICRO_SECOND)
        self.packet_time = max(recovery.K_MICRO_SECOND, min(full / rate, recovery.K_SECOND))
        burst = max(BURST_DATAGRAMS * full, min(congestion_window // 4, 16 * full))
        self.bucket_max = burst / rate
        if self.bucket_time > self.bucket_max:
            self.bucket_time = self.bucket_max


def _write_application(
    self: QuicConnection, builder: QuicPacketBuilder, network_path: QuicNetworkPath, now: float
) -> None:
    """aioquic's own, with the pacer told which builder's packets it is charged for."""
    pacer = self._loss._pacer
    if not isinstance(pacer, BytePacer):  # a connection made before the patch
        ORIGINAL_WRITE_APPLICATION(self, builder, network_path, now)
        return
    pacer.builder = builder
    try:
        ORIGINAL_WRITE_APPLICATION(self, builder, network_path, now)
    finally:
        pacer.builder = None


ORIGINAL_WRITE_STREAM_LIMITS = QuicConnection._write_stream_limits
ORIGINAL_WRITE_CONNECTION_LIMITS = QuicConnection._write_connection_limits
MAX_PENDING_CRYPTO = 16 * 1024
"""CRYPTO bytes a connection buffers ahead of what it has read, per epoch."""
MAX_HANDSHAKE_BYTES = 16 * 1024
"""Handshake bytes a server's TLS engine takes from its client, in all epochs together."""
ORIGINAL_HANDLE_MESSAGE = tls.Context.handle_message
_SERVER_STATES = frozenset(state for state in tls.State if state.name.startswith("SERVER_"))


def _handle_message(
    self: tls.Context, input_data: bytes, output_buf: dict[tls.Epoch, Buffer]
) -> None:
    """aioquic's own, on a server's engine only while what it took from its client stays
    within `MAX_HANDSHAKE_BYTES`: it holds a message until it is whole, whatever length the
    message claims, and copies all it holds at each piece."""
    if self.state in _SERVER_STATES:
        taken = cast(int, getattr(self, "_quicedge_taken", 0)) + len(input_data)
        if taken > MAX_HANDSHAKE_BYTES:
            raise QuicConnectionError(
                error_code=QuicErrorCode.CRYPTO_BUFFER_EXCEEDED,
                frame_type=QuicFrameType.CRYPTO,
                reason_phrase="handshake messages too large",
            )
        cast(Any, self)._quicedge_taken = taken
    ORIGINAL_HANDLE_MESSAGE(self, input_data, output_buf)


class UnreadBytes:
    """Request-body bytes a connection handed to its app that the app has not read yet, by
    stream. The receive windows count them as not delivered, so they grow with what the app
    reads: without this, an app that never read held every byte each stream may carry (16
    streams of 8 MiB: +157 MB)."""

    __slots__ = ("by_stream", "held_back")

    def __init__(self) -> None:
        self.by_stream: dict[int, int] = {}
        self.held_back = False
        """A window stayed where it was for bytes not yet read: a read should transmit."""

    def delivered(self, stream_id: int, size: int) -> None:
        by_stream = self.by_stream
        by_stream[stream_id] = by_stream.get(stream_id, 0) + size

    def read(self, stream_id: int, size: int) -> bool:
        """The app read `size` bytes of `stream_id`; whether a window held back for them may
        grow now (the caller transmits, or a client waiting for credit waits on)."""
        left = self.by_stream.get(stream_id)
        if left is not None:
            if left > size:
                self.by_stream[stream_id] = left - size
            else:
                del self.by_stream[stream_id]
        held_back, self.held_back = self.held_back, False
        return held_back

    def forget(self, stream_id: int) -> bool:
        """The stream's app is done: what it left unread no longer holds a window back.
        Whether a window held back may grow now, as for `read`."""
        left = self.by_stream.pop(stream_id, 0)
        return self.read(stream_id, left) if left else False


def track_unread(quic: QuicConnection) -> UnreadBytes:
    """Have `quic`'s receive windows count request-body bytes as delivered once read."""
    unread = UnreadBytes()
    cast(Any, quic)._quicedge_unread = unread
    return unread


def _unread(quic: QuicConnection) -> UnreadBytes | None:
    return cast(UnreadBytes | None, getattr(quic, "_quicedge_unread", None))


def _write_stream_limits(
    self: QuicConnection, builder: QuicPacketBuilder, space: Any, stream: QuicStream
) -> None:
    """aioquic's own, with the window doubled by the bytes delivered (and read, where the app's
    reads are tracked), not the highest offset seen. aioquic's rule cannot fire after this one
    has: the peer wrote no further than the old window, half the new one."""
    local = stream.max_stream_data_local
    if local:
        delivered = stream.receiver.starting_offset()
        if delivered * 2 > local:
            unread = _unread(self)
            held = 0
            if unread is not None and stream.stream_id is not None:
                held = unread.by_stream.get(stream.stream_id, 0)
            if (delivered - held) * 2 > local:
                stream.max_stream_data_local = local * 2
            elif unread is not None:
                unread.held_back = True
    if stream.max_stream_data_local_sent != stream.max_stream_data_local:
        ORIGINAL_WRITE_STREAM_LIMITS(self, builder, space, stream)  # writes MAX_STREAM_DATA


def _write_connection_limits(self: QuicConnection, builder: QuicPacketBuilder, space: Any) -> None:
    """aioquic's own, with MAX_DATA doubled by the bytes delivered (and read) on every stream,
    not the sum of the highest offsets seen (`used`, which it reads for that alone on this
    limit)."""
    limit = self._local_max_data
    if limit.used * 2 <= limit.value:  # aioquic would not raise it: nothing to count
        ORIGINAL_WRITE_CONNECTION_LIMITS(self, builder, space)
        return
    used = limit.used
    ahead = sum(
        s.receiver.highest_offset - s.receiver.starting_offset() for s in self._streams.values()
    )
    unread = _unread(self)
    if unread is not None and unread.by_stream:
        held = sum(unread.by_stream.values())
        if (used - ahead - held) * 2 <= limit.value < (used - ahead) * 2:
            unread.held_back = True
        ahead += held
    limit.used = used - ahead
    try:
        ORIGINAL_WRITE_CONNECTION_LIMITS(self, builder, space)
    finally:
        limit.used = used


ORIGINAL_WRITE_HANDSHAKE_DONE = QuicConnection._write_handshake_done_frame
_NEW_TOKENS: weakref.WeakKeyDictionary[QuicConnection, bytes] = weakref.WeakKeyDictionary()
"""Server connections and the address token each sends, until the client acknowledges it."""


def send_new_token(quic: QuicConnection, token: bytes) -> None:
    """Send `token` to the client in a NEW_TOKEN frame once the handshake is complete (with
    HANDSHAKE_DONE); a server connection only."""
    _NEW_TOKENS[quic] = token


def new_token_pending(quic: QuicConnection) -> bool:
    """Whether the connection's token is still to be sent or acknowledged."""
    return quic in _NEW_TOKENS


def _on_new_token_delivery(delivery: QuicDeliveryState, quic: QuicConnection) -> None:
    # A lost packet lost HANDSHAKE_DONE too, which aioquic sends again, and the token with it.
    if delivery == QuicDeliveryState.ACKED:
        _NEW_TOKENS.pop(quic, None)


def _write_handshake_done_frame(self: QuicConnection, builder: QuicPacketBuilder) -> None:
    """aioquic's own, then the connection's NEW_TOKEN frame, if it has one, in the same packet."""
    ORIGINAL_WRITE_HANDSHAKE_DONE(self, builder)
    token = _NEW_TOKENS.get(self)
    if token is None:
        return
    try:
        buf = builder.start_frame(
            QuicFrameType.NEW_TOKEN,
            capacity=2 + len(token) + 2,  # type, length (up to 2 bytes for ours), token
            handler=_on_new_token_delivery,
            handler_args=(self,),
        )
    except QuicPacketBuilderStop:  # no room left: the client does without a token
        _NEW_TOKENS.pop(self, None)
        return
    buf.push_uint_var(len(token))
    buf.push_bytes(token)


def _idle_timeout(self: QuicConnection) -> float:
    """aioquic's own, where a peer's max_idle_timeout of 0 is none (RFC 9000 §10.1, §18.2)."""
    idle_timeout = self._configuration.idle_timeout
    if self._remote_max_idle_timeout:  # neither None (not sent) nor 0 (none)
        idle_timeout = min(idle_timeout, self._remote_max_idle_timeout)
    return max(idle_timeout, 3 * self._loss.get_probe_timeout())


def _apply() -> dict[str, bool]:
    applied = {
        "epochs_memoized": False,
        "epoch_identity_hash": False,
        "tls_framing": False,
        "connection_ids_bounded": False,
        "pacing_by_bytes": False,
        "new_token": False,
        "stateless_reset": False,
        "windows_by_delivered_bytes": False,
        "crypto_buffer_bounded": False,
        "idle_timeout_zero_is_none": False,
    }
    for name, replacement in FRAMING.items():
        setattr(tls, name, replacement)
    applied["tls_framing"] = True
    if quic_connection.EPOCHS is _original_epochs:
        quic_connection.EPOCHS = functools.cache(_original_epochs)
    applied["epochs_memoized"] = True
    cast(Any, QuicConnection)._replenish_connection_ids = _replenish_connection_ids
    connection = cast(Any, QuicConnection)
    connection._write_new_connection_id_frame = _write_new_connection_id_frame
    connection._handle_retire_connection_id_frame = _handle_retire_connection_id_frame
    applied["connection_ids_bounded"] = True
    # A connection's pacer is made with it: connections made before this keep aioquic's.
    recovery.QuicPacketPacer = BytePacer  # type: ignore[misc]
    cast(Any, QuicConnection)._write_application = _write_application
    applied["pacing_by_bytes"] = True
    cast(Any, QuicConnection)._write_handshake_done_frame = _write_handshake_done_frame
    applied["new_token"] = True
    cast(Any, QuicConnection).receive_datagram = _receive_datagram
    applied["stateless_reset"] = True
    cast(Any, QuicConnection)._write_stream_limits = _write_stream_limits
    cast(Any, QuicConnection)._write_connection_limits = _write_connection_limits
    applied["windows_by_delivered_bytes"] = True
    quic_connection.MAX_PENDING_CRYPTO = MAX_PENDING_CRYPTO
    cast(Any, tls.Context).handle_message = _handle_message
    applied["crypto_buffer_bounded"] = True
    cast(Any, QuicConnection)._idle_timeout = _idle_timeout
    applied["idle_timeout_zero_is_none"] = True
    if cast(Any, tls.Epoch).__hash__ is object.__hash__:
        applied["epoch_identity_hash"] = True
    elif epochs_hashed():
        log.warning("aioquic epochs already hashed: keeping their hash (a little slower)")
    else:
        # Assigning object's slot wrapper makes the type's hash the C identity hash.
        cast(Any, tls.Epoch).__hash__ = object.__hash__
        applied["epoch_identity_hash"] = True
    return applied


APPLIED = _apply()
"""Which changes are in force in this process."""
