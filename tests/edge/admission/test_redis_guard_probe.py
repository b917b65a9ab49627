"""The Redis guard's probe outlives any failure of its PING: a server that answers oddly enough
for redis-py to raise something other than a RedisError leaves the breaker open, still probing,
and the breaker closes once the server answers properly again."""

from __future__ import annotations

import asyncio
import contextlib

from edge.admission.redis_guard import RedisGuard, RedisUnavailable
from edge.admission.settings import RedisSettings
from tests.helpers import wait_until


class OddRedis:
    """A RESP server on a loopback port: `drop` closes each connection at once, `odd` answers
    HELLO with a bare +OK (redis-py reads it as a map and raises AttributeError), `redis`
    answers HELLO, PING and the rest as a Redis does."""

    def __init__(self) -> None:
        self.mode = "drop"
        self.odd_answers = 0
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> OddRedis:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while self.mode != "drop":
                command = await _command(reader)
                if command is None:
                    return
                if command[0].upper() != b"HELLO":
                    writer.write(b"+PONG\r\n" if command[0].upper() == b"PING" else b"+OK\r\n")
                elif self.mode == "odd":
                    self.odd_answers += 1
                    writer.write(b"+OK\r\n")
                else:
                    writer.write(b"%1\r\n+proto\r\n:3\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()


async def _command(reader: asyncio.StreamReader) -> list[bytes] | None:
    """One RESP command (an array of bulk strings); None at the end of the connection."""
    head = await reader.readline()
    if not head:
        return None
    parts = []
    for _ in range(int(head[1:])):
        size = int((await reader.readline())[1:])
        parts.append((await reader.readexactly(size + 2))[:-2])
    return parts


async def test_a_probe_that_fails_oddly_keeps_probing_until_redis_answers() -> None:
    states: list[str] = []
    async with OddRedis() as server:
        # generous deadlines: only the probe's survival is checked, not its speed
        settings = RedisSettings(url=server.url, timeout_ms=2000, slow_ms=1000, backoff_s=0.02,
                                 backoff_max_s=0.05)  # fmt: skip
        guard = RedisGuard(settings, on_state=lambda name, old, new: states.append(new))
        try:
            for _ in range(3):
                with contextlib.suppress(RedisUnavailable):
                    await guard.run(guard.client.ping)
            assert guard.state == "open"
            server.mode = "odd"
            await wait_until(lambda: server.odd_answers >= 2, timeout=10)  # two probes failed
            with contextlib.suppress(RedisUnavailable):
                await guard.run(guard.client.ping)  # refused while it is not closed
            server.mode = "redis"
            await wait_until(lambda: guard.state == "closed", timeout=10)
            assert states[0] == "open" and states[-1] == "closed"
            assert guard.trips == 1
        finally:
            await guard.aclose()
