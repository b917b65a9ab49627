"""Connection caps per listener and per client address.

`ConnectionGate` counts a listener's open connections, in total and per client IP address,
and, where a rate is set, how fast each address opens new ones (a token bucket per address);
`admit` says which cap a new one is over (it is then closed at once and counted by the
listener's `on_refused`), `release` forgets one that closed. `h1_server.H1Listener` asks it in
`connection_made`. hypercorn (the TLS listener) accepts its connections itself;
`gate_hypercorn` makes its per-connection server ask the gate set on its config, before the
connection reads anything (the TLS handshake has happened by then: asyncio's `start_server`
does it before the callback). The QUIC listener (`h3_server`) asks it for a client's first
Initial datagram, before any connection state or TLS work (`h3_caps`).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import Any

from hypercorn.asyncio import run as hypercorn_run
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.events import Closed, Event, RawData, Updated

from transport.hypercorn_send import send_timeout_of

LISTENER_CAP = "listener_cap"
CLIENT_CAP = "client_cap"
CLIENT_RATE = "client_rate"
"""A connection over its client address's rate of new connections."""
RATE_TABLE_MAX = 65536
"""Client addresses whose rate a gate keeps: past it, the address that opened a connection
longest ago is forgotten (its bucket has refilled the most: forgetting it gives it the least)."""
RAPID_RESET = "rapid_reset"
"""A connection sent away for resetting most of its requests (`resets_most`)."""
CONTROL_FLOOD = "control_flood"
"""An HTTP/2 connection sent away for sending control frames out of all proportion to its
requests (`floods_control`)."""
CONTROL_FRAMES_FREE = 1000
"""Control frames (PING, SETTINGS, WINDOW_UPDATE, PRIORITY, empty DATA, unknown types) an
HTTP/2 connection may send before they are weighed against its exchanges."""
CONTROL_FRAMES_PER_EXCHANGE = 10
"""Then, control frames allowed per request received and per DATA frame sent."""
RAPID_RESETS = 100
"""Streams a client may reset before their response ended, on one connection, before the
share of its requests it resets is checked."""


def floods_control(control_frames: int, exchanges: int) -> bool:
    """Whether a connection's control frames are out of all proportion to its exchanges
    (requests received and DATA frames sent). Each costs the listener 6 to 16 µs of CPU, and a
    client sending nothing else held a core and slowed every other connection on the worker
    from 0.6 ms to 0.9–1.3 s a request; real clients send a few per request (window updates,
    keep-alive pings)."""
    return (
        control_frames > CONTROL_FRAMES_FREE
        and control_frames > CONTROL_FRAMES_PER_EXCHANGE * exchanges
    )


def resets_most(cancelled: int, requests: int) -> bool:
    """The rapid-reset pattern (CVE-2023-44487): past `RAPID_RESETS` streams reset before their
    response ended, and more than half of the connection's requests. A reset stream frees its
    place among the concurrent streams at once, so without this one connection could start
    requests, and the backend work behind them, without bound; a client that cancels a
    generation now and then is far from it."""
    return cancelled > RAPID_RESETS and 2 * cancelled > requests


class ConnectionGate:
    """Open connections of one listener, in total and per client address, and the rate at
    which each address opens new ones."""

    __slots__ = ("_buckets", "_clock", "burst", "max_connections", "max_per_client",
                 "on_refused", "open", "per_client", "rate")  # fmt: skip

    def __init__(
        self,
        max_connections: int = 0,
        max_per_client: int = 0,
        on_refused: Callable[[str], None] | None = None,
        *,
        rate: float = 0.0,
        burst: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_connections = max_connections
        """0: no cap."""
        self.max_per_client = max_per_client
        """0: no cap (and no table per address is kept)."""
        self.on_refused = on_refused
        self.open = 0
        self.per_client: dict[str, int] = {}
        self.rate = rate
        """New connections per second one address may open; 0: no limit."""
        self.burst = max(1, burst)
        """New connections one address may open at once (its bucket's size)."""
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}
        """By address, oldest first: its tokens and when they were counted."""

    @property
    def active(self) -> bool:
        """Whether any cap is set (without one, a listener need not count)."""
        return bool(self.max_connections or self.max_per_client or self.rate)

    def admit(self, host: str | None) -> str | None:
        """Count a new connection from `host`; or return the cap it is over (not counted)."""
        if self.max_connections and self.open >= self.max_connections:
            return self._refuse(LISTENER_CAP)
        if self.max_per_client and host is not None:
            count = self.per_client.get(host, 0)
            if count >= self.max_per_client:
                return self._refuse(CLIENT_CAP)
        if self.rate and host is not None and not self._take(host):
            return self._refuse(CLIENT_RATE)
        if self.max_per_client and host is not None:
            self.per_client[host] = self.per_client.get(host, 0) + 1
        self.open += 1
        return None

    def _take(self, host: str) -> bool:
        """One token from `host`'s bucket, refilled at `rate` up to `burst`; whether it had one.
        A refused connection costs no token: a client that keeps knocking is let in at the
        rate all the same."""
        now = self._clock()
        tokens, at = self._buckets.pop(host, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        taken = tokens >= 1.0
        self._buckets[host] = (tokens - 1.0 if taken else tokens, now)  # now the newest
        if len(self._buckets) > RATE_TABLE_MAX:
            del self._buckets[next(iter(self._buckets))]
        return taken

    def release(self, host: str | None) -> None:
        """An admitted connection from `host` closed."""
        self.open -= 1
        if self.max_per_client and host is not None:
            left = self.per_client.get(host, 1) - 1
            if left > 0:
                self.per_client[host] = left
            else:
                self.per_client.pop(host, None)

    def _refuse(self, reason: str) -> str:
        if self.on_refused is not None:
            self.on_refused(reason)
        return reason


GATE_ATTRIBUTE = "quicedge_gate"
"""The hypercorn `Config` attribute that holds a listener's `ConnectionGate`."""


class _GatedTCPServer(TCPServer):
    """hypercorn's per-connection server, asking its config's gate first (if it has one); its
    writes wait for the client at most its config's send timeout (`transport.hypercorn_send`).
    Once the client has closed, its idle timer is stopped: hypercorn waited for it, and the
    connection held its place under the caps for `keep_alive_timeout` more (a client opening a
    connection per request, 25 a second, met a cap of 256 at 10 s)."""

    _client_gone = False

    async def _read_data(self) -> None:
        await super()._read_data()
        self._client_gone = True
        await self.idle_task.stop()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated) and (self._client_gone or _cancelling()):
            return  # no idle timer for a connection whose client is gone, or that is ending
        limit = send_timeout_of(self.config)
        if limit is None or not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        async with self.send_lock:  # as hypercorn's, with the drain bounded when it would wait
            try:
                self.writer.write(event.data)
                transport = self.writer.transport
                if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
                    async with asyncio.timeout(limit.seconds):
                        await self.writer.drain()
            except TimeoutError:
                limit.stalled()
                transport.abort()
                await self.protocol.handle(Closed())
            except (ConnectionError, RuntimeError):
                await self.protocol.handle(Closed())

    async def _close(self) -> None:
        try:
            await super()._close()
        except ssl.SSLError:
            # The client's last frames crossed our close_notify (TLS: "application data after
            # close notify"); the connection is closed all the same. hypercorn lets it escape
            # as an unhandled exception of the connection's task.
            pass

    async def run(self) -> None:
        try:
            await self._gated_run()
        except (asyncio.CancelledError, BaseExceptionGroup) as exc:
            if not _ended_by_the_drain(exc):
                raise
            # hypercorn's graceful timeout cancelled this connection, as the listener asked:
            # ended quietly, where asyncio would log its task as an unhandled error (3.11's
            # stream callback reads a cancelled task's exception, and hypercorn's idle timer,
            # restarted in the cancelled task group, raises "TaskGroup is shutting down").

    async def _gated_run(self) -> None:
        gate: ConnectionGate | None = getattr(self.config, GATE_ATTRIBUTE, None)
        if gate is None:
            await super().run()
            return
        peer: Any = self.writer.get_extra_info("peername")
        host = str(peer[0]) if peer else None
        if gate.admit(host) is not None:
            self.writer.transport.abort()  # at once, and no TLS close_notify to wait for
            return
        try:
            await super().run()
        finally:
            gate.release(host)


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _ended_by_the_drain(exc: BaseException) -> bool:
    """The connection's task is being cancelled and `exc` is only what that cancellation raised
    (in hypercorn's task group too)."""
    if not _cancelling():
        return False
    if isinstance(exc, asyncio.CancelledError):
        return True
    assert isinstance(exc, BaseExceptionGroup)
    return exc.split((asyncio.CancelledError, RuntimeError))[1] is None


def gate_hypercorn() -> None:
    """Have hypercorn's asyncio worker serve connections through `_GatedTCPServer`; a config
    without a gate is served exactly as before. Idempotent."""
    hypercorn_run.TCPServer = _GatedTCPServer  # type: ignore[misc]


__all__ = [
    "CLIENT_CAP",
    "CLIENT_RATE",
    "GATE_ATTRIBUTE",
    "LISTENER_CAP",
    "CONTROL_FLOOD",
    "CONTROL_FRAMES_FREE",
    "CONTROL_FRAMES_PER_EXCHANGE",
    "RAPID_RESET",
    "RAPID_RESETS",
    "ConnectionGate",
    "floods_control",
    "gate_hypercorn",
    "resets_most",
]
