"""Stateless resets (RFC 9000 §10.3): a listener that has lost a connection ends it at once.

A client whose server restarted, crashed or dropped a connection keeps sending into it and
waits out its idle timeout (30 s and more) before it tries again. A stateless reset tells it
straight away: a datagram that looks like any short-header packet and ends with a 16-byte token
the server gave the client for that connection ID. Only the holder of the key can compute it,
so nobody off the path can end a connection.

Tokens are HMAC-SHA256 of the connection ID under a key derived (HKDF) from the listener's
secret (`--quic-retry-secret`, shared with Retry and address tokens under other labels), the
host name and the worker index (§10.3.2's static key). So:

- A process that restarts with the same secret on the same host resets the connections of its
  predecessor; without a configured secret each start draws a new one, and only connections
  the running process dropped itself (idle, closed while the client was away) get a reset.
- Workers and machines have different keys even when they share the secret: a packet that
  reaches a worker other than its connection's (SO_REUSEPORT spreads by the client's address
  and port, so a client behind a NAT that rebinds does that) gets a reset the client does not
  recognise, never one that ends a live connection elsewhere (the oracle of §21.11).

What is sent follows §10.3 and §10.3.3: only for short-header datagrams of an unknown
connection ID, always shorter than the datagram that triggered it (so two endpoints can never
loop, and nothing is amplified), at least 21 bytes (nothing for a trigger of 21 bytes or
less), one byte shorter for a trigger of 43 bytes or less, otherwise of a random length, and at
most `rate` a second (a flood of junk datagrams costs an HMAC and a send each; past the rate
they are dropped and counted).
"""

from __future__ import annotations

import hmac
import os
import random
import socket
import time
from collections.abc import Callable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_INFO = b"quicedge quic stateless reset v1"
TOKEN_BYTES = 16
"""A stateless reset token's length (RFC 9000 §10.3)."""
MIN_RESET_BYTES = 21
"""The shortest reset: 5 bytes that pass for a short header (38 unpredictable bits), then the
token (§10.3)."""
SHORT_TRIGGER_BYTES = 43
"""Up to this length a reset is one byte shorter than its trigger (§10.3)."""
SPREAD_BYTES = 64
"""Past `SHORT_TRIGGER_BYTES`, a reset is 43 to 43 + this many bytes long (and shorter than
its trigger), so that its length says little about the trigger's."""
DEFAULT_RATE = 100
"""Resets a listener sends per second at most, by default."""
STATELESS_RESET = "stateless reset"
"""The reason a connection ended by a stateless reset gives in its ConnectionTerminated."""


def instance_label(worker: int = 0, host: str | None = None) -> bytes:
    """What makes a worker's key its own: the host name and the worker's index."""
    return f"{host if host is not None else socket.gethostname()}/{worker}".encode()


def derive_key(secret: bytes, instance: bytes) -> bytes:
    """The 256-bit HMAC key of one worker from the listener's secret (HKDF-SHA256)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO + instance).derive(
        secret
    )


def reset_length(trigger: int) -> int | None:
    """How long a reset to a datagram of `trigger` bytes is; None: too short to answer."""
    if trigger <= MIN_RESET_BYTES:
        return None
    if trigger <= SHORT_TRIGGER_BYTES:
        return trigger - 1
    return SHORT_TRIGGER_BYTES + random.randrange(min(SPREAD_BYTES, trigger - SHORT_TRIGGER_BYTES))


def looks_like_reset(datagram: bytes, token: bytes | None) -> bool:
    """Whether `datagram` is a stateless reset carrying `token` (the receiving side, §10.3.1)."""
    return (
        token is not None
        and len(datagram) >= MIN_RESET_BYTES
        and not datagram[0] & 0x80
        and hmac.compare_digest(datagram[-TOKEN_BYTES:], token)
    )


class StatelessResets:
    """The tokens of one listener's connection IDs, and the resets it sends."""

    def __init__(
        self,
        secret: bytes | None = None,
        *,
        instance: bytes | None = None,
        rate: int = DEFAULT_RATE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate < 1:
            raise ValueError(f"stateless reset rate must be >= 1 a second, got {rate}")
        self._key = (
            derive_key(secret, instance if instance is not None else instance_label())
            if secret is not None
            else os.urandom(32)
        )
        self._rate = float(rate)
        self._clock = clock
        self._allowance = float(rate)
        self._last = clock()
        self.sent = 0
        """Resets sent."""
        self.limited = 0
        """Resets not sent because the rate was reached."""

    def token(self, connection_id: bytes) -> bytes:
        """The token a client is given with `connection_id` (the same on every start with the
        same secret, host and worker)."""
        return hmac.digest(self._key, connection_id, "sha256")[:TOKEN_BYTES]

    def reply(self, datagram: bytes, cid_length: int) -> bytes | None:
        """The reset for a short-header `datagram` whose connection ID this listener does not
        know; None where none may be sent (too short, or over the rate)."""
        length = reset_length(len(datagram))
        if length is None or len(datagram) < 1 + cid_length:
            return None
        if not self._take():
            self.limited += 1
            return None
        self.sent += 1
        token = self.token(datagram[1 : 1 + cid_length])
        unpredictable = bytearray(os.urandom(length - TOKEN_BYTES))
        unpredictable[0] = 0x40 | (unpredictable[0] & 0x3F)  # short header, fixed bit set
        return bytes(unpredictable) + token

    def _take(self) -> bool:
        """One reset from a bucket of `rate`, refilled at `rate` a second."""
        now = self._clock()
        self._allowance = min(self._rate, self._allowance + (now - self._last) * self._rate)
        self._last = now
        if self._allowance < 1.0:
            return False
        self._allowance -= 1.0
        return True
