"""`[serve] ticket_ttl` bounds how long an issued session ticket waits for its one use: in the
Redis every worker and machine shares, each new connection stores one (about 0.7 KB), for a
day unless told otherwise."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import redis

from tests.transport.conftest import H3Factory
from tests.transport.h3client import fresh_ticket
from transport.config import TransportConfig
from transport.listeners import ticket_store
from transport.tickets import TICKET_PREFIX, RedisTicketStore


async def test_a_shorter_ticket_ttl_is_how_long_redis_keeps_a_ticket(
    h3_server: H3Factory, dev_certs: Any, redis_url: str
) -> None:
    config = replace(TransportConfig(), redis=redis_url, redis_timeout=1.0, ticket_ttl=30.0)
    store = ticket_store(config.validate())
    assert isinstance(store, RedisTicketStore)
    try:
        async with h3_server(tickets=store) as server:
            ticket = await fresh_ticket(server.port, dev_certs.ca_cert)
        kept = redis.Redis.from_url(redis_url).pttl(TICKET_PREFIX + ticket.ticket.hex())
        assert 0 < kept <= 30_000
    finally:
        store.close()


@pytest.mark.parametrize("ttl", [0.0, -1.0, 86401.0])
def test_a_ticket_ttl_outside_its_lifetime_is_refused(ttl: float) -> None:
    with pytest.raises(ValueError, match="serve.ticket_ttl"):
        replace(TransportConfig(), ticket_ttl=ttl).validate()
