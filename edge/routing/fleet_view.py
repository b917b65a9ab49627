"""The shared routing view: what every edge process learns, shared through one Redis stream.

Each process batches what it learned every `interval` (200 ms by default) into one stream entry
(`XADD ... MAXLEN ~ max_entries`): the prefix blocks (`prefix_blocks` hashes) it placed on each
backend since the last batch, and its `ttft` coefficients with their update count. Each process
reads the entries after the last one it saw (`XREAD`, not blocking) and keeps a local mirror, so
routing never waits on Redis: a lookup is a few dict reads (see `depth`). The mirror holds the
whole fleet's placements, this process's too, in one recency order per backend, bounded by the
backend's KV pool (`set_capacity`): what fell off the old end, the backend has evicted. No
process's own prefix tree can tell that, since each sees only its own share of the traffic.

Queues change faster than a batch: a prefill is often over within one interval. So each process
also publishes its own in-flight counts per backend when a request starts (`nudge`, at most one
message per `load_min_gap`) and when a look every `load_interval` (10 ms) finds them
changed (or `load_ttl / 4` passed), on a pub/sub channel (`{key}:load`) that every
process subscribes to; what arrives replaces that process's figures, and the sums per backend
(`queued`) are what the `ttft` policy adds to its own queue estimate. Pub/sub fits this part: the
figures are absolute and ephemeral (a lost message is corrected by the next), it pushes without
polling, and nothing needs to be kept in Redis.

Why a stream rather than pub/sub or hashes: a stream is bounded in Redis (MAXLEN), keeps order,
costs one round trip to publish and one to read for the whole fleet's news, and lets a process
that lost Redis for a moment read what it missed (pub/sub drops it), or a new process read the
last `ttl` seconds (entry ids are Redis's millisecond times). Hashes per backend would need a
read per backend per poll and give no "what changed" cursor.

Bounds: per backend at most `max_blocks_per_backend` block hashes (oldest dropped first), each
forgotten `ttl` seconds after it was last published; at most `max_hashes_per_batch` hashes per
entry; a process's load figures are dropped `load_ttl` after its last message. Loss and delay
only make the view staler: it is a hint, corrected by the local prefix tree as soon as this
process routes there.

When Redis is slow or gone, every call is bounded by `timeout`, the failure is logged as a
warning at most once per `warn_every` seconds, remote knowledge ages out, and routing goes on
with the process's own tree (the policy never calls Redis). A publish answered READONLY closes
the idle connections, so the next connects again: after a failover behind one address, the old
master, now a replica, would refuse every publish on the connections it kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ReadOnlyError

from backends.registry import Backend
from edge.redis_pubsub import Subscription, drop_idle_connections, subscriber_client
from transport.redacted import without_password

log = logging.getLogger(__name__)

_NO_LOAD = (0, 0, 0)


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
    refresh: float = 0.5
    """Seconds after which a block placed again is published again. Every process keeps the
    fleet's placements in one recency order per backend, which says what the backend's cache
    has evicted; a hot prefix told only once would drift to the old end of that order."""
    load_interval: float = 0.01
    """Seconds between looks at this process's in-flight counts per backend for changes no
    request start announced (first tokens, ends); a change is published to the other processes
    at once (pub/sub)."""
    load_min_gap: float = 0.002
    """Seconds between two load publishes at least. A request start publishes at once unless
    one went out this recently, so bursts cost at most one message per gap."""
    load_ttl: float = 1.0
    """Seconds another process's in-flight figures are used without news from it (each process
    repeats unchanged figures every `load_ttl / 4`)."""
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
            shown = without_password(self.redis)
            raise ValueError(f"fleet_view.redis: expected a redis:// URL, got {shown!r}")
        if not 0 < self.refresh <= self.ttl / 2:
            raise ValueError(
                f"fleet_view.refresh: must be > 0 and <= ttl / 2, got {self.refresh!r}"
            )
        for name in ("interval", "timeout", "ttl", "load_interval", "load_ttl", "warn_every"):
            if not getattr(self, name) > 0:
                raise ValueError(f"fleet_view.{name}: must be > 0, got {getattr(self, name)!r}")
        if self.load_min_gap < 0:
            raise ValueError(f"fleet_view.load_min_gap: must be >= 0, got {self.load_min_gap!r}")
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
    load: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """backend url -> (prefill tokens, requests in prefill, requests in flight)."""
    load_seen: float = -1e18
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
        # the fleet's placements, this process's included: backend url -> {block hash: local
        # time it was last placed or heard of}, least recent first, bounded by `_capacity`.
        # OrderedDicts: dropping the oldest of a plain dict (`del d[next(iter(d))]`) walks
        # every slot deleted before it, tens of µs per hash at the 65,536 cap.
        self._held: dict[str, OrderedDict[int, float]] = {}
        self._capacity: dict[str, int] = {}
        # what this process will publish next, and when it last published each hash
        self._pending: dict[str, OrderedDict[int, None]] = {}
        self._published: dict[str, OrderedDict[int, float]] = {}
        self._peers: dict[str, _Peer] = {}
        self._remote_load: dict[str, tuple[int, int, int]] = {}
        self.processes = 1
        """Edge processes whose load figures are fresh (within `load_ttl`), this one included."""
        self._last_id: bytes | None = None
        """The last entry read; None until the first publish says where Redis's clock is."""
        self._channel = (config.key + ":load").encode()
        self._task: asyncio.Task[None] | None = None
        self._load_tasks: list[asyncio.Task[None]] = []
        self._nudged = asyncio.Event()
        self._redis: Any = None
        self._subscriber: Any = None
        self._closing = False
        self._last_warning = -1e9
        self.connected = False
        # the other processes' load figures, as they are published (ages out when Redis fails)
        self._loads = Subscription(
            None, self._channel, self._apply_load, on_error=self._failed,
            subscribe_timeout=config.timeout * 10, retry_after=config.interval,
            idle_timeout=config.load_ttl, closing=lambda: self._closing, name="fleet_view",
        )  # fmt: skip
        self.published = 0
        self.received = 0
        self.loads_published = 0
        self.loads_received = 0
        self.errors = 0

    # -- the request path (synchronous, local) ---------------------------------------------
    def depth(self, backend_url: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt the fleet (this process included) placed on this
        backend recently enough to be still in its cache (see `set_capacity`)."""
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
            pending = self._pending[backend_url] = OrderedDict()
        published = self._published.get(backend_url)
        held = self._held.get(backend_url)
        if held is None:
            held = self._held[backend_url] = OrderedDict()
        now = self._clock()
        fresh = now - self.config.refresh
        for h in hashes:
            held[h] = now
            held.move_to_end(h)  # the most recent placement last, as the backend's cache has it
            if published is not None:
                t = published.get(h)
                if t is not None and t > fresh:  # told the fleet recently enough
                    continue
            pending[h] = None
        while len(pending) > self.config.max_blocks_per_backend:  # Redis away: oldest go
            pending.popitem(last=False)
        self._bound(backend_url, held)

    def set_capacity(self, backend_url: str, blocks: int) -> None:
        """The backend's KV cache holds about this many blocks: the blocks placed there before
        the last `blocks` placed by the whole fleet are taken as evicted (least recently used
        first, as SGLang's radix cache evicts)."""
        self._capacity[backend_url] = max(1, blocks)
        held = self._held.get(backend_url)
        if held is not None:
            self._bound(backend_url, held)

    def _bound(self, backend_url: str, held: OrderedDict[int, float]) -> None:
        cap = self._capacity.get(backend_url, self.config.max_blocks_per_backend)
        cap = min(cap, self.config.max_blocks_per_backend)
        while len(held) > cap:
            held.popitem(last=False)

    def queued(self, backend_url: str) -> tuple[int, int, int]:
        """What other processes have on that backend: (prefill tokens and requests waiting for
        a first token, requests in flight)."""
        return self._remote_load.get(backend_url, _NO_LOAD)

    def nudge(self) -> None:
        """A request was just counted in flight here: publish the load without waiting for the
        next look (`BackendRegistry.on_track`)."""
        self._nudged.set()

    def forget(self, backend_url: str) -> None:
        """The backend restarted: nothing anyone placed there before is cached any more, and
        what this process placed there but has not told yet is not told."""
        self._held.pop(backend_url, None)
        self._published.pop(backend_url, None)
        self._pending.pop(backend_url, None)

    async def claim(self, name: str, ttl: float) -> bool:
        """Whether this process takes on the fleet-wide job `name` (one warm-up of a backend)
        for `ttl` seconds: False while another process holds it. True when Redis cannot say
        (not started, failing or slower than `timeout`): the job is then done here rather than
        nowhere."""
        if self._redis is None:
            return True
        key = f"{self.config.key}:claim:{name}"
        mine = self.instance.encode()
        try:
            async with asyncio.timeout(self.config.timeout):
                if await self._redis.set(key, mine, nx=True, px=max(1, int(ttl * 1000))):
                    return True
                return bool(await self._redis.get(key) == mine)  # held by this process
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(exc)
            return True

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
        # Subscribing holds a connection in a blocking read: a client of its own, whose reads
        # wait as long as `get_message` says rather than `timeout`. A lost subscription needs
        # no catch-up: the load figures are absolute and sent again every `load_ttl / 4`.
        self._subscriber = subscriber_client(self.url, connect_timeout=cfg.timeout)
        self._loads.client = self._subscriber
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        self._load_tasks = [
            loop.create_task(self._publish_loads()),
            loop.create_task(self._loads.run()),
        ]

    async def aclose(self) -> None:
        self._closing = True
        tasks = [t for t in (self._task, *self._load_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        # Bounded: a cancellation that meets a Redis timeout can be lost (asyncio.timeout on
        # Python 3.11 turns it into a TimeoutError), and the loops then end on `_closing`.
        if tasks:
            await asyncio.wait(tasks, timeout=max(1.0, self.config.interval * 2))
        self._task, self._load_tasks = None, []
        for client in (self._redis, self._subscriber):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()
        self._redis = self._subscriber = None

    async def _run(self) -> None:
        while not self._closing:
            try:
                await self.sync_once()
                self.connected = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down, slow or odd: carry on with local knowledge
                self.connected = False
                self._failed(exc)
                if isinstance(exc, ReadOnlyError):  # a failover may have moved the address
                    await drop_idle_connections(self._redis, self.config.timeout)
            await asyncio.sleep(self.config.interval)

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        now = self._clock()
        if now - self._last_warning >= self.config.warn_every:
            self._last_warning = now
            log.warning("fleet view: Redis at %s failed (%s); routing on local knowledge",
                        without_password(self.url), str(exc) or type(exc).__name__)  # fmt: skip

    def _load_state(self) -> tuple[tuple[str, int, int, int], ...]:
        return tuple((b.url, b.in_flight_prefill_tokens, b.in_prefill, b.in_flight)
                     for b in self._backends if b.in_flight)  # fmt: skip

    async def _publish_loads(self) -> None:
        """Publish this process's in-flight figures whenever they change (at once after a
        request starts, `load_min_gap` apart at least; other changes are looked for every
        `load_interval`), and at least every `load_ttl / 4` so that the others keep them."""
        cfg = self.config
        last: tuple[tuple[str, int, int, int], ...] | None = None
        last_at = retry_at = -1e18
        nudged = self._nudged
        while not self._closing:
            if not nudged.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(cfg.load_interval):
                        await nudged.wait()
            nudged.clear()
            self._sum_load()  # peers that went quiet drop out here
            state = self._load_state()
            now = self._clock()
            if (state == last and now - last_at < cfg.load_ttl / 4) or now < retry_at:
                continue
            payload = orjson.dumps({"i": self.instance, "l": state})
            try:
                async with asyncio.timeout(cfg.timeout):
                    await self._redis.publish(self._channel, payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(exc)
                retry_at = now + cfg.interval  # not every `load_interval` while Redis is down
                continue
            last, last_at = state, now
            self.loads_published += 1
            if cfg.load_min_gap:
                await asyncio.sleep(cfg.load_min_gap)

    def _apply_load(self, raw: bytes) -> None:
        try:
            msg = orjson.loads(raw)
            instance = str(msg["i"])
            rows = msg["l"]
            known = {b.url for b in self._backends}
            # Only this edge's backends, and no figure below 0 (a queue emptier than idle
            # would draw every request there): a stray or broken publisher costs nothing.
            load = {
                url: (max(0, int(r[1])), max(0, int(r[2])), max(0, int(r[3])))
                for r in rows
                if (url := str(r[0])) in known
            }
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError):
            return  # not ours to understand: skip it
        if instance == self.instance:
            return
        now = self._clock()
        peer = self._peers.get(instance)
        if peer is None:
            peer = self._peers[instance] = _Peer(seen=now)
        peer.load, peer.load_seen = load, now
        self.loads_received += 1
        self._sum_load()

    async def sync_once(self) -> None:
        """One publish and one read, each bounded by `timeout`."""
        cfg = self.config
        known = self._drop_unknown()
        payload, placed = self._batch()
        try:
            async with asyncio.timeout(cfg.timeout):
                pipe = self._redis.pipeline(transaction=False)
                pipe.xadd(cfg.key, {b"p": payload}, maxlen=cfg.max_entries, approximate=True)
                pipe.expire(cfg.key, int(cfg.ttl * 2) + 1)
                added, _ = await pipe.execute()
        except BaseException:
            self._unsend(placed)  # told no one (or perhaps told): the next batch carries them
            raise
        self.published += 1
        if self._last_id is None:
            # A new process reads the last `ttl` seconds of the fleet's news. Entry ids are
            # Redis's clock in ms (the id of the entry just added tells it), not this host's,
            # which may run ahead of it and would then skip the fleet's entries until Redis
            # caught up.
            now_ms = int(added.split(b"-")[0])
            self._last_id = f"{max(0, now_ms - int(cfg.ttl * 1000))}-0".encode()
        async with asyncio.timeout(cfg.timeout):
            answer = await self._redis.xread({cfg.key: self._last_id}, count=500)
        for _stream, entries in answer or ():
            for entry_id, fields in entries:
                self._last_id = entry_id
                raw = fields.get(b"p")
                if raw is not None:
                    self._apply(raw, known)

    def _drop_unknown(self) -> set[str]:
        """The URLs of this edge's backends now; what is kept for any other (one discovery
        removed) is dropped, so no URL ever named keeps its blocks for good."""
        known = {b.url for b in self._backends}
        for state in (self._held, self._pending, self._published, self._capacity):
            for url in [u for u in state if u not in known]:
                del state[url]
        return known

    def _batch(self) -> tuple[bytes, dict[str, list[int]]]:
        """The next entry (pending placements, bounded, and this process's coefficients) and
        the placements it carries."""
        now = self._clock()
        placed: dict[str, list[int]] = {}
        budget = self.config.max_hashes_per_batch
        for url, pending in self._pending.items():
            if not pending or budget <= 0:
                continue
            take = list(itertools.islice(pending, budget))
            for h in take:
                del pending[h]
            budget -= len(take)
            placed[url] = take
            published = self._published.setdefault(url, OrderedDict())
            for h in take:
                published[h] = now
                published.move_to_end(h)
            while len(published) > self.config.max_blocks_per_backend:
                published.popitem(last=False)
        body: dict[str, Any] = {"i": self.instance, "placed": placed}
        if self._coefficients is not None:
            theta, updates = self._coefficients()
            body["theta"], body["n"] = theta, updates
        return orjson.dumps(body), placed

    def _unsend(self, placed: dict[str, list[int]]) -> None:
        """A batch that did not go out: its placements are pending again, not marked as told."""
        for url, hashes in placed.items():
            published = self._published.get(url)
            pending = self._pending.setdefault(url, OrderedDict())
            for h in hashes:
                if published is not None:
                    published.pop(h, None)
                pending[h] = None
            while len(pending) > self.config.max_blocks_per_backend:
                pending.popitem(last=False)

    def _apply(self, raw: bytes, known: set[str]) -> None:
        """Apply one entry; placements on backends not in `known` (this edge does not route
        to them) are skipped."""
        try:
            msg = orjson.loads(raw)
            instance = str(msg["i"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return  # not ours to understand: skip it
        if instance == self.instance:
            return
        self.received += 1
        now = self._clock()
        placed = msg.get("placed")
        if isinstance(placed, dict):
            for url, hashes in placed.items():
                if not isinstance(hashes, list) or url not in known:
                    continue
                held = self._held.get(url)
                if held is None:
                    held = self._held[url] = OrderedDict()
                for h in hashes:
                    if isinstance(h, int):
                        held[h] = now
                        held.move_to_end(h)  # the order is by recency
                self._bound(url, held)
        peer = self._peers.get(instance)
        if peer is None:
            peer = self._peers[instance] = _Peer(seen=now)
        peer.seen = now
        theta, updates = msg.get("theta"), msg.get("n")
        if isinstance(theta, list) and all(isinstance(v, float | int) for v in theta):
            peer.theta = [float(v) for v in theta]
            peer.updates = updates if isinstance(updates, int) else 0
        self._maybe_adopt()

    def _sum_load(self) -> None:
        now = self._clock()
        horizon = now - self.config.load_ttl
        totals: dict[str, tuple[int, int, int]] = {}
        fresh = 1
        for instance, peer in list(self._peers.items()):
            if peer.load_seen < horizon:
                if max(peer.seen, peer.load_seen) < now - self.config.ttl:
                    del self._peers[instance]
                continue
            fresh += 1
            for url, (tokens, reqs, flying) in peer.load.items():
                t, r, f = totals.get(url, _NO_LOAD)
                totals[url] = (t + tokens, r + reqs, f + flying)
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

    @property
    def subscription(self) -> Subscription:
        """The load channel's subscription."""
        return self._loads

    @property
    def listening(self) -> bool:
        """Subscribed to the other processes' load figures."""
        return self._loads.subscribed.is_set()

    def snapshot(self) -> dict[str, Any]:
        return {
            "connected": self.connected,
            "listening": self.listening,
            "instance": self.instance,
            "peers": len(self._peers),
            "published": self.published,
            "received": self.received,
            "loads_published": self.loads_published,
            "loads_received": self.loads_received,
            "processes": self.processes,
            "errors": self.errors,
            "remote_blocks": {url: len(h) for url, h in self._held.items()},
        }


__all__ = ["FLEET_VIEW_FLAGS", "FleetView", "FleetViewConfig"]
