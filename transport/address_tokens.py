"""Address-validation tokens for returning clients (QUIC NEW_TOKEN, RFC 9000 §8.1.3).

Until a new connection's address is validated (its client's Handshake packet, a round trip in),
the server may send only three times the bytes it received (§8.1). A 0-RTT answer bigger than
that waits a round trip, and a Retry costs one. A token the server gave the client on an earlier
connection proves the address at once: the listener sends one in the packet that carries
HANDSHAKE_DONE (`aioquic_patches`; aioquic's server sends none), and a new connection whose
Initial carries a valid one starts validated, with no Retry even where Retry is on.

A token seals the client's IP address and the time it was issued with AES-GCM. The key comes
from the same secret as the Retry tokens' (HKDF with another label), so every worker and machine
that shares it accepts every other's tokens; without a secret, a random key per process. A token
is good for `LIFETIME` seconds, only from the address it was issued to, and once (RFC 9000
§8.1.4 asks that replay be prevented or limited): an on-path observer who copies a token from
a client's Initial and sends it from that client's address, to have the server flood it, is
refused. Each process remembers the tokens it accepted (at most `MAX_REMEMBERED`, the oldest
forgotten first), so a token copied to another worker or machine can be used once more there.
Tokens start with `MARK`, which aioquic's Retry tokens (a random nonce first) share one time in
256; a Retry token is never mistaken for an address token, since it fails to open.
"""

from __future__ import annotations

import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_INFO = b"quicedge quic address token v1"
MARK = b"\xa7"
"""First byte of every address token."""
LIFETIME = 24 * 3600.0
"""Seconds a token is accepted for after it was issued (a day: a returning mobile client)."""
MAX_REMEMBERED = 65_536
"""Accepted tokens a process remembers, to refuse them a second time (~10 MB at most)."""
CLOCK_SKEW = 60.0
"""Seconds a token may seem to come from the future (machines that share a secret)."""
_NONCE = 12
_TIME = struct.Struct("!d")
TOKEN_BYTES = len(MARK) + _NONCE + _TIME.size + 16
"""An address token's length: mark, nonce, the sealed issue time and the AES-GCM tag."""


def derive_key(secret: bytes) -> bytes:
    """A 128-bit AES-GCM key for address tokens from the listener's secret (HKDF-SHA256)."""
    return HKDF(algorithm=hashes.SHA256(), length=16, salt=None, info=_INFO).derive(secret)


class AddressTokens:
    """Issues and checks the tokens of one listener."""

    def __init__(
        self,
        secret: bytes | None = None,
        *,
        lifetime: float = LIFETIME,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._aead = AESGCM(derive_key(secret) if secret is not None else os.urandom(16))
        self._lifetime = lifetime
        self._clock = clock
        self._accepted: OrderedDict[bytes, float] = OrderedDict()
        """Nonces of the tokens accepted, and when each was issued (oldest first)."""

    def issue(self, host: str) -> bytes:
        """A token for a client at `host` (its IP address as text)."""
        nonce = os.urandom(_NONCE)
        sealed = self._aead.encrypt(nonce, _TIME.pack(self._clock()), MARK + host.encode())
        return MARK + nonce + sealed

    def valid(self, token: bytes, host: str) -> bool:
        """Whether `token` was issued by a holder of this key to `host`, and is still good
        (whether or not it was used)."""
        return self._issued(token, host) is not None

    def accept(self, token: bytes, host: str) -> str:
        """Check a token a new connection from `host` carries, and use it up: "accepted",
        "replayed" (accepted before, by this process) or "invalid"."""
        issued = self._issued(token, host)
        if issued is None:
            return "invalid"
        nonce = token[len(MARK) : len(MARK) + _NONCE]
        if nonce in self._accepted:
            return "replayed"
        self._remember(nonce, issued)
        return "accepted"

    def _issued(self, token: bytes, host: str) -> float | None:
        if len(token) != TOKEN_BYTES or not token.startswith(MARK):
            return None
        nonce = token[len(MARK) : len(MARK) + _NONCE]
        try:
            plain = self._aead.decrypt(nonce, token[len(MARK) + _NONCE :], MARK + host.encode())
        except InvalidTag:
            return None
        (issued,) = _TIME.unpack(plain)
        age = self._clock() - issued
        return issued if -CLOCK_SKEW <= age <= self._lifetime else None

    def _remember(self, nonce: bytes, issued: float) -> None:
        accepted = self._accepted
        accepted[nonce] = issued
        # Tokens past their lifetime are refused anyway: forget them, oldest first.
        oldest = self._clock() - self._lifetime
        while accepted and (
            len(accepted) > MAX_REMEMBERED or next(iter(accepted.values())) < oldest
        ):
            accepted.popitem(last=False)


__all__ = [
    "CLOCK_SKEW",
    "LIFETIME",
    "MARK",
    "MAX_REMEMBERED",
    "TOKEN_BYTES",
    "AddressTokens",
    "derive_key",
]
