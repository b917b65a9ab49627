"""Rollbacks, pauses and advances shared by every edge that shares a Redis (`[models]
share_stops`, `share_advances`).

Each edge process runs its own ramp from the same configuration; `edge.worker_admin` carries
actions between the workers of one `serve`, and this carries them between machines: a rollback
or a pause (`share_stops`), whether an operator or the process's own ramp took it, is published
on a pub/sub channel (`{share_key}`), and every other process that hears it takes the same
action with the reason and the process it came from. With `share_advances`, so is an advance
or a promotion, with the step it reached, which a process that is behind goes to
(`Ramp.follow`). Every one is idempotent (a second rollback changes nothing; an advance names
its step, not "one more"), so hearing one twice, through the workers' sockets and through
Redis, is harmless. A resume (a promote of a paused ramp) stays on the edge that took it. Each
message names the rollout's stable and canary version and the digest of its configured entry
(`entry_digest`: steps, limits, drift, every key), and an edge whose rollout of that pool has
other versions or another entry (a reload that has not reached every edge yet) does not take
it: one canary's advance or stop is no evidence about another, and an advance's step index
means another share under other steps. A message without the digest (an older edge) is judged
by its versions, and one without versions too is taken.

Pub/sub fits: a stop matters now, to whoever is running; an edge that starts later starts from
its configuration, as it would after a restart anyway. But an edge whose subscription was lost
(Redis restarted, or the connection died without a close and `Subscription`'s PING found it)
must not miss a rollback meanwhile: each shared transition is also appended, in the same
transaction as its publish, to a short stream (`{share_key}:log`, the last `LOG_LENGTH`), and
once subscribed again the edge takes those published since its previous subscription was last
known alive (less `CATCH_UP_SLACK_S` for the clocks), but none older than an operator's resume
or restart of that rollout here. When Redis is slow or gone, publishes and the subscription are
bounded by `timeout`, failures are logged at most every 30 s, and each process keeps its own
ramp; routing never waits on Redis. A transition whose publish failed is not dropped: one taken
while Redis was away (restarting, failing over) would otherwise never reach the other edges,
which after a rollback would stay on the canary for good. It is kept (the last `LOG_LENGTH`) and
sent again, in order and before any later one, after a pause (`timeout`, doubled after each
failed try up to `CATCH_UP_MAX_PAUSE_S`) until Redis takes it, unless a resume or restart of its
rollout here came after it. A transition sent late says how long ago it was taken (`ago`), and
an edge that resumed or restarted that rollout since does not take it, as it would not from the
log. A publish answered READONLY closes the idle connections, so the next connects again: after
a failover behind one address, the old master, now a replica, keeps the connections it had and
refuses every write on them.

The read of the log runs beside the subscription, not in its way: one that fails or takes
longer than its wait (`timeout` at first, doubled each time up to `CATCH_UP_MAX_WAITS` ×
`timeout`) is counted (`catch_up_failures`, `quicedge_rollout_sync_catch_up_failures_total`)
and tried again after a pause (doubled each time, at most `CATCH_UP_MAX_PAUSE_S`) until it
succeeds, while the new subscription stays; a Redis slower than `timeout` would otherwise have
each read's timeout drop the subscription, and the next, for good. A subscription lost again
meanwhile only widens what the pending read reads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import os
import time
import uuid
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ReadOnlyError

from edge.models.ramp import ADVANCES, STOPS, Transition
from edge.models.rollout import Rollout
from edge.models.service import Models
from edge.redis_pubsub import (
    PING_INTERVAL_S,
    PING_TIMEOUT_S,
    Subscription,
    drop_idle_connections,
    subscriber_client,
)
from transport.redacted import without_password

log = logging.getLogger(__name__)

WARN_EVERY_S = 30.0
LOG_LENGTH = 256
"""Shared transitions kept in the stream a re-subscribed edge catches up from."""
CATCH_UP_SLACK_S = 1.0
"""Seconds before the lost subscription's last sign of life that a catch-up also reads: the
local and Redis clocks are matched within a round trip; a transition taken twice is harmless."""
CATCH_UP_MAX_WAITS = 10
"""The longest wait for one read of the log, in `timeout`s (the subscription's own wait)."""
CATCH_UP_MAX_PAUSE_S = 30.0
"""The longest pause between two tries of a read of the log that failed."""
UNSENT_MAX = LOG_LENGTH
"""Shared transitions kept to be sent again while Redis does not take them (the oldest go)."""
UNDOING = frozenset({"resume", "restart"})
"""Local transitions after which an older stop or advance is not taken from the log."""
# Set while this process takes an action it heard of (so it is not published again).
_heard: contextvars.ContextVar[bool] = contextvars.ContextVar("heard", default=False)


class RolloutSync:
    def __init__(
        self,
        models: Models,
        *,
        url: str,
        key: str,
        stops: bool = True,
        advances: bool = False,
        timeout: float = 0.5,
        ping_interval: float = PING_INTERVAL_S,
        ping_timeout: float = PING_TIMEOUT_S,
    ) -> None:
        self.models = models
        self.shared = (STOPS if stops else frozenset()) | (ADVANCES if advances else frozenset())
        """The transitions published and taken."""
        self.url = url
        self.channel = key.encode()
        self.log_key = f"{key}:log"
        self.timeout = timeout
        self.ping_interval = ping_interval
        """Seconds the channel may stay silent before its connection is pinged."""
        self.ping_timeout = ping_timeout
        """Seconds the answer to that PING may take before the connection is taken as dead."""
        self.instance = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.published = self.received = self.errors = 0
        self.caught_up = 0
        """Transitions taken from the log after a subscription was lost."""
        self._undone_at: dict[str, float] = {}
        """Monotonic time of each rollout's last resume or restart here."""
        self.catch_up_failures = 0
        """Reads of the log that failed or timed out (each tried again)."""
        self._missed_since: float | None = None
        """Monotonic time from which the log is still to be read (None: nothing is)."""
        self._widened = False
        """A subscription was lost again while a read of the log was under way."""
        self._catching_up: asyncio.Task[None] | None = None
        self._unsent: collections.deque[tuple[str, float, dict[str, Any]]] = collections.deque(
            maxlen=UNSENT_MAX
        )
        """Transitions whose publish failed, oldest first: (pool, monotonic time taken, the
        message's fields)."""
        self._resending: asyncio.Task[None] | None = None
        self._redis: Any = None
        self._reader: Any = None
        self._subscriber: Any = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._listener: asyncio.Task[None] | None = None
        self._last_warning = -1e18
        self._subscription: Subscription | None = None
        self.subscribed = asyncio.Event()
        """Set while the channel is subscribed (tests wait on it)."""
        models.on_transition.append(self._transitioned)

    async def start(self) -> None:
        connect, retry = self.timeout, Retry(NoBackoff(), 0)
        self._redis = aioredis.Redis.from_url(
            self.url, socket_timeout=self.timeout, socket_connect_timeout=connect, retry=retry
        )
        # The log's reads wait longer than a publish may (`_read_back` bounds each).
        self._reader = aioredis.Redis.from_url(
            self.url, socket_timeout=self.timeout * CATCH_UP_MAX_WAITS,
            socket_connect_timeout=connect, retry=retry,
        )  # fmt: skip
        # The subscriber waits on messages as long as it likes: no socket timeout of its own.
        self._subscriber = subscriber_client(self.url, connect_timeout=connect)
        self._subscription = Subscription(
            self._subscriber, self.channel, self.take,
            on_error=lambda exc: self._failed("the subscription", exc),
            subscribed=self.subscribed, subscribe_timeout=self.timeout * 10, retry_after=1.0,
            on_subscribed=self._catch_up, ping_interval=self.ping_interval,
            ping_timeout=self.ping_timeout, name="rollouts",
        )  # fmt: skip
        self._listener = asyncio.get_running_loop().create_task(self._subscription.run())

    @property
    def subscription(self) -> Subscription | None:
        """The channel's subscription, once started."""
        return self._subscription

    async def aclose(self) -> None:
        tasks = [
            *self._tasks,
            *(t for t in (self._listener, self._catching_up, self._resending) if t),
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in (self._redis, self._reader, self._subscriber):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            why = str(exc) or type(exc).__name__
            log.warning("rollout sync: Redis at %s: %s failed (%s); each edge keeps its own ramp",
                        without_password(self.url), what, why)  # fmt: skip

    # -- out --------------------------------------------------------------------------------
    def _transitioned(self, rollout: Rollout, transition: Transition) -> None:
        if transition.action in UNDOING:
            self._undone_at[rollout.pool] = time.monotonic()
        if transition.action not in self.shared or _heard.get():
            return
        fields = {"i": self.instance, "model": rollout.pool, "stable": rollout.stable,
                  "canary": rollout.canary, "entry": rollout.entry, "action": transition.action,
                  "step": transition.step, "reason": transition.reason}  # fmt: skip
        unsent = (rollout.pool, time.monotonic(), fields)
        if self._unsent:  # after those still to be sent, not before them
            self._keep(unsent)
            return
        task = asyncio.get_running_loop().create_task(self._publish(unsent))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, unsent: tuple[str, float, dict[str, Any]]) -> None:
        if not await self._send(orjson.dumps(unsent[2])):
            self._keep(unsent)

    async def _send(self, message: bytes) -> bool:
        """Append to the log and publish, in one transaction within `timeout`; whether Redis
        took it."""
        try:
            async with asyncio.timeout(self.timeout):
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.xadd(self.log_key, {"m": message}, maxlen=LOG_LENGTH, approximate=False)
                    pipe.publish(self.channel, message)
                    await pipe.execute()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed("a publish", exc)
            if isinstance(exc, ReadOnlyError):  # a failover may have moved the address
                await drop_idle_connections(self._redis, self.timeout)
            return False
        self.published += 1
        return True

    def _keep(self, unsent: tuple[str, float, dict[str, Any]]) -> None:
        """Send `unsent` again later, after those kept before it."""
        self._unsent.append(unsent)
        if self._resending is None or self._resending.done():
            self._resending = asyncio.get_running_loop().create_task(self._resend())

    async def _resend(self) -> None:
        """Send the kept transitions in order, pausing after each failed try (`timeout`,
        doubled each time up to `CATCH_UP_MAX_PAUSE_S`); one that a resume or restart of its
        rollout here came after is dropped. Each says how long ago it was taken (`ago`, s), so
        that an edge that resumed or restarted that rollout since does not take it."""
        tries = 0
        while self._unsent:
            await asyncio.sleep(min(self.timeout * 2**tries, CATCH_UP_MAX_PAUSE_S))
            tries = min(tries + 1, 16)
            while self._unsent:
                head = self._unsent[0]
                pool, at, fields = head
                if self._undone_at.get(pool, -1e18) < at:
                    late = {**fields, "ago": round(time.monotonic() - at, 3)}
                    if not await self._send(orjson.dumps(late)):
                        break
                if self._unsent and self._unsent[0] is head:  # not pushed out meanwhile
                    self._unsent.popleft()

    # -- in ---------------------------------------------------------------------------------
    async def _catch_up(self, gap: float | None) -> None:
        """Subscribed again, `gap` seconds after the lost subscription was last known alive:
        read what was published since from the log, beside the subscription (nothing after the
        first subscription). Never raises: a failed read is tried again (`_read_back`)."""
        if gap is None:
            return
        since = time.monotonic() - gap
        if self._missed_since is None or since < self._missed_since:
            self._missed_since = since
        if self._catching_up is not None and not self._catching_up.done():
            self._widened = True  # the read under way reads again once done
            return
        self._catching_up = asyncio.get_running_loop().create_task(self._read_back())

    async def _read_back(self) -> None:
        """Read the log from `_missed_since` until one read succeeds after the last loss."""
        tries = 0
        while self._missed_since is not None:
            since, self._widened = self._missed_since, False
            wait = self.timeout * min(2**tries, CATCH_UP_MAX_WAITS)
            try:
                async with asyncio.timeout(wait):
                    await self._read_log(since)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.catch_up_failures += 1
                self.models.metrics.sync_catch_up_failures.inc()
                self._failed(f"the catch-up read of {self.log_key} (within {wait:g} s)", exc)
                pause = min(self.timeout * 2**tries, CATCH_UP_MAX_PAUSE_S)
                tries = min(tries + 1, 16)
                await asyncio.sleep(pause)
                continue
            if not self._widened:
                self._missed_since = None

    async def _read_log(self, since_monotonic: float) -> None:
        """Take what the log holds from `since_monotonic` (less `CATCH_UP_SLACK_S`) on."""
        async with self._reader.pipeline(transaction=False) as pipe:
            pipe.time()
            pipe.xrange(self.log_key, "-", "+")
            (seconds, micros), entries = await pipe.execute()
        now = time.monotonic()
        redis_now = seconds + micros / 1e6
        since = redis_now - (now - since_monotonic) - CATCH_UP_SLACK_S
        before = self.received
        for entry_id, fields in entries:
            at = int(entry_id.split(b"-")[0]) / 1000  # stream ids are Redis's ms clock
            if at >= since and b"m" in fields:
                self.take(fields[b"m"], published_at=now - (redis_now - at))
        taken = self.received - before
        if taken:
            self.caught_up += taken
            log.warning("rollout sync: took %d shared transition(s) published while the"
                        " subscription to %s was lost", taken, self.url)  # fmt: skip

    def take(self, raw: bytes, *, published_at: float | None = None) -> None:
        """Another process's shared transition, taken here too (anything else is skipped); one
        read back from the log (`published_at`, monotonic), or sent late (`ago`: seconds
        between its taking and its sending), not when a resume or restart of its rollout here
        came after it was taken."""
        try:
            msg = orjson.loads(raw)
            instance, model, action = str(msg["i"]), str(msg["model"]), str(msg["action"])
            reason = str(msg.get("reason", ""))
            step = int(msg.get("step", 0))
            versions = (msg.get("stable"), msg.get("canary"))
            entry = msg.get("entry")
            ago = float(msg["ago"]) if "ago" in msg else None
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            return
        ramp = self.models.ramps.get(model)
        if instance == self.instance or ramp is None or action not in self.shared:
            return
        if versions != (None, None) and versions != (ramp.rollout.stable, ramp.rollout.canary):
            return  # another rollout of the pool (a reload not yet everywhere): no evidence here
        if entry is not None and entry != ramp.rollout.entry:
            return  # the same versions, other steps or limits: its step index means another share
        if ago is not None:  # sent late: taken `ago` before it was sent
            published_at = (time.monotonic() if published_at is None else published_at) - ago
        if published_at is not None and self._undone_at.get(model, -1e18) >= published_at:
            return
        self.received += 1
        token = _heard.set(True)
        try:
            ramp.take(action, step, f"edge {instance}: {reason}")
        finally:
            _heard.reset(token)


__all__ = ["RolloutSync"]
