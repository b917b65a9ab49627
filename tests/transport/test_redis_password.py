"""A Redis that needs a password (`requirepass`): `serve --workers 2` shares its tickets there,
and what it prints names the server without the password, which would otherwise be in every
pod's log."""

from __future__ import annotations

from collections.abc import Callable

from certs.dev import ensure_dev_certificates
from tests.helpers import RedisServer
from tests.transport.conftest import ServeProcess
from tests.transport.h3client import fresh_ticket, h3_connect


async def test_serve_uses_a_password_redis_and_never_prints_the_password(
    serve_process: Callable[..., ServeProcess],
) -> None:
    redis = RedisServer(password="s3cret-redis-pw")
    try:
        server = serve_process("--demo", "--workers", "2", "--redis", redis.url,
                               "--redis-timeout", "1")  # fmt: skip
        ca = ensure_dev_certificates().ca_cert
        ticket = await fresh_ticket(server.h3_port, ca)
        async with h3_connect(server.h3_port, ca, ticket=ticket) as client:
            await client.fetch("GET", "/echo")
            assert client.handshake is not None and client.handshake.session_resumed
        assert server.stop() == 0
        printed = "\n".join(server.lines) + server.errors()
        assert f"redis://***@127.0.0.1:{redis.port}/0" in printed
        assert "s3cret-redis-pw" not in printed
    finally:
        redis.stop()
