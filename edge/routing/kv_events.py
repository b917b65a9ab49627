"""SGLang's KV-cache events, consumed: the backend's own word on what its cache holds.

With `[kv_events] enabled`, the edge subscribes to each backend's event socket (SGLang started
with `--kv-events-config '{"publisher":"zmq","endpoint":"tcp://*:5557"}'`; the wire format is
in `backends.kv_events`) and keeps, per backend, the blocks it says it holds. Two events act:

- `AllBlocksCleared`, and a new server process, whose cache is empty: a sequence number that
  starts again from below the last one seen, or, after the connection broke, one that does not
  go on from it (SGLang numbers from 0 per process, so a new server that sent more messages
  before the edge reconnected than its predecessor ever did numbers past it). The edge does
  what it does for a restart found any other way: the routing tree forgets what it believed
  was cached there and, with pre-warming on, the hot prefixes are warmed there again. A
  connection that breaks and goes on with the next number is the same process.
- `BlockStored` / `BlockRemoved` keep the count of cached blocks (and tokens) per backend, on
  `/backends` and in metrics. Their hashes are of token blocks, which the edge (routing on text,
  without the model's tokenizer) cannot match against a request: they are counted, not matched.

A gap in the sequence numbers (messages dropped past ZMQ's high-water mark, or sent before the
subscription was made) is counted; the block count is then approximate until the next clear.
Nothing here is on the request path: each backend's socket is read by a task of its own, and a
backend that publishes nothing costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventError,
    decode_message,
)
from backends.registry import Backend

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(slots=True)
class KvEventsConfig:
    """`[kv_events]`: subscribe to each backend's KV-cache events (SGLang `--kv-events-config`)."""

    enabled: bool = False
    """Subscribe to every backend's event socket. Off by default: SGLang publishes nothing
    unless started with a zmq publisher."""
    endpoint: str = "tcp://{host}:5557"
    """Each backend's event socket; `{host}` is the backend URL's host (an IPv6 address in
    brackets), `{port}` its port."""
    endpoints: dict[str, str] = field(default_factory=dict)
    """Backend name or URL -> its event socket, for backends `endpoint` does not fit (several
    servers on one host)."""
    topic: str = ""
    """The publisher's topic (SGLang's `topic`; empty: every message)."""
    rescan_interval: float = 1.0
    """Seconds between looks at the backend list (backends that discovery adds or removes)."""

    def validate(self) -> None:
        for where, value in (("endpoint", self.endpoint), *self.endpoints.items()):
            if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"kv_events.endpoints: {where}: expected tcp://, got {value!r}")
        try:
            self.endpoint.format(host="h", port=1)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"kv_events.endpoint: only {{host}} and {{port}} may be filled in ({exc})"
            ) from None
        if not self.rescan_interval > 0:
            raise ValueError("kv_events.rescan_interval: must be > 0")


# Flags carry the section's name (`--kv-events-endpoint`); `enabled` is `--kv-events`, and the
# per-backend `endpoints` table is TOML only.
KV_EVENTS_FLAGS: dict[str, str | bool] = {
    f.name: False if f.name == "endpoints"
    else "--kv-events" if f.name == "enabled"
    else "--kv-events-" + f.name.replace("_", "-")
    for f in dataclasses.fields(KvEventsConfig)
}  # fmt: skip


def endpoint_for(config: KvEventsConfig, backend: Backend) -> str:
    named = config.endpoints.get(backend.name) or config.endpoints.get(backend.url)
    if named is not None:
        return named
    parts = urlsplit(backend.url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:  # an IPv6 address, as a URL writes it
        host = f"[{host}]"
    return config.endpoint.format(host=host, port=parts.port or 80)


@dataclass(slots=True)
class BackendEvents:
    """What one backend's events said."""

    endpoint: str
    blocks: int = 0
    """Blocks it holds, by its events (stored less removed, since the last clear)."""
    block_size: int = 0
    """Tokens per block, from its last `BlockStored`."""
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    restarts: int = 0
    """Sequence numbers that started again: a new server process."""
    gaps: int = 0
    """Messages missed (a jump in the sequence numbers)."""
    disconnects: int = 0
    """Times the connection to the publisher broke (ZMQ reconnects by itself)."""
    broken: bool = False
    """The connection broke since the last message: the next one may be a new process's."""
    malformed: int = 0
    last_seq: int | None = None
    last_at: float | None = None
    error: str | None = None
    """Why the socket could not be opened (an address ZMQ refuses), if it could not."""

    def snapshot(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint, "blocks": self.blocks,
            "tokens": self.blocks * self.block_size, "stored": self.stored,
            "removed": self.removed, "cleared": self.cleared, "restarts": self.restarts,
            "gaps": self.gaps, "disconnects": self.disconnects, "malformed": self.malformed,
            "last_seq": self.last_seq, "error": self.error,
            "last_event_age_s": None if self.last_at is None
            else round(time.monotonic() - self.last_at, 3),
        }  # fmt: skip


class KvEvents:
    """One SUB socket and task per backend; `on_cleared(backend)` when a cache is found empty."""

    def __init__(
        self,
        config: KvEventsConfig,
        *,
        backends: Sequence[Backend],
        on_cleared: Callable[[Backend], None],
    ) -> None:
        config.validate()
        self.config = config
        self._backends = backends
        self._on_cleared = on_cleared
        self._context: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._rescan: asyncio.Task[None] | None = None
        self.by_backend: dict[str, BackendEvents] = {}
        """Backend url -> what its events said."""

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._sync()
        self._rescan = asyncio.get_running_loop().create_task(self._watch())

    async def aclose(self) -> None:
        tasks = [*self._tasks.values(), *([self._rescan] if self._rescan else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.rescan_interval)
            self._sync()

    def _sync(self) -> None:
        """A task for each backend in the list, none for those gone from it."""
        current = {b.url: b for b in self._backends}
        for url in [u for u in self._tasks if u not in current]:
            self._tasks.pop(url).cancel()
            self.by_backend.pop(url, None)
        loop = asyncio.get_running_loop()
        for url, backend in current.items():
            if url not in self._tasks:
                state = BackendEvents(endpoint_for(self.config, backend))
                self.by_backend[url] = state
                self._tasks[url] = loop.create_task(self._listen(backend, state))

    async def _listen(self, backend: Backend, state: BackendEvents) -> None:
        assert self._context is not None
        socket = self._context.socket(zmq.SUB)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            # IPv4 and IPv6: without it an IPv6 address is never connected to, and silently.
            socket.setsockopt(zmq.IPV6, 1)
            # Bounded: ZMQ drops the connection of a peer that sends a larger message (SGLang's
            # batches are a few blocks; a long prompt's at page size 1 a few MiB), and at most
            # RCVHWM (1000) messages wait to be read.
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            socket.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
            try:
                socket.connect(state.endpoint)  # ZMQ connects (and reconnects) in the background
            except zmq.ZMQError as exc:
                state.error = f"{state.endpoint}: {exc.strerror}"
                log.warning("kv events: cannot subscribe to %s (%s)", backend.name, state.error)
                return
            poller = zmq.asyncio.Poller()
            poller.register(socket, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll())
                # The break is queued long before a new connection's first message (ZMQ waits
                # its reconnect interval), so taken first it is never read after that message.
                if monitor in ready:
                    await monitor.recv_multipart()
                    state.disconnects += 1
                    state.broken = True
                if socket in ready:
                    self.take(backend, state, await socket.recv_multipart())
        finally:
            with contextlib.suppress(zmq.ZMQError):
                socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)

    def take(self, backend: Backend, state: BackendEvents, parts: Sequence[bytes]) -> None:
        """Apply one published message."""
        try:
            seq, events = decode_message(parts)
        except KvEventError as exc:
            state.malformed += 1
            if state.malformed == 1:
                log.warning("kv events from %s: %s (counted, not logged again)", backend.name, exc)
            return
        state.last_at = time.monotonic()
        last, broken = state.last_seq, state.broken
        state.last_seq, state.broken = seq, False
        if last is not None and seq <= last:  # numbered from 0 again: a new server process
            state.restarts += 1
            self._empty(backend, state, "its event numbers started again")
        elif last is not None and broken and seq != last + 1:
            state.restarts += 1
            self._empty(backend, state, "a new connection's event numbers do not go on")
        elif last is not None and seq > last + 1:
            state.gaps += seq - last - 1
        for event in events:
            if isinstance(event, BlockStored):
                state.stored += len(event.block_hashes)
                state.blocks += len(event.block_hashes)
                state.block_size = event.block_size
            elif isinstance(event, BlockRemoved):
                state.removed += len(event.block_hashes)
                state.blocks = max(0, state.blocks - len(event.block_hashes))
            elif isinstance(event, AllBlocksCleared):
                state.cleared += 1
                self._empty(backend, state, "AllBlocksCleared")

    def _empty(self, backend: Backend, state: BackendEvents, why: str) -> None:
        state.blocks = 0
        log.info("kv events: %s cache is empty (%s)", backend.name, why)
        with contextlib.suppress(Exception):  # a failing hook must not end the listener
            self._on_cleared(backend)

    def snapshot(self) -> dict[str, Any]:
        names = {b.url: b.name for b in self._backends}
        return {names.get(u, u): s.snapshot() for u, s in self.by_backend.items()}

    def collect(self) -> Iterator[Metric]:
        names = {b.url: b.name for b in self._backends}
        events = CounterMetricFamily(
            "quicedge_kv_events", "KV-cache events from the backends", labels=["backend", "event"]
        )
        blocks = GaugeMetricFamily(
            "quicedge_kv_cached_blocks", "Blocks a backend holds, by its events", labels=["backend"]
        )
        for url, s in self.by_backend.items():
            name = names.get(url, url)
            for kind, value in (("stored", s.stored), ("removed", s.removed),
                                ("cleared", s.cleared), ("restart", s.restarts),
                                ("missed", s.gaps), ("malformed", s.malformed)):  # fmt: skip
                events.add_metric([name, kind], value)
            blocks.add_metric([name], s.blocks)
        yield from (events, blocks)


__all__ = ["KV_EVENTS_FLAGS", "BackendEvents", "KvEvents", "KvEventsConfig", "endpoint_for"]
