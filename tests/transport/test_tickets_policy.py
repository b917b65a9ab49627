"""Ticket stores and the early-data policy on their own (the stores against a real Redis)."""

from __future__ import annotations

import datetime as dt
import os
import signal
import threading
from typing import Any

import pytest
import redis
from aioquic.h3.connection import Setting
from aioquic.tls import CipherSuite, SessionTicket

from tests.helpers import RedisServer
from tests.transport.conftest import H3Factory
from tests.transport.h3client import h3_connect
from transport.early_data import EarlyDataPolicy, Mode, parse_mode
from transport.retry import SharedRetryTokenHandler
from transport.tickets import (
    TICKET_PREFIX,
    MemoryTicketStore,
    RedisTicketStore,
    TicketStoreError,
    decode_ticket,
    encode_ticket,
)

NOW = 1_800_000_000.0


def ticket(lifetime: float = 86400, now: float = NOW) -> SessionTicket:
    start = dt.datetime.fromtimestamp(now, dt.UTC)
    return SessionTicket(
        age_add=7,
        cipher_suite=CipherSuite.AES_128_GCM_SHA256,
        not_valid_after=start + dt.timedelta(seconds=lifetime),
        not_valid_before=start,
        resumption_secret=os.urandom(32),
        server_name="localhost",
        ticket=os.urandom(64),
        max_early_data_size=0xFFFFFFFF,
        other_extensions=[(42, b"\x00\x01")],
    )


def test_memory_store_is_single_use_and_expires() -> None:
    clock = [NOW]
    store = MemoryTicketStore(clock=lambda: clock[0], max_ttl=60)
    a, b = ticket(), ticket()
    store.put(a)
    store.put(b)
    assert store.take(a.ticket) is a
    assert store.take(a.ticket) is None
    clock[0] += 61  # capped at max_ttl although the ticket's own lifetime is a day
    assert store.take(b.ticket) is None
    store.put(ticket(lifetime=-1))  # already expired: not kept
    assert len(store) == 0


def test_memory_store_is_bounded() -> None:
    store = MemoryTicketStore(max_entries=2, clock=lambda: NOW)
    first, *rest = [ticket() for _ in range(3)]
    for t in (first, *rest):
        store.put(t)
    assert len(store) == 2
    assert store.take(first.ticket) is None  # the oldest made room
    assert all(store.take(t.ticket) is t for t in rest)
    with pytest.raises(ValueError):
        MemoryTicketStore(max_entries=0)


def test_ticket_encoding_round_trips_and_refuses_garbage() -> None:
    t = ticket()
    assert decode_ticket(encode_ticket(t)) == t
    renamed = encode_ticket(t).replace(b'"ticket"', b'"x"')
    for bad in (b"", b"{}", b"[1]", b'{"age_add": "x"}', renamed):
        with pytest.raises(ValueError, match="malformed stored session ticket"):
            decode_ticket(bad)


def test_redis_store_getdel_and_ttl(redis_url: str, redis_prefix: str) -> None:
    store = RedisTicketStore(redis_url, prefix=redis_prefix, clock=lambda: NOW, max_ttl=30)
    r = redis.Redis.from_url(redis_url)
    try:
        t = ticket()
        store.put(t)
        key = redis_prefix + t.ticket.hex()
        assert 0 < r.pttl(key) <= 30_000
        other = RedisTicketStore(redis_url, prefix=redis_prefix)  # another worker
        try:
            assert other.take(t.ticket) == t
        finally:
            other.close()
        assert store.take(t.ticket) is None
        r.set(redis_prefix + b"bad".hex(), b"not json")
        with pytest.raises(TicketStoreError, match="malformed"):
            store.take(b"bad")
    finally:
        store.close()


def test_redis_store_seals_tickets_with_the_shared_secret(
    redis_url: str, redis_prefix: str
) -> None:
    secret = b"a shared secret, same everywhere"
    store = RedisTicketStore(redis_url, prefix=redis_prefix, clock=lambda: NOW, secret=secret)
    worker = RedisTicketStore(redis_url, prefix=redis_prefix, secret=secret)
    rotated = RedisTicketStore(redis_url, prefix=redis_prefix, secret=b"x" * 16)
    unsealed = RedisTicketStore(redis_url, prefix=redis_prefix)
    r = redis.Redis.from_url(redis_url)
    try:
        assert store.sealed and not unsealed.sealed
        a, b, c = ticket(), ticket(), ticket()
        for t in (a, b, c):
            store.put(t)
        stored = r.get(redis_prefix + a.ticket.hex())
        assert stored is not None
        assert a.resumption_secret not in stored and b"resumption_secret" not in stored
        assert worker.take(a.ticket) == a  # another worker with the same secret
        assert worker.take(a.ticket) is None  # still single use
        assert rotated.take(b.ticket) is None  # another secret reads it as unknown...
        assert worker.take(b.ticket) is None  # ...and the take consumed it all the same
        with pytest.raises(TicketStoreError, match="malformed"):
            unsealed.take(c.ticket)  # a store without the secret cannot use it either
        # a value moved under another ticket's key does not open (bound to the ticket id)
        store.put(a)
        r.rename(redis_prefix + a.ticket.hex(), redis_prefix + b.ticket.hex())
        assert worker.take(b.ticket) is None
        with pytest.raises(ValueError, match="at least 16 bytes"):
            RedisTicketStore(redis_url, secret=b"short")
    finally:
        for s in (store, worker, rotated, unsealed):
            s.close()


def test_redis_store_unreachable_fails_fast_then_cools_down() -> None:
    clock = [0.0]
    store = RedisTicketStore(
        "redis://127.0.0.1:1/0", timeout=0.05, cooldown=5, monotonic=lambda: clock[0]
    )
    with pytest.raises(TicketStoreError, match="unavailable"):
        store.take(b"x")
    with pytest.raises(TicketStoreError, match="cooling down"):
        store.put(ticket(now=dt.datetime.now(dt.UTC).timestamp()))
    clock[0] = 6
    with pytest.raises(TicketStoreError, match="unavailable: "):
        store.take(b"x")
    with pytest.raises(ValueError):
        RedisTicketStore("redis://127.0.0.1:1/0", timeout=0)


def test_redis_store_answering_slowly_cools_down_too(private_redis: RedisServer) -> None:
    """Each call holds the worker's loop: a Redis answering under the timeout but slowly
    (40 ms of 50) stalled every stream, and counted nothing. Such an answer is used, and the
    calls after it fail fast for the cooldown, saying why."""
    store = RedisTicketStore(private_redis.url, timeout=0.5, cooldown=30)
    try:
        t = ticket(now=dt.datetime.now(dt.UTC).timestamp())
        store.put(t)
        private_redis.proc.send_signal(signal.SIGSTOP)
        threading.Timer(0.25, private_redis.proc.send_signal, (signal.SIGCONT,)).start()
        assert store.take(t.ticket) == t  # after 0.25 s: over a fifth of the timeout
        with pytest.raises(TicketStoreError, match=r"cooling down after an answer in \d+ ms"):
            store.put(t)
    finally:
        private_redis.proc.send_signal(signal.SIGCONT)
        store.close()


def test_policy_defaults_override_and_parsing() -> None:
    p = EarlyDataPolicy()
    assert p.mode_for("/v1/chat/completions") is Mode.ACCEPT
    assert p.mode_for("/generate") is Mode.ACCEPT
    assert p.mode_for("/v1/models") is Mode.DEFER
    r = p.overridden(Mode.REJECT)
    assert r.mode_for("/generate") is Mode.REJECT and r.mode_for("/x") is Mode.REJECT
    assert parse_mode(" Accept ") is Mode.ACCEPT
    with pytest.raises(ValueError, match="expected one of accept, defer, reject"):
        parse_mode("yes")
    with pytest.raises(ValueError, match="must be a path"):
        EarlyDataPolicy.from_mapping({"routes": {"generate": "accept"}})
    with pytest.raises(ValueError, match="unknown early-data settings"):
        EarlyDataPolicy.from_mapping({"defaults": "accept"})
    assert "*=defer" in p.describe()


def test_retry_tokens_validate_across_handlers_with_the_same_secret() -> None:
    secret = b"0123456789abcdef-shared"
    a = SharedRetryTokenHandler(secret, clock=lambda: NOW)
    b = SharedRetryTokenHandler(secret, clock=lambda: NOW + 1)
    other = SharedRetryTokenHandler(b"another secret of 16+ bytes", clock=lambda: NOW)
    addr = ("127.0.0.1", 5555)
    token = a.create_token(
        address=addr,
        original_destination_connection_id=b"odcid",
        retry_source_connection_id=b"rscid",
        now=0,
    )
    assert b.validate_token(address=addr, destination_cid=b"rscid", token=token, now=0) == b"odcid"
    # Sealed here (good or not, aioquic checks the rest) or by no key of ours at all.
    assert b.sealed_here(token) and not other.sealed_here(token)
    assert not b.sealed_here(b"") and not b.sealed_here(token[:-1])
    with pytest.raises(ValueError):
        other.validate_token(address=addr, destination_cid=b"rscid", token=token, now=0)
    with pytest.raises(ValueError, match="address"):
        b.validate_token(address=("127.0.0.1", 5556), destination_cid=b"rscid", token=token, now=0)
    late = SharedRetryTokenHandler(secret, clock=lambda: NOW + 60)
    with pytest.raises(ValueError, match="expired"):
        late.validate_token(address=addr, destination_cid=b"rscid", token=token, now=0)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SharedRetryTokenHandler(b"short")


async def test_the_shared_store_names_the_settings_its_tickets_were_issued_under(
    h3_server: H3Factory, dev_certs: Any, redis_url: str
) -> None:
    """A 0-RTT client uses the SETTINGS it remembers: the store's keys name the listener's
    QPACK table capacity, so a release that changes it finds no ticket of the other side of
    a rolling deploy (a full handshake, not a failed 0-RTT connection)."""
    async with h3_server() as server, h3_connect(server.port, dev_certs.ca_cert) as client:
        assert (await client.fetch("GET", "/")).status == 200
        settings = client.h3.received_settings
        assert settings is not None
        capacity = settings.get(Setting.QPACK_MAX_TABLE_CAPACITY, 0)
    assert TICKET_PREFIX.endswith(f":q{capacity}:")
    before = RedisTicketStore(redis_url, prefix="quicedge:ticket:")  # a table of 4096
    now = RedisTicketStore(redis_url)
    try:
        t = ticket()
        before.put(t)
        assert now.take(t.ticket) is None
        now.put(t)
        assert now.take(t.ticket) == t
    finally:
        before.take(t.ticket)
        before.close()
        now.close()
