"""Connection caps on the QUIC listener: the stateless refusal of a connection past a cap.

TCP listeners close a connection over their `caps.ConnectionGate` as it is accepted. QUIC has
no accept: a connection is made by aioquic's endpoint when a client's first Initial datagram
arrives, so ``h3_server`` asks the gate before the endpoint sees that datagram and, past a cap,
answers with `refusal` instead: one Initial packet holding a CONNECTION_CLOSE with
CONNECTION_REFUSED (RFC 9000 §5.2.2, §10.2.3), built from the client's own connection IDs, as
aioquic's endpoint answers a bad Retry token. No connection state, no TLS work: the client's
handshake ends at once with that error code.
"""

from __future__ import annotations

from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE
from aioquic.quic.connection import TRANSPORT_CLOSE_FRAME_CAPACITY
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.packet import QuicErrorCode, QuicFrameType, QuicHeader, QuicPacketType
from aioquic.quic.packet_builder import QuicPacketBuilder

REASON = b"connection cap"
"""The reason phrase a refused client sees with CONNECTION_REFUSED."""


def may_open(data: bytes) -> bool:
    """Whether `data` can start a connection at all: aioquic makes one only for a long-header
    Initial of at least 1200 bytes (RFC 9000 §14.1). Every 1-RTT datagram fails the first test,
    so the listener parses no header for them."""
    return bool(data) and data[0] & 0x80 != 0 and len(data) >= SMALLEST_MAX_DATAGRAM_SIZE


def refusal(header: QuicHeader) -> bytes:
    """The server's Initial packet refusing the connection a client's Initial `header` opens.

    Its keys come from the client's Destination Connection ID, which the server's packet uses as
    its own Source Connection ID; it is smaller than the client's datagram, so it amplifies
    nothing (RFC 9000 §8)."""
    assert header.version is not None  # an Initial always carries one
    crypto = CryptoPair()
    crypto.setup_initial(cid=header.destination_cid, is_client=False, version=header.version)
    builder = QuicPacketBuilder(
        host_cid=header.destination_cid,
        is_client=False,
        max_datagram_size=SMALLEST_MAX_DATAGRAM_SIZE,
        peer_cid=header.source_cid,
        version=header.version,
    )
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    buf = builder.start_frame(
        QuicFrameType.TRANSPORT_CLOSE, capacity=TRANSPORT_CLOSE_FRAME_CAPACITY + len(REASON)
    )
    buf.push_uint_var(QuicErrorCode.CONNECTION_REFUSED)
    buf.push_uint_var(QuicFrameType.PADDING)  # the frame type that caused it: none
    buf.push_uint_var(len(REASON))
    buf.push_bytes(REASON)
    datagrams, _ = builder.flush()
    return datagrams[0]


__all__ = ["REASON", "may_open", "refusal"]
