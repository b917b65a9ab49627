"""A TCP relay in front of a real Redis whose open connections can be made silently dead.

`sever()` is what a failover, a partition or a dropped NAT entry does to a connection: bytes
either way vanish, and nothing is closed, so neither side ever reads an end or a reset. New
connections still go through, as they would to the Redis a failover promoted.

`slow_after` and `reply_delay` make Redis's answers late without losing the commands: a
connection that sends a chunk holding one of `slow_after` (say b"MULTI") gets every answer from
then on `reply_delay` seconds late, while its commands reach Redis at once."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from urllib.parse import urlsplit


class SilentRelay:
    def __init__(self, redis_url: str) -> None:
        """In front of the Redis at `redis_url` (redis://host:port/db)."""
        upstream = urlsplit(redis_url)
        if upstream.scheme != "redis" or upstream.port is None:
            raise ValueError(f"a relay needs a redis://host:port URL, got {redis_url!r}")
        self.upstream = (upstream.hostname or "127.0.0.1", upstream.port)
        self.db = upstream.path or "/0"
        self.port = 0
        self.connections = 0
        """Connections accepted so far."""
        self._server: asyncio.AbstractServer | None = None
        self._severed: set[int] = set()
        self.slow_after: tuple[bytes, ...] = ()
        self.reply_delay = 0.0
        self._slow: set[int] = set()
        self._open: dict[int, tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}{self.db}"

    async def __aenter__(self) -> SilentRelay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        for pair in list(self._open.values()):
            for writer in pair:
                writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def sever(self) -> int:
        """Every connection open now goes silently dead; returns how many there were."""
        self._severed |= set(self._open)
        return len(self._open)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        number = self.connections
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        self._open[number] = (writer, up_writer)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, number, to_redis=True),
                self._pipe(up_reader, writer, number, to_redis=False),
            )
        finally:
            self._open.pop(number, None)
            self._tasks.discard(task)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: Any, number: int, *, to_redis: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if number in self._severed:
                    continue  # dropped on the floor: no FIN, no RST
                if to_redis and any(pattern in data for pattern in self.slow_after):
                    self._slow.add(number)
                elif not to_redis and number in self._slow and self.reply_delay:
                    await asyncio.sleep(self.reply_delay)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
