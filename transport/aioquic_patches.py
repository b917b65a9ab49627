"""Changes to aioquic's per-connection and per-packet work, made once when this module is
imported, for the aioquic version `pyproject.toml` pins (`aioquic_private.py` lists what they
touch, and `tests/transport/test_aioquic_patches.py` checks that each still applies and keeps
aioquic's behaviour).

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
  *Upstream:* a ``QuicConfiguration.active_connection_id_limit`` for both directions.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
from collections.abc import Iterable
from typing import Any, cast

from aioquic import tls
from aioquic.buffer import Buffer
from aioquic.quic import connection as quic_connection
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection, QuicConnectionId
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

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


def _replenish_connection_ids(self: QuicConnection) -> None:
    """aioquic's own loop, bounded by our limit as well as the peer's."""
    limit = min(8, self._remote_active_connection_id_limit, self._local_active_connection_id_limit)
    while len(self._host_cids) < limit:
        self._host_cids.append(
            QuicConnectionId(
                cid=os.urandom(self._configuration.connection_id_length),
                sequence_number=self._host_cid_seq,
                stateless_reset_token=os.urandom(16),
            )
        )
        self._host_cid_seq += 1


def _apply() -> dict[str, bool]:
    applied = {
        "epochs_memoized": False,
        "epoch_identity_hash": False,
        "tls_framing": False,
        "connection_ids_bounded": False,
    }
    for name, replacement in FRAMING.items():
        setattr(tls, name, replacement)
    applied["tls_framing"] = True
    if quic_connection.EPOCHS is _original_epochs:
        quic_connection.EPOCHS = functools.cache(_original_epochs)
    applied["epochs_memoized"] = True
    cast(Any, QuicConnection)._replenish_connection_ids = _replenish_connection_ids
    applied["connection_ids_bounded"] = True
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
