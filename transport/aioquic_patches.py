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
- **Certificate encoding.** Every full handshake DER-encodes the certificate and its chain again
  (``x.public_bytes(Encoding.DER)`` in ``tls.Context._server_handle_hello``). `pre_encoded`
  wraps the configuration's certificates so that the encoding is done once, at load.
  *Upstream:* ``QuicConfiguration`` keeping the chain's DER.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Iterable
from typing import Any, cast

from aioquic import tls
from aioquic.quic import connection as quic_connection
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

log = logging.getLogger("quicedge.transport.aioquic")

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


def _apply() -> dict[str, bool]:
    applied = {"epochs_memoized": False, "epoch_identity_hash": False}
    if quic_connection.EPOCHS is _original_epochs:
        quic_connection.EPOCHS = functools.cache(_original_epochs)
    applied["epochs_memoized"] = True
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
