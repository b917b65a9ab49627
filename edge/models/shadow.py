"""Shadow diff-testing: a sampled share of stable traffic answered again by both versions.

After a stable request succeeded, `Shadow.mirror` decides in O(1) whether to mirror it
(`shadow_fraction`); a mirror starts only while fewer than `shadow_concurrency` are in flight,
the rate bucket (`shadow_rate` per second) has a token, and the canary is not overloaded
(degraded, at its cap or queueing). Otherwise it is dropped and counted. A mirror is a detached
task: the client's answer never waits for it. A mirror in flight is cancelled, its upstream
request closed and aborted by rid, as soon as the canary becomes overloaded (degraded or
unhealthy, queueing in `/v1/loads`, a breaker of its domain open) or the rollout stops testing
(paused, rolled back, promoted): the canary's capacity goes to its clients first.

Each mirror sends the request, not streamed and with logprobs asked for, to one stable and one
canary backend at once (the client's own stream is relayed as it comes, never held or parsed for
logprobs, so the stable side of a pair is asked again). The two answers are compared
(`compare`): exact match for greedy requests, token overlap and edit similarity of the texts,
length ratio, finish reason, top-1 token agreement and mean top-1 probability; the comparison goes
to metrics and each answer's summary to the drift windows (`edge.models.ramp.Ramp.add_pair`).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from backends.credentials import BackendCredentials
from backends.pool import UpstreamPool
from backends.registry import Backend, BackendRegistry
from edge.models.config import RolloutConfig
from edge.models.drift import Sample
from edge.models.metrics import ModelMetrics
from edge.models.ramp import Ramp
from edge.relay import read_whole
from edge.routing.breakers import TIERS, Breakers, domain_of
from edge.stages.validate import CHAT, COMPLETIONS, GENERATE

log = logging.getLogger(__name__)

TOP_K = 5
"""Alternatives asked per token; the entropy is that of the top-k, renormalised."""
MAX_COMPARED_WORDS = 2000
"""Words of each text the edit similarity looks at (it is quadratic in the worst case)."""
MAX_SHADOW_BODY = 8 * 1024 * 1024
WATCH_INTERVAL = 0.05
"""How often the mirrors in flight are checked against their canary's load, s (the queue is
known from `/v1/loads` polls, every `proxy.loads_interval`, so this adds little to that)."""

Aborter = Callable[[Backend, str], None]
"""Fire-and-forget `/abort_request` for (backend, rid) (`edge.wiring.Wiring.abort`)."""


@dataclass(slots=True)
class Answer:
    """The parts of one non-streamed answer a comparison reads."""

    text: str
    finish: str | None
    tokens: int
    top1: list[str] = field(default_factory=list)
    """The most likely token at each position (where logprobs came back)."""
    top1_prob: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)

    def sample(self) -> Sample:
        return Sample(
            length=float(self.tokens),
            stopped=self.finish == "stop",
            top1=sum(self.top1_prob) / len(self.top1_prob) if self.top1_prob else None,
            entropy=sum(self.entropy) / len(self.entropy) if self.entropy else None,
        )


def _position(alternatives: Sequence[tuple[str, float]]) -> tuple[str, float, float]:
    """(top-1 token, its probability, entropy of the renormalised top-k) of one position."""
    best = max(alternatives, key=lambda a: a[1])
    probs = [math.exp(lp) for _, lp in alternatives]
    total = sum(probs)
    entropy = -sum(p / total * math.log(p / total) for p in probs if p > 0)
    return best[0], math.exp(best[1]), entropy


def parse_answer(route: str, body: bytes) -> Answer:
    """The answer of a non-streamed response of `route` (SGLang's shapes); ValueError if odd."""
    obj = orjson.loads(body)
    positions: list[Sequence[tuple[str, float]]] = []
    if route == GENERATE:
        meta = obj.get("meta_info") or {}
        finish = (meta.get("finish_reason") or {}).get("type")
        text, tokens = obj.get("text", ""), int(meta.get("completion_tokens") or 0)
        for top in meta.get("output_top_logprobs") or []:
            positions.append([(str(alt[1]), float(alt[0])) for alt in top or []])
    else:
        choice = (obj.get("choices") or [{}])[0]
        finish = choice.get("finish_reason")
        text = (choice.get("message") or {}).get("content") if route == CHAT else choice.get("text")
        tokens = int((obj.get("usage") or {}).get("completion_tokens") or 0)
        logprobs = choice.get("logprobs") or {}
        if route == CHAT:
            for entry in logprobs.get("content") or []:
                tops = entry.get("top_logprobs") or [entry]
                positions.append([(t["token"], float(t["logprob"])) for t in tops])
        else:
            for top in logprobs.get("top_logprobs") or []:
                positions.append([(k, float(v)) for k, v in (top or {}).items()])
    answer = Answer(text=text or "", finish=finish, tokens=tokens)
    for alternatives in positions:
        if alternatives:
            token, prob, entropy = _position(alternatives)
            answer.top1.append(token)
            answer.top1_prob.append(prob)
            answer.entropy.append(entropy)
    return answer


@dataclass(frozen=True, slots=True)
class Comparison:
    exact: bool | None
    """Texts equal (greedy requests only; None otherwise)."""
    token_overlap: float
    edit_similarity: float
    length_ratio: float
    finish_agree: bool
    top1_agreement: float | None
    stable_top1: float | None
    canary_top1: float | None


def compare(stable: Answer, canary: Answer, *, greedy: bool) -> Comparison:
    a, b = stable.text.split(), canary.text.split()
    union = set(a) | set(b)
    overlap = len(set(a) & set(b)) / len(union) if union else 1.0
    edit = difflib.SequenceMatcher(
        None, a[:MAX_COMPARED_WORDS], b[:MAX_COMPARED_WORDS], autojunk=False
    ).ratio()
    ratio = canary.tokens / stable.tokens if stable.tokens else (1.0 if not canary.tokens else 0.0)
    agreement = None
    n = min(len(stable.top1), len(canary.top1))
    if n:
        agreement = sum(x == y for x, y in zip(stable.top1, canary.top1, strict=False)) / n
    s, c = stable.sample(), canary.sample()
    return Comparison(
        exact=(stable.text == canary.text) if greedy else None,
        token_overlap=overlap, edit_similarity=edit, length_ratio=ratio,
        finish_agree=stable.finish == canary.finish, top1_agreement=agreement,
        stable_top1=s.top1, canary_top1=c.top1,
    )  # fmt: skip


def shadow_body(route: str, payload: bytes, rid: str) -> tuple[bytes, bool]:
    """The request for a shadow: not streamed, logprobs asked, its own rid; and whether it is
    greedy (temperature 0: the two answers should be equal)."""
    body: dict[str, Any] = orjson.loads(payload)
    body["rid"] = rid
    if route == GENERATE:
        body["stream"] = False
        body["return_logprob"] = True
        body["top_logprobs_num"] = TOP_K
        temperature = (body.get("sampling_params") or {}).get("temperature", 1.0)
    else:
        body["stream"] = False
        body.pop("stream_options", None)
        if route == CHAT:
            body["logprobs"], body["top_logprobs"] = True, TOP_K
        elif route == COMPLETIONS:
            body["logprobs"] = TOP_K
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


def overloaded(backend: Backend) -> bool:
    """Too busy for a new mirror: degraded, at its concurrency cap or queueing."""
    return (
        backend.max_concurrency is not None and backend.in_flight >= backend.max_concurrency
    ) or strained(backend, None) is not None


def strained(backend: Backend, breakers: Breakers | None) -> str | None:
    """Why a mirror in flight on `backend` should give way (None: it need not): `degraded`
    (or unhealthy), `queue` (requests waiting in its `/v1/loads`) or `breaker` (a breaker of its
    domain is open). The concurrency cap is not a reason: the mirror itself counts against it."""
    if backend.degraded or not backend.healthy:
        return "degraded"
    load = backend.load
    if load is not None and load.num_waiting_reqs > 0:
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
        self.compared = 0
        self.last: Comparison | None = None

    def _count(self, result: str) -> None:
        self.metrics.shadow.labels(self.config.model, result).inc()

    def _pick(self, version: str) -> Backend | None:
        mine = [b for b in self.registry.candidates()
                if b.model == self.config.model and b.model_version == version]  # fmt: skip
        return min(mine, key=lambda b: b.in_flight) if mine else None

    def mirror(self, route: str, payload: bytes, rid: str) -> None:
        """Maybe start a mirror of a stable request that succeeded (never blocks, never raises)."""
        if self.config.shadow_fraction <= 0 or self._rng() >= self.config.shadow_fraction:
            return
        if self.ramp.rollout.state in ("rolled_back", "promoted"):
            return
        if len(self._tasks) >= self.config.shadow_concurrency:
            self._count("dropped_full")
            return
        canary = self._pick(self.config.canary)
        stable = self._pick(self.config.stable)
        if (
            canary is None or stable is None or overloaded(canary)
            or strained(canary, self.breakers) is not None
        ):  # fmt: skip
            self._count("canary_busy")
            return
        if not self._bucket.take():
            self._count("dropped_rate")
            return
        task = asyncio.ensure_future(self._pair(route, payload, rid, stable, canary))
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
            reason = strained(mirror.canary, self.breakers)
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
        if self.abort is not None:
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

    async def _pair(
        self, route: str, payload: bytes, rid: str, stable: Backend, canary: Backend
    ) -> None:
        try:
            body_s, greedy = shadow_body(route, payload, rid + "-shadow-s")
            body_c, _ = shadow_body(route, payload, rid + "-shadow-c")
            async with asyncio.timeout(self.config.shadow_timeout):
                a, b = await asyncio.gather(
                    self._ask(stable, route, body_s), self._ask(canary, route, body_c)
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a shadow's failure is counted, never the client's
            log.info("shadow pair for %s failed: %r", rid, exc)
            self._count("error")
            return
        self.record(compare(a, b, greedy=greedy), a, b)

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


__all__ = [
    "Answer", "Comparison", "Shadow", "compare", "parse_answer", "shadow_body", "strained",
]  # fmt: skip
