"""Pre-warming: fill a backend's prefix cache with the fleet's hot prefixes before it takes traffic.

A backend is warmed when it joins (the service starts), when it comes back healthy after failing
its checks, when it restarted without failing them (its `/metrics` request counter went down:
a new process), and on demand (`POST /prewarm` on the admin listener). The hottest prefixes
(`HotPrefixes.top`) are sent as prefill-only requests: SGLang's native `/generate` with
`max_new_tokens: 0` (SGLang accepts 0 and returns after prefill; a backend that refuses it with a
400 gets 1 from then on). A prefix of chat requests goes to `/v1/chat/completions` as the
conversation cut where the prefix ends, with `max_tokens: 0`: the backend renders it with its
own chat template, so the tokens it caches are the ones the real requests bring (the routing
view's role markers are not the model's template). A long prefix goes in shards of
`shard_tokens` (prefix up to 256 tokens, then 512, ...), so each request prefills one shard on
top of the cached ones and a partial match helps at once; while the backend is held back from
routing and idle, a prefix goes whole (nothing could use a part of it yet, and each request has
a fixed cost).

Pacing keeps real traffic ahead: one warm-up request in flight per backend; before each, wait
(up to `yield_s`) while the edge has real requests waiting for a first token there; after each,
idle long enough that warm-up takes at most `share` of the backend's time, unless the backend is
held back from routing and has no request of the edge's in flight (then warm-up runs at full
speed: no request of ours can queue behind it, and the sooner it ends the sooner the backend
takes its share of the load). A backend being
warmed is not ready for routing (the registry offers it only when no ready backend can take a
request) until its warm-up finished or `deadline` passed, whichever is first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.errors import UpstreamError
from backends.pool import UpstreamPool
from backends.registry import Backend, BackendRegistry
from edge.routing.hot_prefixes import HotPrefix, HotPrefixes
from edge.sse import usage_from
from edge.stages.view import CHARS_PER_TOKEN

log = logging.getLogger(__name__)

STATES = ("idle", "warming", "ready")


@dataclass(slots=True)
class PrewarmConfig:
    """`[prewarm]`: hot-prefix tracking and warming backends that lost (or never had) them."""

    enabled: bool = False
    """Track hot prefixes and warm backends. Off by default: it sends requests of its own to
    the backends (which may be shared with other clients, or billed), and holds a restarted
    backend back from routing for up to `deadline`; an operator opts in."""
    top: int = 8
    """Hot prefixes sent per warm-up, hottest first."""
    min_count: float = 2.0
    """Decayed request count that makes a prefix hot."""
    half_life: float = 60.0
    """Half-life of the hot-prefix counts, s."""
    capacity: int = 256
    """Prefixes tracked per model."""
    block_chars: int = 1024
    """Prefix granularity, characters (about 256 tokens)."""
    shard_tokens: int = 256
    """Tokens prefilled per warm-up request: a long prefix goes in steps of this many."""
    max_tokens: int = 65536
    """Tokens (estimated) sent to one backend per warm-up at most."""
    share: float = 0.25
    """Share of a backend's time warm-up may take (it idles (1 - share) / share of each request's
    duration after it)."""
    yield_s: float = 1.0
    """Longest wait, s, for the edge's real requests in prefill there to get their first token
    before a warm-up request is sent anyway."""
    deadline: float = 5.0
    """A backend being warmed counts as ready for routing after this many seconds at most."""
    restart_check_interval: float | None = 2.0
    """Period, s, of the `/metrics` poll that notices a restart its health checks missed; none:
    off."""
    request_timeout: float = 10.0
    """Deadline of one warm-up request, s."""

    def validate(self) -> None:
        for name in ("top", "capacity", "shard_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"prewarm.{name}: must be >= 1, got {getattr(self, name)!r}")
        if self.block_chars < 16:
            raise ValueError(f"prewarm.block_chars: must be >= 16, got {self.block_chars}")
        if not 0 < self.share <= 1:
            raise ValueError(f"prewarm.share: must be in (0, 1], got {self.share}")
        for name in ("half_life", "deadline", "request_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"prewarm.{name}: must be > 0, got {getattr(self, name)!r}")
        if self.min_count < 0 or self.yield_s < 0:
            raise ValueError("prewarm.min_count and prewarm.yield_s: must be >= 0")
        if self.restart_check_interval is not None and not self.restart_check_interval > 0:
            raise ValueError("prewarm.restart_check_interval: must be > 0 or none")


# Flags carry the section's name (`--prewarm-deadline`); `enabled` is `--prewarm`.
PREWARM_FLAGS: dict[str, str | bool] = {
    f.name: "--prewarm" if f.name == "enabled" else "--prewarm-" + f.name.replace("_", "-")
    for f in dataclasses.fields(PrewarmConfig)
}


@dataclass(slots=True)
class _Job:
    text: str
    done: asyncio.Future[dict[str, Any]] | None = None
    chat: HotPrefix | None = None
    """A chat prefix: warmed through the chat endpoint with its conversation."""
    ids: list[int] | None = None
    """A prefix of token-id prompts: warmed as `input_ids` (`text` is them in decimal)."""
    requests: int = 0
    tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class _Lane:
    """One backend's warm-up queue, worked by at most one task (one request in flight)."""

    backend: Backend
    jobs: list[_Job] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    state: str = "idle"
    reason: str | None = None
    requests: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    busy_s: float = 0.0
    warmups: int = 0
    max_new_tokens: int = 0
    last_counter: float | None = None
    to_claim: bool = False
    """Hot prefixes were queued: claim the warm-up (`claim`) before sending them."""
    elsewhere: int = 0
    """Warm-ups left to another edge process, which claimed them first."""


CHAT_ROUTE = "/v1/chat/completions"
MEMBERSHIP_INTERVAL = 1.0
"""Seconds between looks at the registry's backends (those discovery adds or removes)."""


def _usage(answer: Any) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of a `/generate` answer (`meta_info`) or an OpenAI one
    (`usage`, `prompt_tokens_details.cached_tokens`); 0 for what it does not report."""
    counts = usage_from(answer)
    return counts.prompt_tokens or 0, counts.cached_tokens or 0


def _shards(text: Sized, shard_chars: int) -> Iterator[int]:
    """End offsets of the shards of `text` (or of a list of token ids): every `shard_chars`,
    then the whole of it."""
    end = shard_chars
    while end < len(text):
        yield end
        end += shard_chars
    yield len(text)


def _token_ids(text: str) -> list[int] | None:
    """The token ids of a hot prefix of token-id prompts (`text`: them in decimal, joined by
    spaces, cut at a block boundary): all but the last number, which the cut may have split;
    None if there are none."""
    pieces = text.split(" ")[:-1]
    try:
        ids = [int(piece) for piece in pieces]
    except ValueError:
        return None
    return ids or None


class PrewarmService:
    def __init__(
        self,
        config: PrewarmConfig,
        *,
        registry: BackendRegistry,
        pool: UpstreamPool,
        hot: HotPrefixes,
        on_reset: Callable[[str], None] | None = None,
        on_warmed: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rescan_interval: float = MEMBERSHIP_INTERVAL,
        claim: Callable[[str, float], Awaitable[bool]] | None = None,
    ) -> None:
        """`claim(backend url, seconds)`: whether this process warms that backend now (the
        shared fleet view's `claim`: one edge process of the fleet does); None: it always does."""
        config.validate()
        self.config = config
        self.rescan_interval = rescan_interval
        self.registry = registry
        self.pool = pool
        self.hot = hot
        self._on_reset = on_reset
        self._on_warmed = on_warmed
        self._claim = claim
        self._clock = clock
        self._lanes = {b.url: _Lane(b) for b in registry.backends}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # -- triggers --------------------------------------------------------------------------
    async def start(self) -> None:
        self.registry.on_healthy.append(self._healthy_again)
        for lane in self._lanes.values():
            self.warm_hot(lane.backend, reason="join")
        self._spawn(self._watch_members())
        if self.config.restart_check_interval is not None:
            self._spawn(self._watch_restarts())

    async def _watch_members(self) -> None:
        while True:
            await asyncio.sleep(self.rescan_interval)
            self._sync_lanes()

    def _sync_lanes(self) -> None:
        """A lane for each backend in the registry: one discovery added joins (and is warmed),
        one it removed is let go (its warm-up cancelled, its series and `/metrics` polls end)."""
        current = {b.url: b for b in self.registry.backends}
        for url, lane in list(self._lanes.items()):
            if current.get(url) is not lane.backend:
                del self._lanes[url]
                if lane.task is not None:  # `aclose` still waits for it to end
                    lane.task.cancel()
                    self._tasks.add(lane.task)
                    lane.task.add_done_callback(self._tasks.discard)
                for job in lane.jobs:
                    if job.done is not None and not job.done.done():
                        job.done.set_result({"requests": job.requests, "tokens": job.tokens,
                                             "chars": 0, "error": "removed"})  # fmt: skip
                lane.jobs.clear()
        for url, backend in current.items():
            if url not in self._lanes:
                self._lanes[url] = _Lane(backend)
                self.warm_hot(backend, reason="join")

    async def aclose(self) -> None:
        self._closed = True
        with contextlib.suppress(ValueError):
            self.registry.on_healthy.remove(self._healthy_again)
        tasks = [*self._tasks, *(lane.task for lane in self._lanes.values() if lane.task)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for lane in self._lanes.values():
            for job in lane.jobs:
                if job.done is not None and not job.done.done():
                    job.done.cancel()

    def _healthy_again(self, backend: Backend) -> None:
        self.warm_hot(backend, reason="recovered", reset=True)

    def warm_hot(self, backend: Backend, *, reason: str, reset: bool = False) -> int:
        """Queue the hot prefixes for `backend`; it is not ready until they are warm or the
        deadline passed. Returns how many prefixes were queued."""
        lane = self._lanes.get(backend.url)
        if lane is None or self._closed:
            return 0
        if reset and self._on_reset is not None:
            self._on_reset(backend.url)
        # Its own pool's prefixes only (all of them while its model is not known): another
        # model's prefill there would be wasted, and would crowd out what its pool needs.
        prefixes = self.hot.top(backend.model, self.config.top, min_count=self.config.min_count)
        budget = self.config.max_tokens * CHARS_PER_TOKEN
        queued = 0
        # A prefix still waiting in the queue is not queued again: one restart is often told
        # several times (its events, its checks, its request counter), and a flushed cache
        # each time it is flushed. The one being sent is: it may have been sent before that.
        waiting = {job.text for job in lane.jobs if job.done is None}
        for p in prefixes:
            if len(p.text) > budget:
                continue
            budget -= len(p.text)
            ids = _token_ids(p.text) if p.token_ids else None
            if p.token_ids and ids is None:
                continue
            if p.text not in waiting:
                lane.jobs.append(_Job(p.text, chat=p if p.messages else None, ids=ids))
            queued += 1
        if queued:
            lane.to_claim = True
            backend.warming_until = self._clock() + self.config.deadline
            lane.reason = reason
            lane.warmups += 1
            log.info("prewarm: %s (%s): %d hot prefixes", backend.name, reason, queued)
            self._kick(lane)
        return queued

    async def warm_text(
        self, text: str, backends: Sequence[Backend] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Warm `text` on the given backends (all by default) now; wait for the results."""
        loop = asyncio.get_running_loop()
        waits: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._sync_lanes()  # a backend discovery added since the last look
        for b in backends if backends is not None else self.registry.backends:
            lane = self._lanes.get(b.url)
            if lane is None:
                continue
            job = _Job(text, done=loop.create_future())
            lane.jobs.append(job)
            lane.reason = lane.reason or "admin"
            assert job.done is not None
            waits[b.name] = job.done
            self._kick(lane)
        return {name: await fut for name, fut in waits.items()}

    # -- the work --------------------------------------------------------------------------
    def _kick(self, lane: _Lane) -> None:
        if lane.task is None or lane.task.done():
            lane.task = asyncio.get_running_loop().create_task(self._work(lane))

    async def _work(self, lane: _Lane) -> None:
        lane.state = "warming"
        backend = lane.backend
        shard_chars = self.config.shard_tokens * CHARS_PER_TOKEN
        job: _Job | None = None
        try:
            while lane.jobs:
                if lane.to_claim:
                    lane.to_claim = False
                    if self._claim is not None and not await self._claim(
                        backend.url, self.config.deadline
                    ):
                        # Another edge process warms it (it noticed the same restart): its
                        # hot prefixes are not sent twice; `/prewarm`'s texts still are.
                        lane.jobs = [j for j in lane.jobs if j.done is not None]
                        lane.elsewhere += 1
                        backend.warming_until = 0.0
                        continue
                job = lane.jobs.pop(0)
                start = 0
                # Held back from routing with nothing of ours in flight: no request can use a
                # partial prefix there yet, so one request per prefix, without a fixed cost per
                # shard, readies the backend sooner.
                held = backend.warming_until > self._clock() and not backend.in_flight
                sent: list[dict[str, Any]] | None = None
                if job.ids is not None:
                    start = await self._warm_ids(lane, job, job.ids, held)
                    if start and self._on_warmed is not None:
                        self._on_warmed(backend.url, " ".join(map(str, job.ids[:start])))
                    if job.done is not None and not job.done.done():
                        job.done.set_result({"requests": job.requests, "tokens": job.tokens,
                                             "chars": start, "error": job.error})  # fmt: skip
                    continue
                for end in _shards(job.text, len(job.text) if held else shard_chars):
                    if job.chat is None:
                        prompt = {"text": job.text[:end]}
                        ok = await self._send(lane, job, "/generate", prompt, end - start)
                    else:
                        messages = job.chat.cut(end) or []
                        if not messages:  # the shard ends inside the first role marker
                            continue
                        if messages == sent:  # it ends inside a role marker: sent already
                            start = end
                            continue
                        sent = messages
                        prompt = self._chat_body(job.chat, messages)
                        ok = await self._send(lane, job, CHAT_ROUTE, prompt, end - start)
                    if not ok:
                        break
                    start = end
                if start and self._on_warmed is not None:
                    self._on_warmed(backend.url, job.text[:start])
                if job.done is not None and not job.done.done():
                    job.done.set_result({"requests": job.requests, "tokens": job.tokens,
                                         "chars": start, "error": job.error})  # fmt: skip
        finally:
            backend.warming_until = 0.0
            lane.state = "ready"
            if job is not None and job.done is not None and not job.done.done():
                # cancelled (shutdown, or the backend was removed): its caller hears of it
                job.done.set_result({"requests": job.requests, "tokens": job.tokens,
                                     "chars": 0, "error": "cancelled"})  # fmt: skip

    async def _warm_ids(self, lane: _Lane, job: _Job, ids: list[int], held: bool) -> int:
        """Send a prefix of token ids in shards of `shard_tokens` (whole while `held`); returns
        how many of them were warmed."""
        start = 0
        for end in _shards(ids, len(ids) if held else self.config.shard_tokens):
            prompt = {"input_ids": ids[:end]}
            if not await self._send(
                lane, job, "/generate", prompt, (end - start) * CHARS_PER_TOKEN
            ):
                break
            start = end
        return start

    @staticmethod
    def _chat_body(prefix: HotPrefix, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": messages}
        if prefix.tools:  # they lead the prompt the real requests' template renders
            body["tools"] = prefix.tools
        if prefix.model:  # the name the real requests use, so the backend serves the same model
            body["model"] = prefix.model
        return body

    async def _send(
        self, lane: _Lane, job: _Job, route: str, prompt: dict[str, Any], fresh_chars: int
    ) -> bool:
        """One prefill-only request: `prompt` is the body's prompt part (`text` for /generate,
        `messages` and `model` for chat); `fresh_chars` of it are not cached there yet."""
        cfg = self.config
        backend = lane.backend
        waited = self._clock() + cfg.yield_s
        # Real requests go first. Polled: the registry has no event for "first token came".
        while backend.in_prefill > 0 and self._clock() < waited:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        rid = f"prewarm-{uuid.uuid4().hex}"
        fields: dict[str, Any]
        if route == CHAT_ROUTE:
            fields = {"max_tokens": lane.max_new_tokens, "temperature": 0.0, "stream": False}
        else:
            sampling = {"max_new_tokens": lane.max_new_tokens, "temperature": 0.0}
            fields = {"sampling_params": sampling, "stream": False}
        body = orjson.dumps({**prompt, **fields, "rid": rid})
        t0 = self._clock()
        result = "ok"
        # Tracked like a real request: its prefill is work queued on that backend, which the
        # `ttft` policy then weighs (here and, through the load channel, in other processes).
        try:
            with self.registry.track(backend, prefill_tokens=fresh_chars // CHARS_PER_TOKEN):
                response = await self.pool.request(
                    backend.url,
                    "POST",
                    route,
                    headers=[(b"content-type", b"application/json")],
                    body=body,
                    first_byte_timeout=cfg.request_timeout,
                    chunk_timeout=cfg.request_timeout,
                )
                raw = await response.read()
            if response.status == 400 and lane.max_new_tokens == 0:
                lane.max_new_tokens = 1  # this backend wants a token to sample: give it one
                result = "refused"
            elif response.status != 200:
                result = f"{response.status // 100}xx"
            else:
                prompt_tokens, cached = _usage(orjson.loads(raw))
                fresh = max(0, prompt_tokens - cached)
                job.tokens += fresh
                lane.tokens += fresh
        except (UpstreamError, orjson.JSONDecodeError, AttributeError, ValueError) as exc:
            result = getattr(exc, "kind", "protocol")
        dt = self._clock() - t0
        lane.busy_s += dt
        lane.requests[result] = lane.requests.get(result, 0) + 1
        job.requests += 1
        if result == "refused":
            return await self._send(lane, job, route, prompt, fresh_chars)
        if result != "ok":
            job.error = result
            return False
        # Pacing: warm-up takes at most `share` of the backend's time, except while the backend
        # is held back from routing and has none of the edge's requests: nothing waits then.
        if backend.in_flight or backend.warming_until <= self._clock():
            await asyncio.sleep(dt * (1 - cfg.share) / cfg.share)
        return True

    async def _watch_restarts(self) -> None:
        """Poll `/metrics`; a request counter that went down means a new server process."""
        interval = self.config.restart_check_interval
        assert interval is not None
        while True:
            await asyncio.sleep(interval)
            for lane in list(self._lanes.values()):
                value = await self._request_counter(lane.backend)
                if value is None:
                    continue
                if lane.last_counter is not None and value < lane.last_counter:
                    log.info("prewarm: %s restarted (request counter reset)", lane.backend.name)
                    self.warm_hot(lane.backend, reason="restart", reset=True)
                lane.last_counter = value

    async def _request_counter(self, backend: Backend) -> float | None:
        try:
            # Bounded head and body: a backend that stalls in either must not hold the loop
            # that checks every backend.
            timeout = self.registry.health.timeout
            response = await self.pool.request(
                backend.url, "GET", "/metrics", headers=[], body=b"",
                first_byte_timeout=timeout, chunk_timeout=timeout,
            )  # fmt: skip
            raw = await response.read()
        except UpstreamError:
            return None
        if response.status != 200:
            return None
        total: float | None = None
        for line in raw.split(b"\n"):
            if line.startswith(b"sglang:num_requests_total"):
                with contextlib.suppress(ValueError, IndexError):
                    total = (total or 0.0) + float(line.rsplit(b" ", 1)[1])
        return total

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- reporting ---------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        return {
            "backends": {
                lane.backend.name: {
                    "state": lane.state,
                    "ready": lane.backend.warming_until <= now,
                    "reason": lane.reason,
                    "warmups": lane.warmups,
                    "elsewhere": lane.elsewhere,
                    "queued": len(lane.jobs),
                    "requests": dict(lane.requests),
                    "tokens": lane.tokens,
                    "busy_s": round(lane.busy_s, 4),
                }
                for lane in self._lanes.values()
            },
            "hot_prefixes": self.hot.snapshot(self.config.top, min_count=self.config.min_count),
        }

    def collector(self) -> Collector:
        return _PrewarmCollector(self)


class _PrewarmCollector(Collector):
    """`quicedge_prewarm_*`, read when scraped (warm-up pays nothing for its metrics)."""

    def __init__(self, service: PrewarmService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "quicedge_prewarm_requests", "Warm-up requests sent", labels=["backend", "result"]
        )
        tokens = CounterMetricFamily(
            "quicedge_prewarm_tokens", "Prompt tokens prefilled by warm-up", labels=["backend"]
        )
        state = GaugeMetricFamily(
            "quicedge_prewarm_state",
            "1 for the backend's warm-up state",
            labels=["backend", "state"],
        )
        hot = GaugeMetricFamily("quicedge_hot_prefixes", "Prefix blocks tracked")
        for lane in self._service._lanes.values():
            name = lane.backend.name
            for result, n in lane.requests.items():
                requests.add_metric([name, result], n)
            tokens.add_metric([name], lane.tokens)
            for s in STATES:
                state.add_metric([name, s], 1.0 if lane.state == s else 0.0)
        hot.add_metric([], len(self._service.hot))
        yield from (requests, tokens, state, hot)


__all__ = ["PREWARM_FLAGS", "PrewarmConfig", "PrewarmService"]
