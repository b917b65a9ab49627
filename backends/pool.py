"""Keep-alive HTTP/1.1 connection pool to the backends: per-backend slots and the response API.

One `UpstreamPool` serves every backend. Per backend (`BackendSlots`) it keeps idle keep-alive
connections (used most-recently-first, closed after `idle_timeout`), and bounds the number of open
connections at `max_connections_per_backend`: a request that finds the cap reached waits for a
free slot, at most `acquire_timeout` seconds and only while fewer than `max_waiters` others wait
(else `UpstreamPoolBusy`: the edge is out of connections, not the backend out of order).

The layers under it: `backends.http1` frames responses and encodes requests (no I/O),
`backends.connection` is the asyncio protocol that feeds it, with its timers and urgent reads.
`UpstreamResponse` (`backends.response`) hands the body over either to a task iterating it or,
through `set_sink`, to a callback run inside the read that brought it (see `docs/routing.md`,
"Following a chunk").

A response that is closed before its body is complete closes its connection: that is how an
upstream request is aborted (the backend sees the disconnect). TCP_NODELAY is set on every socket:
the request goes out in one write and must not wait for Nagle's algorithm (RFC 896) to release it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from backends.connection import READ_HIGH_WATER, Connection
from backends.credentials import BackendCredentials
from backends.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolBusy,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from backends.http1 import MAX_RESPONSE_HEAD, encode_request
from backends.response import UpstreamResponse, response_of
from backends.urgent_reads import UrgentReads

log = logging.getLogger(__name__)

URGENT_AFTER = 0.0005
"""Seconds without any upstream read after which a request start reads the urgent sockets
itself (`UrgentReads`): a loop that polls more often serves first tokens in its own order."""


@dataclass(slots=True)
class BackendPoolStats:
    idle: int
    active: int
    waiting: int


@dataclass(slots=True)
class PoolStats:
    requests: int
    reused: int
    connects: int
    urgent_reads: int = 0
    """Reads of a due first token made between request starts, out of the loop's turn."""
    stale_resends: int = 0
    """Requests sent again on a fresh connection because the reused one had been closed by
    the backend as they went out (RFC 9112 §9.3.1)."""
    backends: dict[str, BackendPoolStats] = field(default_factory=dict)

    @property
    def reuse_ratio(self) -> float:
        """Share of requests that were sent on an already open (warm) connection."""
        return self.reused / self.requests if self.requests else 0.0


def keep_alive_timeout(headers: Sequence[tuple[bytes, bytes]]) -> float | None:
    """The `timeout=N` of a `Keep-Alive` response header, seconds; None if absent or bad."""
    for name, value in headers:
        if name.lower() == b"keep-alive":
            for part in value.split(b","):
                key, _, number = part.strip().partition(b"=")
                if key.strip().lower() == b"timeout":
                    try:
                        seconds = float(number.strip())
                    except ValueError:
                        return None
                    return seconds if seconds > 0 else None
    return None


class BackendSlots:
    """The connections of one backend: idle ones (LIFO), the active count and the waiters."""

    def __init__(self, pool: UpstreamPool, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"backend URL must be http://host[:port], got {base_url!r}")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"backend URL must not have a path or query, got {base_url!r}")
        self.pool = pool
        self.base_url = base_url
        self.hostname = parts.hostname
        self.port = parts.port or 80
        self.host_header = parts.netloc.encode("ascii")
        self.idle: collections.deque[Connection] = collections.deque()
        self.active = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.all: set[Connection] = set()
        self.idle_timeout = pool.idle_timeout
        """The pool's, or less when the backend announced a shorter `Keep-Alive: timeout`."""
        self.learned_keep_alive = False
        self.last_request = float("-inf")
        """`time.monotonic()` of the last request sent to this backend."""
        self.retired = False
        """Forgotten by the pool (`UpstreamPool.forget`): connections close as they come free."""

    @property
    def open_count(self) -> int:
        return self.active + len(self.idle)

    def on_connection_lost(self, conn: Connection) -> None:
        """The connection closed (either side): free its slot."""
        if conn not in self.all:
            return
        self.all.discard(conn)
        try:
            self.idle.remove(conn)
        except ValueError:
            self.active -= 1
        self.wake_one()

    def wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def connect(self) -> Connection:
        if self.pool._closed:  # a request in flight at `aclose` must not open another
            raise UpstreamConnectError("the upstream pool is closed", base_url=self.base_url)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.pool.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self), self.hostname, self.port
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"connect to {self.base_url} timed out after {self.pool.connect_timeout:g}s",
                base_url=self.base_url,
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(
                f"connect to {self.base_url} failed: {exc}", base_url=self.base_url
            ) from exc
        self.pool._connects += 1
        self.all.add(conn)
        if self.pool._closed:  # closed while this connect was under way
            conn.close()
            raise UpstreamConnectError("the upstream pool is closed", base_url=self.base_url)
        return conn

    async def acquire(self) -> tuple[Connection, bool]:
        """A connection for one request and whether it was reused. Takes one active slot.

        Waits for a slot at the cap; raises `UpstreamPoolBusy` when `max_waiters_per_backend`
        requests wait already, or when none came free within `acquire_timeout`."""
        deadline: float | None = None
        while True:
            while self.idle:
                conn = self.idle.pop()
                if conn.idle_handle is not None:
                    conn.idle_handle.cancel()
                    conn.idle_handle = None
                if conn.usable():
                    self.active += 1
                    return conn, True
                # Closed by the backend while idle (its keep-alive timeout): drop it.
                self.idle.append(conn)
                conn.close()
            if self.open_count < self.pool.max_connections_per_backend:
                self.active += 1
                try:
                    conn = await self.connect()
                except BaseException:
                    self.active -= 1
                    self.wake_one()
                    raise
                return conn, False
            # Every slot is taken: wait for one, but not without bound.
            pool = self.pool
            if len(self.waiters) >= pool.max_waiters_per_backend:
                raise UpstreamPoolBusy(
                    f"{len(self.waiters)} requests already wait for one of the"
                    f" {pool.max_connections_per_backend} connections to {self.base_url}",
                    base_url=self.base_url,
                )
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + pool.acquire_timeout
            waiter = loop.create_future()
            self.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self.wake_one()  # pass on the slot we were given
                else:
                    self._forget(waiter)
                if isinstance(exc, TimeoutError):
                    raise UpstreamPoolBusy(
                        f"no connection to {self.base_url} came free within"
                        f" {pool.acquire_timeout:g}s (all {pool.max_connections_per_backend}"
                        " in use)",
                        base_url=self.base_url,
                    ) from None
                raise

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        """Drop a waiter that gave up, so that `waiters` counts only those still waiting."""
        try:
            self.waiters.remove(waiter)
        except ValueError:
            pass

    def release(self, conn: Connection) -> None:
        """The response is complete: keep the connection if HTTP allows it, else close it."""
        if conn.closed:
            return
        response = conn.response
        conn.in_flight = False
        conn.sink = None
        conn.on_head = None
        conn.not_urgent()
        if response.keep_alive and not response.extra and not conn.eof and not self.retired:
            if not self.learned_keep_alive:
                self._learn_keep_alive(response.headers)
            self._keep(conn)
        else:
            conn.close()

    def _learn_keep_alive(self, headers: list[tuple[bytes, bytes]]) -> None:
        """`Keep-Alive: timeout=N` (RFC 9112 appendix C.2.2, as nginx and Apache send it): close
        idle connections a second before the backend would, so a request never races its
        close. Read once per backend; uvicorn (SGLang) sends none and the pool's default holds."""
        self.learned_keep_alive = True
        timeout = keep_alive_timeout(headers)
        if timeout is not None:
            self.idle_timeout = max(min(self.pool.idle_timeout, timeout - 1.0), timeout / 2)

    def _keep(self, conn: Connection) -> None:
        self.active -= 1
        self.idle.append(conn)
        conn.idle_handle = conn.loop.call_later(self.idle_timeout, conn.close)
        self.wake_one()

    def stats(self) -> BackendPoolStats:
        return BackendPoolStats(idle=len(self.idle), active=self.active, waiting=len(self.waiters))


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to every backend, bounded per backend."""

    def __init__(
        self,
        *,
        max_connections_per_backend: int = 128,
        idle_timeout: float = 4.0,
        connect_timeout: float = 2.0,
        max_waiters_per_backend: int = 256,
        acquire_timeout: float = 5.0,
        urgent_reads: bool = True,
    ) -> None:
        if max_connections_per_backend < 1:
            raise ValueError("max_connections_per_backend must be at least 1")
        if max_waiters_per_backend < 0:
            raise ValueError("max_waiters_per_backend must be at least 0")
        if idle_timeout <= 0 or connect_timeout <= 0 or acquire_timeout <= 0:
            raise ValueError("idle_timeout, connect_timeout and acquire_timeout must be positive")
        self.max_connections_per_backend = max_connections_per_backend
        self.max_waiters_per_backend = max_waiters_per_backend
        """Requests that may wait for a free connection to one backend; more get
        `UpstreamPoolBusy` at once (0: none waits)."""
        self.acquire_timeout = acquire_timeout
        """Seconds a request waits for a free connection before `UpstreamPoolBusy`."""
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.urgent = UrgentReads() if urgent_reads and UrgentReads.available else None
        """Sockets whose first token is due, read between request starts (`UrgentReads`)."""
        self.last_read = 0.0
        """`perf_counter()` of the last read of any upstream socket."""
        self.urgent_reads = 0
        self._stale_resends = 0
        self._hosts: dict[str, BackendSlots] = {}
        self._requests = 0
        self._reused = 0
        self._connects = 0
        self._closed = False

    def _host(self, base_url: str) -> BackendSlots:
        host = self._hosts.get(base_url)
        if host is None:
            if self._closed:
                raise UpstreamConnectError("the upstream pool is closed", base_url=base_url)
            host = self._hosts[base_url] = BackendSlots(self, base_url.rstrip("/"))
        return host

    async def warm(self, base_url: str, count: int, *, if_used: bool = False) -> None:
        """Open up to `count` idle connections (within the cap). Failures are logged, not raised.

        `if_used`: only if a request went to this backend within its idle timeout. A backend
        closes idle connections (uvicorn after 5 s), so topping them up with no traffic would
        reconnect in a loop; after a quiet spell the first request pays one connect."""
        host = self._host(base_url)
        if if_used and time.monotonic() - host.last_request > host.idle_timeout:
            return
        want = min(count, self.max_connections_per_backend) - host.open_count
        if want <= 0:
            return
        host.active += want  # reserve the slots while connecting
        connects = [host.connect() for _ in range(want)]
        results = await asyncio.gather(*connects, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for result in results:
            if isinstance(result, Connection):
                if result.closed:
                    continue  # its slot was already freed by on_connection_lost
                host.active -= 1
                host.idle.append(result)
                result.idle_handle = loop.call_later(host.idle_timeout, result.close)
            else:
                host.active -= 1
                log.warning("warming %s: %s", base_url, result)
        host.wake_one()

    def forget(self, base_url: str) -> None:
        """Drop a backend that left the fleet: its idle connections close now, those still
        carrying a request when they end, and its stats go (a fleet whose pods come and go
        would otherwise keep an entry, and a metric series, for every address it ever had).
        A later request to `base_url` starts afresh."""
        host = self._hosts.pop(base_url.rstrip("/"), None)
        if host is None:
            return
        host.retired = True
        for conn in list(host.idle):
            conn.close()

    def adopt(self, base_url: str, transport: asyncio.BaseTransport) -> Connection:
        """Take an already open stream `transport` to `base_url` as an idle connection (within
        the cap), as if the pool had connected it; return its protocol, which the transport's
        reads must be given to. For transports the pool cannot open itself, and for measuring
        the request path without sockets (`tools.request_cpu`)."""
        host = self._host(base_url)
        if host.open_count >= self.max_connections_per_backend:
            raise UpstreamPoolBusy(
                f"all {self.max_connections_per_backend} connections to {base_url} are open",
                base_url=base_url,
            )
        conn = Connection(host)
        conn.connection_made(transport)
        host.all.add(conn)
        host.idle.append(conn)
        host.wake_one()
        return conn

    async def request(
        self,
        base_url: str,
        method: str,
        path: str,
        *,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        first_byte_timeout: float | None = None,
        chunk_timeout: float | None = None,
        on_head: Callable[[UpstreamResponse], None] | None = None,
    ) -> UpstreamResponse:
        """Send one request; return once the status line and headers arrived.

        `on_head`, if given, gets the response from inside the read callback that completed its
        head, before this call returns: a relay can pass the head and the first token on
        without waiting for this task's turn (it must not raise). Such a response's socket is
        urgent until its first token went on (`UrgentReads`): reading it early helps only where
        a callback can act on what it brings. After sending, the urgent sockets of other
        responses are read at once if the loop has read none for `URGENT_AFTER`."""
        host = self._host(base_url)
        data = encode_request(host.host_header, method, path, headers, body)
        self._requests += 1
        host.last_request = time.monotonic()
        for attempt in (0, 1):
            conn, reused = await host.acquire()
            began: list[UpstreamResponse] = []
            try:
                conn.send(data, is_urgent=on_head is not None)
                if on_head is not None:
                    conn.on_head = partial(
                        self._head_arrived, conn, reused, chunk_timeout, on_head, began
                    )
                self.read_urgent()
                await conn.wait_head(first_byte_timeout, began)
            except (UpstreamError, OSError) as exc:
                stale = reused and not conn.received_any and conn.eof and not self._closed
                conn.close()
                if stale and attempt == 0 and not isinstance(exc, UpstreamTimeout):
                    # The backend closed this idle connection just as we reused it (its
                    # keep-alive timeout raced our request); nothing was processed, so a
                    # fresh connection is safe (RFC 9112 §9.3.1).
                    self._stale_resends += 1
                    continue
                if isinstance(exc, UpstreamError):
                    raise
                raise UpstreamProtocolError(
                    f"{base_url} failed before the response head: {exc}", base_url=base_url
                ) from None
            except BaseException:
                conn.close()  # cancelled: the request may be half sent
                raise
            if reused:
                self._reused += 1
            if began:
                return began[0]
            return response_of(conn, reused, chunk_timeout)
        raise AssertionError("unreachable")

    @staticmethod
    def _head_arrived(
        conn: Connection,
        reused: bool,
        chunk_timeout: float | None,
        on_head: Callable[[UpstreamResponse], None],
        began: list[UpstreamResponse],
    ) -> None:
        response = response_of(conn, reused, chunk_timeout)
        began.append(response)
        on_head(response)

    def read_urgent(self) -> None:
        """Read, now, the sockets whose first token is due and has arrived (`UrgentReads`),
        unless an upstream socket was read in the last `URGENT_AFTER` seconds."""
        urgent = self.urgent
        if urgent is not None and time.perf_counter() - self.last_read > URGENT_AFTER:
            urgent.poll()

    def stats(self) -> PoolStats:
        return PoolStats(
            requests=self._requests,
            reused=self._reused,
            connects=self._connects,
            urgent_reads=self.urgent_reads,
            stale_resends=self._stale_resends,
            backends={url: host.stats() for url, host in self._hosts.items()},
        )

    async def aclose(self) -> None:
        """Close every connection; requests in flight see UpstreamProtocolError."""
        self._closed = True
        for host in self._hosts.values():
            for conn in list(host.all):
                conn.close()
            for waiter in host.waiters:
                if not waiter.done():
                    waiter.set_exception(
                        UpstreamConnectError("the upstream pool is closed", base_url=host.base_url)
                    )
        self._hosts.clear()
        if self.urgent is not None:
            self.urgent.close()
            self.urgent = None

    def __repr__(self) -> str:
        parts = [f"{u}: {h.active} active, {len(h.idle)} idle" for u, h in self._hosts.items()]
        return f"<UpstreamPool {'; '.join(parts) or 'empty'}>"


class KeyedPool:
    """`pool` for a caller that sends its own requests to backends (pre-warming): each request
    gets its backend's `Authorization` from `credentials` as they are when it starts (a reload
    may have rotated them). Not for other hosts (a guard model): they must not see the key."""

    def __init__(self, pool: UpstreamPool, credentials: BackendCredentials) -> None:
        self.pool = pool
        self.credentials = credentials

    async def request(
        self,
        base_url: str,
        method: str,
        path: str,
        *,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        **options: Any,
    ) -> UpstreamResponse:
        keyed = self.credentials.with_auth(base_url, list(headers))
        return await self.pool.request(base_url, method, path, headers=keyed, body=body, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


__all__ = [
    "MAX_RESPONSE_HEAD",
    "READ_HIGH_WATER",
    "BackendPoolStats",
    "BackendSlots",
    "KeyedPool",
    "PoolStats",
    "UpstreamPool",
    "UpstreamResponse",
]
