"""Session-ticket stores that make 0-RTT single use across the fleet (RFC 8446 §8.1).

aioquic issues a *stateful* ticket on every handshake (64 random bytes naming a stored
``SessionTicket`` that holds the resumption secret). The server accepts early data only when its
fetcher returns the ticket, so a store whose ``take`` deletes the ticket in the same atomic step
that reads it lets each ticket open at most one 0-RTT window, fleet-wide:

- ``MemoryTicketStore``: ``dict.pop`` (one process).
- ``RedisTicketStore``: ``GETDEL`` (Redis >= 6.2), shared by every worker and edge machine.

A store that cannot answer raises ``TicketStoreError``; the H3 server then refuses resumption
(full handshake) and counts it. It never accepts early data without this protection.

aioquic calls the fetcher synchronously inside the TLS state machine. The Redis store therefore
uses a dedicated *synchronous* client on one kept connection with a tight socket timeout (50 ms
by default): a GETDEL on a nearby Redis costs ~0.1 ms of loop time, a slow or dead Redis costs
at most the timeout once, after which the store fails fast (no network I/O) for ``cooldown``
seconds. A thread + bounded wait would cost a thread hop (~50 µs) on every handshake and still
block the loop for the wait; the direct call is cheaper and just as bounded.

A stored ticket holds its resumption secret, from which 0-RTT keys are derived: anyone who can
read Redis could decrypt early data. With a configured secret (``--ticket-secret``, the same on
every worker and machine) the Redis store seals each value with AES-GCM under a key derived from
it (HKDF), bound to the ticket's id; a value sealed under another secret reads as unknown.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import redis
from aioquic.tls import CipherSuite, SessionTicket
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from redis.backoff import NoBackoff
from redis.retry import Retry

from transport.redacted import without_password

Clock = Callable[[], float]

# Fixed by aioquic (tls.py: ticket_lifetime=86400); RFC 8446 §4.6.1 caps it at 7 days.
DEFAULT_MAX_TTL = 86400.0


class TicketStoreError(Exception):
    """The store could not answer (unreachable, timed out, or returned garbage)."""


class TicketStore(Protocol):
    """Where issued tickets wait for their single use."""

    def put(self, ticket: SessionTicket) -> None:
        """Keep ``ticket`` until it expires or is taken. May raise ``TicketStoreError``."""

    def take(self, ticket_id: bytes) -> SessionTicket | None:
        """Remove and return the ticket, atomically; None if unknown, used or expired.

        May raise ``TicketStoreError``.
        """

    def close(self) -> None:
        """Release connections."""


def ttl_of(ticket: SessionTicket, now: float, max_ttl: float) -> float:
    """Seconds the ticket may still be used: its remaining lifetime, capped at ``max_ttl``."""
    return min(ticket.not_valid_after.timestamp() - now, max_ttl)


@dataclass(slots=True)
class _Entry:
    ticket: SessionTicket
    expires_at: float


class MemoryTicketStore:
    """Single-process store: ``dict.pop`` is the atomic take. Bounded; the oldest go first."""

    def __init__(
        self,
        *,
        max_entries: int = 100_000,
        max_ttl: float = DEFAULT_MAX_TTL,
        clock: Clock = time.time,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._entries: dict[bytes, _Entry] = {}
        self._max_entries = max_entries
        self._max_ttl = max_ttl
        self._clock = clock

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<MemoryTicketStore {len(self._entries)} tickets>"

    def put(self, ticket: SessionTicket) -> None:
        now = self._clock()
        ttl = ttl_of(ticket, now, self._max_ttl)
        if ttl <= 0:
            return
        while len(self._entries) >= self._max_entries:
            # dicts keep insertion order: evict the oldest ticket (its client falls back to 1-RTT).
            del self._entries[next(iter(self._entries))]
        self._entries[ticket.ticket] = _Entry(ticket, now + ttl)

    def take(self, ticket_id: bytes) -> SessionTicket | None:
        entry = self._entries.pop(ticket_id, None)
        if entry is None or entry.expires_at <= self._clock():
            return None
        return entry.ticket

    def close(self) -> None:
        self._entries.clear()


def encode_ticket(ticket: SessionTicket) -> bytes:
    """A plain JSON encoding (never pickle: Redis content must not be able to run code)."""
    return json.dumps(
        {
            "age_add": ticket.age_add,
            "cipher_suite": int(ticket.cipher_suite),
            "not_valid_after": ticket.not_valid_after.timestamp(),
            "not_valid_before": ticket.not_valid_before.timestamp(),
            "resumption_secret": base64.b64encode(ticket.resumption_secret).decode(),
            "server_name": ticket.server_name,
            "ticket": base64.b64encode(ticket.ticket).decode(),
            "max_early_data_size": ticket.max_early_data_size,
            "other_extensions": [
                [t, base64.b64encode(v).decode()] for t, v in ticket.other_extensions
            ],
        },
        separators=(",", ":"),
    ).encode()


def decode_ticket(data: bytes) -> SessionTicket:
    """Inverse of ``encode_ticket``; raises ``ValueError`` on anything malformed."""
    try:
        d = json.loads(data)
        return SessionTicket(
            age_add=int(d["age_add"]),
            cipher_suite=CipherSuite(int(d["cipher_suite"])),
            not_valid_after=datetime.fromtimestamp(float(d["not_valid_after"]), UTC),
            not_valid_before=datetime.fromtimestamp(float(d["not_valid_before"]), UTC),
            resumption_secret=base64.b64decode(d["resumption_secret"], validate=True),
            server_name=str(d["server_name"]),
            ticket=base64.b64decode(d["ticket"], validate=True),
            max_early_data_size=(
                None if d["max_early_data_size"] is None else int(d["max_early_data_size"])
            ),
            other_extensions=[
                (int(t), base64.b64decode(v, validate=True)) for t, v in d["other_extensions"]
            ],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed stored session ticket: {exc}") from None


MIN_TICKET_SECRET_BYTES = 16
_SEAL_INFO = b"quicedge ticket store v1"
_NONCE_BYTES = 12


class TicketSealer:
    """AES-GCM sealing of stored tickets under a key derived from a shared secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_TICKET_SECRET_BYTES:
            raise ValueError(f"the ticket secret must be at least {MIN_TICKET_SECRET_BYTES} bytes")
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SEAL_INFO).derive(secret)
        self._aead = AESGCM(key)

    def seal(self, ticket_id: bytes, data: bytes) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data, ticket_id)

    def open(self, ticket_id: bytes, sealed: bytes) -> bytes | None:
        """The plaintext, or None when the value was sealed under another secret (or not)."""
        try:
            return self._aead.decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], ticket_id)
        except (InvalidTag, ValueError):
            return None


SLOW_SHARE = 0.2
"""A call that took more than this share of the timeout counts as a failure too: aioquic asks
for tickets synchronously, inside its TLS step, so each call holds the whole worker. A Redis
answering in 40 ms, under a 50 ms timeout, cut resumed handshakes from ~150 to ~20 in 5 s
and stalled every stream of the worker 80 ms a handshake, with no error counted."""


TICKET_PREFIX = "quicedge:ticket:q0:"
"""The shared store's keys. Its last part names the HTTP/3 SETTINGS the tickets were issued
under (`q0`: no QPACK dynamic table): a client resuming with 0-RTT uses the SETTINGS it
remembers, and one that remembered a table the listener no longer keeps fails that connection
(RFC 9204 §3.2.3). A release that changes them changes it, so that tickets of edges on either
side of a rolling deploy are not found, and their clients make a full handshake instead."""


class RedisTicketStore:
    """Fleet-wide store: ``SET key value PX ttl`` to keep, ``GETDEL key`` to take once."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = TICKET_PREFIX,
        timeout: float = 0.05,
        cooldown: float = 1.0,
        max_ttl: float = DEFAULT_MAX_TTL,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
        secret: bytes | None = None,
    ) -> None:
        """``secret``: seal stored tickets under a key derived from it (see the module doc)."""
        if timeout <= 0:
            raise ValueError("ticket store timeout must be > 0")
        # One lazily opened, kept connection (the loop is single-threaded); no retries and no
        # backoff sleeps: a failure must cost at most one timeout of loop time.
        self._redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            max_connections=1,
        )
        self._prefix = prefix.encode()
        self._cooldown = cooldown
        self._max_ttl = max_ttl
        self._clock = clock
        self._monotonic = monotonic
        self._down_until = 0.0
        self._down_because = ""
        self._slow = timeout * SLOW_SHARE
        self._sealer = TicketSealer(secret) if secret is not None else None
        self.url = url

    @property
    def sealed(self) -> bool:
        return self._sealer is not None

    def __repr__(self) -> str:
        return f"<RedisTicketStore {without_password(self.url)} prefix={self._prefix.decode()!r}>"

    def _key(self, ticket_id: bytes) -> bytes:
        return self._prefix + ticket_id.hex().encode()

    def _check_up(self) -> float:
        """The time now; TicketStoreError while cooling down after a failure."""
        now = self._monotonic()
        if now < self._down_until:
            raise TicketStoreError(
                f"ticket store unavailable (cooling down after {self._down_because})"
            )
        return now

    def _failed(self, exc: Exception) -> TicketStoreError:
        self._down_until = self._monotonic() + self._cooldown
        self._down_because = "an error"
        return TicketStoreError(f"ticket store unavailable: {exc}")

    def _answered(self, started: float) -> None:
        """A call that answered, but slowly, makes the next ones fail fast for `cooldown` (its
        answer is still used)."""
        took = self._monotonic() - started
        if took > self._slow:
            self._down_until = started + took + self._cooldown
            self._down_because = f"an answer in {took * 1000:.0f} ms"

    def put(self, ticket: SessionTicket) -> None:
        ttl_ms = int(ttl_of(ticket, self._clock(), self._max_ttl) * 1000)
        if ttl_ms <= 0:
            return
        started = self._check_up()
        try:
            value = encode_ticket(ticket)
            if self._sealer is not None:
                value = self._sealer.seal(ticket.ticket, value)
            self._redis.set(self._key(ticket.ticket), value, px=ttl_ms)
        except redis.RedisError as exc:
            raise self._failed(exc) from exc
        self._answered(started)

    def take(self, ticket_id: bytes) -> SessionTicket | None:
        started = self._check_up()
        try:
            raw = self._redis.getdel(self._key(ticket_id))
        except redis.RedisError as exc:
            raise self._failed(exc) from exc
        self._answered(started)
        if raw is None:
            return None
        data = raw if isinstance(raw, bytes) else raw.encode()
        if self._sealer is not None:
            opened = self._sealer.open(ticket_id, data)
            if opened is None:
                return None  # sealed under a rotated secret: a full handshake, no early data
            data = opened
        try:
            return decode_ticket(data)
        except ValueError as exc:
            raise TicketStoreError(str(exc)) from exc

    def close(self) -> None:
        self._redis.close()
