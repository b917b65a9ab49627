"""QUIC Retry (RFC 9000 §8.1.2) with a token key shared by every worker and edge machine.

aioquic's ``QuicRetryTokenHandler`` draws a random AES-GCM key per process, so a token minted
by one SO_REUSEPORT worker fails in another (the kernel may hand the retried Initial to either).
``SharedRetryTokenHandler`` derives the key from a configured secret with HKDF and stamps
tokens with wall-clock time (aioquic passes the loop's monotonic clock, which differs between
machines). The server installs it in place of aioquic's, and it replaces aioquic's key, through
``transport.aioquic_private`` (there is no public hook for either). Anti-amplification (RFC 9000
§8.1: at most 3x the bytes received before the address is validated) is enforced by aioquic's
``QuicConnection`` itself, with or without Retry.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aioquic.quic.connection import NetworkAddress
from aioquic.quic.retry import NONCE_LENGTH, QuicRetryTokenHandler
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from transport.aioquic_private import set_retry_key

_INFO = b"quicedge quic retry token v1"
MIN_SECRET_BYTES = 16


def derive_key(secret: bytes) -> bytes:
    """A 128-bit AES-GCM key from the configured secret (RFC 5869 HKDF-SHA256)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the QUIC retry secret must be at least {MIN_SECRET_BYTES} bytes")
    return HKDF(algorithm=hashes.SHA256(), length=16, salt=None, info=_INFO).derive(secret)


class SharedRetryTokenHandler(QuicRetryTokenHandler):
    """Retry tokens any holder of the same secret can validate."""

    def __init__(self, secret: bytes, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self._key = AESGCM(derive_key(secret))
        set_retry_key(self, self._key)
        self._clock = clock

    def sealed_here(self, token: bytes) -> bool:
        """Whether `token` was sealed under this key (a Retry token of ours, good or not): one
        that is not (another server's NEW_TOKEN token, kept by its client for that server's
        name) is no Retry token, and its client gets a Retry, not an INVALID_TOKEN close."""
        try:
            self._key.decrypt(token[:NONCE_LENGTH], token[NONCE_LENGTH:], None)
        except (InvalidTag, ValueError):
            return False
        return True

    def create_token(
        self,
        *,
        address: NetworkAddress,
        original_destination_connection_id: bytes,
        retry_source_connection_id: bytes,
        now: float,
    ) -> bytes:
        return super().create_token(
            address=address,
            original_destination_connection_id=original_destination_connection_id,
            retry_source_connection_id=retry_source_connection_id,
            now=self._clock(),
        )

    def validate_token(
        self, *, address: NetworkAddress, destination_cid: bytes, token: bytes, now: float
    ) -> bytes:
        return super().validate_token(
            address=address, destination_cid=destination_cid, token=token, now=self._clock()
        )
