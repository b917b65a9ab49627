"""Shadow diff-testing: a sampled share of stable traffic answered again by the canary.

`Shadow.sample` decides, before a stable request is forwarded and in O(1) for the requests it
does not pick, whether to shadow it (`shadow_fraction`); a request is picked only while fewer
than `shadow_concurrency` mirrors are in flight, the rate bucket (`shadow_rate` per second) has
a token, and the canary is not overloaded (degraded, at its cap, queueing, behind an open
breaker). Otherwise it is dropped and counted. A picked request carries a tap
(`edge.models.tap.ShadowTap`) that reads the stable reply as the client gets it: the stable
version is not asked again. When the stable reply succeeded, `Shadow.start` sends the request,
not streamed and with the same logprobs asked, to one canary backend in a detached task (the
client's answer never waits for it) and compares the two answers (`edge.models.answers.compare`):
exact match for greedy requests, token overlap and edit similarity of the texts, length ratio,
finish reason, top-1 token agreement and mean top-1 probability; the comparison goes to metrics
and each answer's summary to the drift windows (`edge.models.ramp.Ramp.add_pair`).

A mirror in flight is cancelled, its upstream request closed and aborted by rid, as soon as the
canary becomes overloaded (degraded or unhealthy, queueing in `/v1/loads`, a breaker of its
domain open) or the rollout stops testing (paused, rolled back, promoted): the canary's capacity
goes to its clients first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from backends.credentials import BackendCredentials
from backends.errors import UpstreamProtocolError, UpstreamTimeout
from backends.pool import UpstreamPool
from backends.registry import Backend, BackendRegistry
from edge.models.answers import Answer, Comparison, compare, parse_answer
from edge.models.config import RolloutConfig
from edge.models.metrics import ModelMetrics
from edge.models.ramp import Ramp
from edge.models.tap import SHADOWED, ShadowTap, logprob_fields
from edge.relay import Guard, read_whole
from edge.routing.breakers import TIERS, Breakers, domain_of
from edge.stages.validate import GENERATE

log = logging.getLogger(__name__)

MAX_SHADOW_BODY = 8 * 1024 * 1024
WATCH_INTERVAL = 0.05
"""How often the mirrors in flight are checked against their canary's load, s (the queue is
known from `/v1/loads` polls, every `proxy.loads_interval`, so this adds little to that)."""

_COMPARER: ThreadPoolExecutor | None = None


def _comparer() -> ThreadPoolExecutor:
    """The one thread of this process that compares shadow pairs (created on first use)."""
    global _COMPARER
    if _COMPARER is None:
        _COMPARER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quicedge-shadow")
    return _COMPARER


Aborter = Callable[[Backend, str], None]
"""Fire-and-forget `/abort_request` for (backend, rid) (`edge.wiring.Wiring.abort`)."""


def shadow_body(route: str, payload: bytes, rid: str) -> tuple[bytes, bool]:
    """The canary's request: the stable request as forwarded (the same logprobs asked), not
    streamed, with its own rid; and whether it is greedy (temperature 0: the two answers
    should be equal)."""
    body: dict[str, Any] = orjson.loads(payload)
    body["rid"] = rid
    body["stream"] = False
    if route == GENERATE:
        temperature = (body.get("sampling_params") or {}).get("temperature", 1.0)
    else:
        body.pop("stream_options", None)
        temperature = body.get("temperature", 1.0)
    return orjson.dumps(body), temperature == 0


class _Bucket:
    """Token bucket: `rate` per second, up to one second's worth banked (at least one)."""

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.capacity = max(1.0, rate)
        self.tokens = self.capacity
        self._clock = clock
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.rate)
        self._at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False

    def give_back(self) -> None:
        """A token taken for nothing (`Shadow.unsample`) goes back."""
        self.tokens = min(self.capacity, self.tokens + 1)


QUEUE_ALLOWED = 1
"""Waiting requests one `/v1/loads` poll may show on a canary that is not queueing: SGLang's
`/health` sends a one-token probe through its scheduler at every check (the edge's, a router's,
another replica's), and a mirror itself waits in the queue until the canary's next step."""


class _Queues:
    """Which canaries are queueing: more than `QUEUE_ALLOWED` requests waiting in one poll, or
    some waiting in two polls in a row (a queue that stays). A poll is known by its answer's
    object (`Backend.load` is replaced at each), and two are taken as in a row when the later
    comes within `window` s of the earlier with no poll seen between them showing none."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._first: dict[str, tuple[object, float]] = {}
        """Per canary name, the poll first seen with a few waiting, and when it was seen."""

    def __call__(self, backend: Backend) -> bool:
        load = backend.load
        waiting = 0 if load is None else load.num_waiting_reqs
        if waiting <= 0:
            self._first.pop(backend.name, None)
            return False
        if waiting > QUEUE_ALLOWED:
            return True
        now = time.monotonic()
        first = self._first.get(backend.name)
        if first is None or now - first[1] > self.window:
            self._first[backend.name] = (load, now)
            return False
        return first[0] is not load  # a later poll shows it still waiting


def _crowded(backend: Backend) -> bool:
    load = backend.load
    return load is not None and load.num_waiting_reqs > QUEUE_ALLOWED


def overloaded(backend: Backend, queueing: Callable[[Backend], bool] = _crowded) -> bool:
    """Too busy for a new mirror: degraded, at its concurrency cap or queueing."""
    return (
        backend.max_concurrency is not None and backend.in_flight >= backend.max_concurrency
    ) or strained(backend, None, queueing) is not None


def strained(
    backend: Backend,
    breakers: Breakers | None,
    queueing: Callable[[Backend], bool] = _crowded,
) -> str | None:
    """Why a mirror in flight on `backend` should give way (None: it need not): `degraded`
    (or unhealthy), `queue` (`queueing`: by default, more than `QUEUE_ALLOWED` requests
    waiting in its `/v1/loads`; a shadow also counts one that stays, see `_Queues`) or `breaker`
    (a breaker of its domain is open). The concurrency cap is not a reason: the mirror itself
    counts against it."""
    if backend.degraded or not backend.healthy:
        return "degraded"
    if queueing(backend):
        return "queue"
    if breakers is not None and breakers.config.enabled:
        model, hardware = domain_of(backend)
        if any(breakers.state_of(model, tier, hardware) == "open" for tier in TIERS):
            return "breaker"
    return None


@dataclass(slots=True)
class _Mirror:
    """One mirror in flight: the canary it occupies and the rid it goes by there."""

    canary: Backend
    rid: str
    answered: bool = False
    """The canary answered: only the comparison is left, which occupies no canary."""


class Shadow:
    """The mirrors of one pool's rollout."""

    def __init__(
        self,
        config: RolloutConfig,
        *,
        ramp: Ramp,
        pool: UpstreamPool,
        registry: BackendRegistry,
        metrics: ModelMetrics,
        rng: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
        credentials: BackendCredentials | None = None,
        breakers: Breakers | None = None,
        abort: Aborter | None = None,
    ) -> None:
        self.config = config
        self.credentials = credentials or BackendCredentials()
        """Backend keys: a mirror carries its backend's key as every other call does."""
        self.ramp = ramp
        self.pool = pool
        self.registry = registry
        self.metrics = metrics
        self.breakers = breakers
        self.abort = abort
        """Aborts a cancelled mirror by rid, as SGLang may notice a closed connection late."""
        self._rng = rng
        self._bucket = _Bucket(config.shadow_rate, clock)
        self._tasks: dict[asyncio.Task[None], _Mirror] = {}
        self._watcher: asyncio.Task[None] | None = None
        loads = registry.health.loads_interval or 0.0
        self._queues = _Queues(loads + registry.health.timeout + WATCH_INTERVAL)
        """Two polls in a row: the later may wait behind a health check on their connection."""
        self.compared = 0
        self.last: Comparison | None = None

    def _count(self, result: str) -> None:
        self.metrics.shadow.labels(self.config.model, result).inc()

    def _strained(self, canary: Backend) -> str | None:
        return strained(canary, self.breakers, self._queues)

    def _busy(self, canary: Backend) -> bool:
        """No new mirror on `canary`: overloaded or strained."""
        return overloaded(canary, self._queues) or self._strained(canary) is not None

    def _pick(self, version: str) -> Backend | None:
        mine = [b for b in self.registry.candidates()
                if b.model == self.config.model and b.model_version == version]  # fmt: skip
        return min(mine, key=lambda b: b.in_flight) if mine else None

    def sample(
        self, route: str, body: Mapping[str, Any], *, stream: bool, inner: Guard | None
    ) -> tuple[ShadowTap, dict[str, Any]] | None:
        """Whether to shadow a stable request (never blocks, never raises): its tap and the
        fields to add to its body (the logprobs to ask for), or None. A request not picked
        costs one random draw."""
        if self.config.shadow_fraction <= 0 or self._rng() >= self.config.shadow_fraction:
            return None
        if route not in SHADOWED or self.ramp.rollout.state in ("rolled_back", "promoted"):
            return None
        fields = logprob_fields(route, body, stream)
        if fields is None:
            return None
        if len(self._tasks) >= self.config.shadow_concurrency:
            self._count("dropped_full")
            return None
        canary = self._pick(self.config.canary)
        if canary is None or self._busy(canary):
            self._count("canary_busy")
            return None
        if not self._bucket.take():
            self._count("dropped_rate")
            return None
        return ShadowTap(route, strip=bool(fields), inner=inner), fields

    def unsample(self) -> None:
        """A request `sample` picked was answered without a backend (the response cache): no
        stable reply to compare, no mirror; its rate token goes back for a request that has
        one (`shadow_rate` bounds the mirrors, not the cache's hits)."""
        self._bucket.give_back()

    def start(self, route: str, payload: bytes, rid: str, tap: ShadowTap) -> None:
        """The stable reply of a sampled request succeeded: mirror it to the canary (never
        blocks, never raises). Limits are checked again: the stable reply took its time."""
        stable = tap.answer()
        if stable is None:
            self._count("unreadable")
            return
        if len(self._tasks) >= self.config.shadow_concurrency:
            self._count("dropped_full")
            return
        canary = self._pick(self.config.canary)
        if canary is None or self._busy(canary):
            self._count("canary_busy")
            return
        task = asyncio.ensure_future(self._mirror(route, payload, rid, stable, canary))
        self._tasks[task] = _Mirror(canary, rid + "-shadow-c")
        task.add_done_callback(self._done)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch())

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    # -- giving way -----------------------------------------------------------------------
    async def _watch(self) -> None:
        """While mirrors are in flight, check their canaries every `WATCH_INTERVAL`."""
        while self._tasks:
            await asyncio.sleep(WATCH_INTERVAL)
            self.check()

    def check(self) -> None:
        """Cancel each mirror in flight whose canary is strained now (`strained`)."""
        for task, mirror in list(self._tasks.items()):
            reason = None if mirror.answered else self._strained(mirror.canary)
            if reason is not None:
                self._cancel(task, mirror, reason)

    def cancel_all(self, reason: str) -> int:
        """Cancel every mirror in flight (the rollout stopped testing); how many."""
        current = asyncio.current_task()  # a mirror whose own pair moved the ramp is finishing
        mirrors = [(t, m) for t, m in self._tasks.items() if t is not current]
        for task, mirror in mirrors:
            self._cancel(task, mirror, reason)
        return len(mirrors)

    def _cancel(self, task: asyncio.Task[None], mirror: _Mirror, reason: str) -> None:
        if task.done() or self._tasks.pop(task, None) is None:
            return
        task.cancel()  # `_ask` closes the upstream connection on its way out
        self.metrics.shadow_cancelled.labels(self.config.model, reason).inc()
        if self.abort is not None and not mirror.answered:
            self.abort(mirror.canary, mirror.rid)

    async def _ask(self, backend: Backend, route: str, body: bytes) -> Answer:
        with self.registry.track(backend, prefill_tokens=0):
            response = await self.pool.request(
                backend.url, "POST", route,
                headers=self.credentials.with_auth(
                    backend.url, [(b"content-type", b"application/json")]
                ), body=body,
                first_byte_timeout=self.config.shadow_timeout,
                chunk_timeout=self.config.shadow_timeout,
            )  # fmt: skip
            try:
                data = await read_whole(response, MAX_SHADOW_BODY)
            finally:
                if not response.complete:
                    await response.aclose()
        if response.status != 200:
            raise ValueError(f"{backend.name} answered {response.status}")
        return parse_answer(route, data)

    async def _mirror(
        self, route: str, payload: bytes, rid: str, stable: Answer, canary: Backend
    ) -> None:
        mirror_rid = rid + "-shadow-c"
        try:
            body, greedy = shadow_body(route, payload, mirror_rid)
            async with asyncio.timeout(self.config.shadow_timeout):
                answer = await self._ask(canary, route, body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a shadow's failure is counted, never the client's
            log.info("shadow of %s failed: %r", rid, exc)
            self._count("error")
            if isinstance(exc, TimeoutError | UpstreamTimeout | UpstreamProtocolError):
                # Abandoned while the canary may still generate it: its closed connection
                # may be noticed only seconds later, as for a cancelled mirror.
                if self.abort is not None:
                    self.abort(canary, mirror_rid)
            return
        # The edit similarity of long answers takes a CPU for a tenth of a second or more: on
        # the event loop it would stall every client's stream that long. One thread compares,
        # pair after pair (what waits for it holds its mirror's slot: `shadow_concurrency`).
        current = asyncio.current_task()
        mirror = next((m for t, m in self._tasks.items() if t is current), None)
        if mirror is not None:
            mirror.answered = True
        loop = asyncio.get_running_loop()
        cmp = await loop.run_in_executor(_comparer(), partial(compare, stable, answer,
                                                               greedy=greedy))  # fmt: skip
        self.record(cmp, stable, answer)

    def record(self, cmp: Comparison, stable: Answer, canary: Answer) -> None:
        model = self.config.model
        m = self.metrics
        self._count("compared")
        self.compared += 1
        self.last = cmp
        if cmp.exact is not None:
            m.shadow_agree.labels(model, "exact", str(cmp.exact).lower()).inc()
        m.shadow_agree.labels(model, "finish", str(cmp.finish_agree).lower()).inc()
        if cmp.top1_agreement is not None:
            m.shadow_similarity.labels(model, "top1_agreement").observe(cmp.top1_agreement)
        m.shadow_similarity.labels(model, "token_overlap").observe(cmp.token_overlap)
        m.shadow_similarity.labels(model, "edit_similarity").observe(cmp.edit_similarity)
        if cmp.length_ratio is not None:
            m.shadow_similarity.labels(model, "length_ratio").observe(cmp.length_ratio)
        for result in self.ramp.add_pair(stable.sample(), canary.sample()):
            m.drift_tests.labels(model, result.metric, result.action).inc()

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        if self._watcher is not None:
            tasks.append(self._watcher)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["Shadow", "overloaded", "shadow_body", "strained"]
