"""The shared routing view: what every edge process learns, shared through one Redis stream.

Each process batches what it learned every `interval` (200 ms by default) into one stream entry
(`XADD ... MAXLEN ~ max_entries`): the prefix blocks (`prefix_blocks` hashes) it placed on each
backend since the last batch, its own in-flight prefill work per backend, and its `ttft`
coefficients with their update count. Each process reads the entries after the last one it saw
(`XREAD`, not blocking) and keeps a local mirror, so routing never waits on Redis: a lookup is a
few dict reads (see `depth`).

Why a stream rather than pub/sub or hashes: a stream is bounded in Redis (MAXLEN), keeps order,
costs one round trip to publish and one to read for the whole fleet's news, and lets a process
that lost Redis for a moment read what it missed (pub/sub drops it), or a new process read the
last `ttl` seconds (entry ids are millisecond times). Hashes per backend would need a read per
backend per poll and give no "what changed" cursor.

Bounds: per backend at most `max_blocks_per_backend` block hashes (oldest dropped first), each
forgotten `ttl` seconds after it was last published; at most `max_hashes_per_batch` hashes per
entry; remote load figures older than `load_ttl` are ignored. Loss and delay only make the view
staler: it is a hint, corrected by the local prefix tree as soon as this process routes there.

When Redis is slow or gone, every call is bounded by `timeout`, the failure is logged as a
warning at most once per `warn_every` seconds, remote knowledge ages out, and routing goes on
with the process's own tree (the policy never calls Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from backends.registry import Backend

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FleetViewConfig:
    """`[fleet_view]`: share placements, load and coefficients with other edge processes."""

    enabled: bool = False
    """Share the routing view through Redis. Off by default: it needs a Redis every edge process
    can reach."""
    redis: str | None = None
    """Redis URL (redis://, rediss:// or unix://); none: the `[serve]` Redis (`--redis`)."""
    key: str = "quicedge:fleet-view"
    """Stream key; edge fleets that route different backends use different keys."""
    interval: float = 0.2
    """Seconds between publishes (and reads); news reaches other processes within ~2 of these."""
    timeout: float = 0.1
    """Deadline of one Redis call, s."""
    ttl: float = 120.0
    """Seconds a published placement is believed without being published again."""
    load_ttl: float = 1.0
    """Seconds another process's in-flight figures are used."""
    max_blocks_per_backend: int = 65536
    """Block hashes kept per backend (oldest dropped first)."""
    max_hashes_per_batch: int = 4096
    """Block hashes one publish carries at most (the rest wait for the next one)."""
    max_entries: int = 2000
    """Stream length kept in Redis (approximate MAXLEN)."""
    adopt_below: int = 50
    """A process whose `ttft` model has learned from fewer responses takes the fleet's mean
    coefficients (from processes with more)."""
    warn_every: float = 30.0
    """Seconds between two warnings about Redis."""

    def validate(self) -> None:
        if self.redis is not None and not self.redis.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(f"fleet_view.redis: expected a redis:// URL, got {self.redis!r}")
        for name in ("interval", "timeout", "ttl", "load_ttl", "warn_every"):
            if not getattr(self, name) > 0:
                raise ValueError(f"fleet_view.{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("max_blocks_per_backend", "max_hashes_per_batch", "max_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"fleet_view.{name}: must be >= 1")
        if self.adopt_below < 0:
            raise ValueError("fleet_view.adopt_below: must be >= 0")


# Flags carry the section's name (`--fleet-view-ttl`); `enabled` is `--fleet-view`.
FLEET_VIEW_FLAGS: dict[str, str | bool] = {
    f.name: "--fleet-view" if f.name == "enabled" else "--fleet-view-" + f.name.replace("_", "-")
    for f in dataclasses.fields(FleetViewConfig)
}


@dataclass(slots=True)
class _Peer:
    seen: float
    load: dict[str, tuple[int, int]] = field(default_factory=dict)
    theta: list[float] | None = None
    updates: int = 0


class FleetView:
    """The local mirror of the fleet's view, and the task that keeps it in step with Redis."""

    def __init__(
        self,
        config: FleetViewConfig,
        *,
        url: str,
        backends: Sequence[Backend],
        coefficients: Callable[[], tuple[list[float], int]] | None = None,
        adopt: Callable[[list[float]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        self.config = config
        self.url = url
        self.instance = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._backends = backends
        self._coefficients = coefficients
        self._adopt = adopt
        self._clock = clock
        # remote placements: backend url -> {block hash: local time it was last heard of}
        self._held: dict[str, dict[int, float]] = {}
        # what this process will publish next, and when it last published each hash
        self._pending: dict[str, dict[int, None]] = {}
        self._published: dict[str, dict[int, float]] = {}
        self._peers: dict[str, _Peer] = {}
        self._remote_load: dict[str, tuple[int, int]] = {}
        self.processes = 1
        """Edge processes heard from within `load_ttl`, this one included."""
        self._last_id = b"0-0"
        self._task: asyncio.Task[None] | None = None
        self._redis: Any = None
        self._last_warning = -1e9
        self.connected = False
        self.published = 0
        self.received = 0
        self.errors = 0

    # -- the request path (synchronous, local) ---------------------------------------------
    def depth(self, backend_url: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt other processes placed on this backend."""
        held = self._held.get(backend_url)
        if not held:
            return 0
        horizon = self._clock() - self.config.ttl
        n = 0
        for h in hashes:
            seen = held.get(h)
            if seen is None or seen < horizon:
                break
            n += 1
        return n

    def placed(self, backend_url: str, hashes: Iterable[int]) -> None:
        """This process placed these blocks on the backend: publish them with the next batch."""
        pending = self._pending.get(backend_url)
        if pending is None:
            pending = self._pending[backend_url] = {}
        published = self._published.get(backend_url)
        fresh = self._clock() - self.config.ttl / 2
        for h in hashes:
            if published is not None:
                t = published.get(h)
                if t is not None and t > fresh:  # told the fleet recently enough
                    continue
            pending[h] = None

    def queued(self, backend_url: str) -> tuple[int, int]:
        """(prefill tokens, requests) other processes have waiting for a first token there."""
        return self._remote_load.get(backend_url, (0, 0))

    def forget(self, backend_url: str) -> None:
        """The backend restarted: nothing anyone placed there before is cached any more."""
        self._held.pop(backend_url, None)
        self._published.pop(backend_url, None)

    # -- background ----------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self._redis = aioredis.Redis.from_url(
            self.url,
            socket_timeout=cfg.timeout,
            socket_connect_timeout=cfg.timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        # A new process reads the last `ttl` seconds of the fleet's news.
        since = int((time.time() - cfg.ttl) * 1000)
        self._last_id = f"{max(0, since)}-0".encode()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()
            self._redis = None

    async def _run(self) -> None:
        while True:
            try:
                await self.sync_once()
                self.connected = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down, slow or odd: carry on with local knowledge
                self.connected = False
                self.errors += 1
                now = self._clock()
                if now - self._last_warning >= self.config.warn_every:
                    self._last_warning = now
                    log.warning("fleet view: Redis at %s failed (%s); routing on local "
                                "knowledge", self.url, str(exc) or type(exc).__name__)  # fmt: skip
            await asyncio.sleep(self.config.interval)

    async def sync_once(self) -> None:
        """One publish and one read, each bounded by `timeout`."""
        cfg = self.config
        payload = self._batch()
        if payload is not None:
            async with asyncio.timeout(cfg.timeout):
                pipe = self._redis.pipeline(transaction=False)
                pipe.xadd(cfg.key, {b"p": payload}, maxlen=cfg.max_entries, approximate=True)
                pipe.expire(cfg.key, int(cfg.ttl * 2) + 1)
                await pipe.execute()
            self.published += 1
        async with asyncio.timeout(cfg.timeout):
            answer = await self._redis.xread({cfg.key: self._last_id}, count=500)
        for _stream, entries in answer or ():
            for entry_id, fields in entries:
                self._last_id = entry_id
                raw = fields.get(b"p")
                if raw is not None:
                    self._apply(raw)
        self._sum_load()

    def _batch(self) -> bytes | None:
        """The next entry: pending placements (bounded), this process's load and coefficients."""
        now = self._clock()
        placed: dict[str, list[int]] = {}
        budget = self.config.max_hashes_per_batch
        for url, pending in self._pending.items():
            if not pending or budget <= 0:
                continue
            take = list(pending)[:budget]
            for h in take:
                del pending[h]
            budget -= len(take)
            placed[url] = take
            published = self._published.setdefault(url, {})
            for h in take:
                published.pop(h, None)
                published[h] = now
            while len(published) > self.config.max_blocks_per_backend:
                del published[next(iter(published))]
        load = {b.url: [b.in_flight_prefill_tokens, b.in_prefill] for b in self._backends
                if b.in_prefill}  # fmt: skip
        body: dict[str, Any] = {"i": self.instance, "placed": placed, "load": load}
        if self._coefficients is not None:
            theta, updates = self._coefficients()
            body["theta"], body["n"] = theta, updates
        return orjson.dumps(body)

    def _apply(self, raw: bytes) -> None:
        try:
            msg = orjson.loads(raw)
            instance = str(msg["i"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return  # not ours to understand: skip it
        if instance == self.instance:
            return
        self.received += 1
        now = self._clock()
        cap = self.config.max_blocks_per_backend
        placed = msg.get("placed")
        if isinstance(placed, dict):
            for url, hashes in placed.items():
                if not isinstance(hashes, list):
                    continue
                held = self._held.get(url)
                if held is None:
                    held = self._held[url] = {}
                for h in hashes:
                    if isinstance(h, int):
                        held.pop(h, None)  # re-inserted at the end: the order is by recency
                        held[h] = now
                while len(held) > cap:
                    del held[next(iter(held))]
        peer = self._peers.get(instance)
        if peer is None:
            peer = self._peers[instance] = _Peer(seen=now)
        peer.seen = now
        load = msg.get("load")
        peer.load = {}
        if isinstance(load, dict):
            for url, pair in load.items():
                if isinstance(pair, list) and len(pair) == 2:
                    peer.load[url] = (int(pair[0]), int(pair[1]))
        theta = msg.get("theta")
        if isinstance(theta, list) and all(isinstance(v, float | int) for v in theta):
            peer.theta, peer.updates = [float(v) for v in theta], int(msg.get("n", 0))
        self._maybe_adopt()

    def _sum_load(self) -> None:
        horizon = self._clock() - self.config.load_ttl
        totals: dict[str, tuple[int, int]] = {}
        fresh = 1
        for instance, peer in list(self._peers.items()):
            if peer.seen < horizon:
                if peer.seen < self._clock() - self.config.ttl:
                    del self._peers[instance]
                continue
            fresh += 1
            for url, (tokens, reqs) in peer.load.items():
                t, r = totals.get(url, (0, 0))
                totals[url] = (t + tokens, r + reqs)
        self._remote_load = totals
        self.processes = fresh

    def _maybe_adopt(self) -> None:
        if self._coefficients is None or self._adopt is None:
            return
        _, updates = self._coefficients()
        if updates >= self.config.adopt_below:
            return
        learned = [p.theta for p in self._peers.values()
                   if p.theta is not None and p.updates >= self.config.adopt_below]  # fmt: skip
        if not learned or len({len(t) for t in learned}) != 1:
            return
        self._adopt([sum(col) / len(learned) for col in zip(*learned, strict=True)])

    def snapshot(self) -> dict[str, Any]:
        return {
            "connected": self.connected,
            "instance": self.instance,
            "peers": len(self._peers),
            "published": self.published,
            "received": self.received,
            "errors": self.errors,
            "remote_blocks": {url: len(h) for url, h in self._held.items()},
        }


__all__ = ["FLEET_VIEW_FLAGS", "FleetView", "FleetViewConfig"]
