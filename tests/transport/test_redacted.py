"""Redis URLs in logs and messages lose their credentials, and nothing else."""

from __future__ import annotations

import pytest

from transport.redacted import without_password
from transport.tickets import RedisTicketStore


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@redis:6379/0", "redis://***@redis:6379/0"),
        ("rediss://edge:s3cret@[::1]:6380/2?ssl_cert_reqs=none",
         "rediss://***@[::1]:6380/2?ssl_cert_reqs=none"),
        ("redis://p%40ss:w@rd@h/0", "redis://***@h/0"),
        ("redis://s3cret@redis:6379/0", "redis://***@redis:6379/0"),
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=1"),
        ("not a url", "not a url"),
    ],
)  # fmt: skip
def test_only_the_credentials_are_hidden(url: str, shown: str) -> None:
    assert without_password(url) == shown


def test_the_ticket_store_names_its_redis_without_the_password() -> None:
    store = RedisTicketStore("redis://:s3cret@127.0.0.1:1/0")
    try:
        assert "s3cret" not in repr(store) and "127.0.0.1:1" in repr(store)
    finally:
        store.close()
