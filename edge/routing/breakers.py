"""Circuit breakers per isolation domain: (model version, tenant tier, hardware group).

A backend's domain comes from its labels (`Backend.labels`: `model`, `hardware`, `tiers`; see
`backends.labels.parse_labels`); a request's tier from its tenant (`ex.tier`, gold until the
admission stage sets one). Each (model, tier, hardware) has one `edge.routing.breaker.Breaker`,
which says how it opens and closes; this module keeps them, filters candidates with them, feeds them
outcomes and KV usage, and learns a backend's model from `/get_model_info`.

Per request the cost is one dict lookup per candidate; while every breaker is closed and no
backend restricts its tiers, `allowed` hands the candidate list back untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from backends.backend import Backend
from backends.labels import model_label_of, split_model_label
from edge.routing.breaker import (
    CLOSED,
    DEFAULT_TIER,
    FAILING_KINDS,
    HALF_OPEN,
    OPEN,
    STATE_NAMES,
    TIERS,
    Breaker,
    BreakerConfig,
    Ticket,
    domain_of,
    serves,
)

log = logging.getLogger(__name__)

_UNSEEN: Any = object()
"""A backend the per-tier table has no entry for yet."""


ModelInfo = Callable[[Backend], Awaitable[Mapping[str, Any]]]
"""Asks a backend for its `/get_model_info` (raises on failure)."""

LEARN_RETRY_S = 5.0
"""Wait before asking a backend that did not answer `/get_model_info` again, s."""


def model_label(info: Mapping[str, Any]) -> str | None:
    """The `model` label a `/get_model_info` answer implies (None: it names no model)."""
    path = info.get("model_path")
    if not isinstance(path, str) or not path:
        return None
    version = info.get("weight_version")
    return model_label_of(path, version if isinstance(version, str) and version else None)


class Breakers:
    """Every domain's breaker, the candidate filter and the outcome feed."""

    def __init__(
        self,
        config: BreakerConfig,
        backends: Sequence[Backend],
        *,
        registry: CollectorRegistry | None = None,
        model_info: ModelInfo | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._model_info = model_info
        self._ask_after: dict[Backend, float] = {}
        """Backends whose model is still to learn → when to ask next (after a failure)."""
        self.backends = backends
        """The registry's live list (discovery adds and removes in place)."""
        self._clock = clock
        self._domains: dict[tuple[str, str, str], Breaker] = {}
        self._tables: dict[str, dict[Backend, Breaker | None]] = {t: {} for t in TIERS}
        """Per tier: backend → its breaker (None: the backend does not serve the tier)."""
        self._task: asyncio.Task[None] | None = None
        self._not_closed = 0
        """Breakers open or half-open: none, and `allowed` has nothing to check."""
        self._restricted = False
        """Some backend's `tiers` label leaves a tier out."""
        self._known = -1
        """How many backends the last full scan (`update_kv`) saw; another count is news."""
        self._state: Gauge | None = None
        self._transitions: Counter | None = None
        self._refused: Counter | None = None
        self._last_resort: Counter | None = None
        if registry is not None:
            labels = ("model", "tier", "hardware")
            self._state = Gauge(
                "quicedge_breaker_state",
                "Circuit breaker of an isolation domain: 0 closed, 1 half-open, 2 open.",
                labels, registry=registry,
            )  # fmt: skip
            self._transitions = Counter(
                "quicedge_breaker_transitions",
                "Circuit breaker state changes, by domain and the state entered.",
                (*labels, "to"), registry=registry,
            )  # fmt: skip
            self._refused = Counter(
                "quicedge_breaker_refused_requests",
                "Requests refused with 503 circuit_open: every backend of their tier was behind "
                "an open breaker.",
                ("tier",), registry=registry,
            )  # fmt: skip
            self._last_resort = Counter(
                "quicedge_breaker_last_resort_requests",
                "Requests sent to a domain open on its TTFT alone, because every domain of their "
                "tier was open (breakers.slow_last_resort).",
                ("tier",), registry=registry,
            )  # fmt: skip

    # -- the request path -------------------------------------------------------------------
    def _breaker(self, backend: Backend, tier: str) -> Breaker | None:
        table = self._tables.get(tier)
        if table is None:
            table = self._tables[tier] = {}
        try:
            return table[backend]
        except KeyError:
            pass
        found: Breaker | None = None
        if "tiers" in backend.labels:
            self._restricted = True
        if serves(backend, tier):
            model, hardware = domain_of(backend)
            found = self._domain(model, tier, hardware)
        table[backend] = found
        return found

    def _domain(self, model: str, tier: str, hardware: str) -> Breaker:
        key = (model, tier, hardware)
        breaker = self._domains.get(key)
        if breaker is None:
            breaker = self._domains[key] = Breaker(model, tier, hardware, self.config)
            if self._state is not None:
                self._state.labels(model, tier, hardware).set(CLOSED)
        return breaker

    def allowed(self, candidates: list[Backend], tier: str) -> list[Backend]:
        """The candidates whose domain for `tier` takes new work (open: no; half-open: while a
        probe slot is free)."""
        if not self.config.enabled or (
            not self._not_closed and not self._restricted and len(self.backends) == self._known
        ):
            return candidates  # every breaker closed, every backend serves every tier
        out: list[Backend] | None = None
        now = 0.0
        table = self._tables.get(tier)
        for i, backend in enumerate(candidates):
            breaker = table.get(backend, _UNSEEN) if table is not None else _UNSEEN
            if breaker is _UNSEEN:
                breaker = self._breaker(backend, tier)
            ok = True
            if breaker is None:
                ok = False
            elif breaker.state != CLOSED:
                if not now:
                    now = self._clock()
                ok = self._admits(breaker, now)
            if not ok and out is None:
                out = candidates[:i]
            elif ok and out is not None:
                out.append(backend)
        if out is None:
            return candidates
        if not out and self.config.slow_last_resort:
            return self._slow_only(candidates, tier)
        return out

    def _slow_only(self, candidates: list[Backend], tier: str) -> list[Backend]:
        """The candidates whose domain opened on its TTFT alone, when no domain takes work: a
        slow answer beats a refusal when there is nowhere faster to go."""
        out = []
        for backend in candidates:
            breaker = self._breaker(backend, tier)
            if breaker is not None and breaker.state != CLOSED and breaker.slow:
                out.append(backend)
        if out and self._last_resort is not None:
            self._last_resort.labels(tier).inc()
        return out

    def _admits(self, breaker: Breaker, now: float) -> bool:
        if breaker.state == OPEN:
            if now < breaker.reopen_at:
                return False
            kv = breaker.kv_usage
            if kv is not None and kv > self.config.kv_open:
                breaker.reopen_at = now + breaker.open_s  # still full: not worth a probe
                return False
            self._move(breaker, HALF_OPEN, breaker.reason)
        return breaker.probes < self.config.half_open_probes

    def started(self, backend: Backend, tier: str) -> Ticket | None:
        """The chosen backend's ticket in its domain's breaker, holding a probe slot while it is
        half-open; hand it back to `ended` with the outcome."""
        if not self.config.enabled:
            return None
        breaker = self._breaker(backend, tier)
        if breaker is None:
            return None
        if breaker.state == HALF_OPEN:
            breaker.probes += 1
            return Ticket(breaker, breaker.period, holding=True)
        return breaker.ticket

    def ended(
        self,
        ticket: Ticket,
        error: str | None,
        ttft: float | None,
        uncached_tokens: int = 0,
        *,
        held: bool = True,
    ) -> None:
        """One attempt's outcome in its domain (`ticket` from `started`; `held`: this call also
        gives back the probe slot, which `release` did already otherwise). An attempt that
        began before the breaker's last state change counts for nothing: it was not admitted
        as a probe of this period, and a close empties the windows of what came before."""
        if held:
            self.release(ticket)
        breaker = ticket.breaker
        if ticket.period != breaker.period:
            return
        state = breaker.state
        if error is not None and error not in FAILING_KINDS:
            return  # the client's mistake or departure says nothing of the domain
        failed = error is not None
        if ttft is not None:
            ttft = max(0.0, ttft - self.config.ttft_per_prompt_token * uncached_tokens)
        if state == HALF_OPEN:
            slow = ttft is not None and ttft > self.config.ttft_open_p99
            if failed or slow:
                breaker.open_s = min(self.config.open_max, breaker.open_s * 2)
                reason = "probe failed" if failed else f"probe ttft {ttft * 1000:.0f}ms"  # type: ignore[operator]
                self._open(breaker, reason, slow=not failed)
                return
            breaker.probe_successes += 1
            if breaker.probe_successes >= self.config.half_open_probes:
                breaker.reset_windows()
                breaker.open_s = self.config.open_for
                self._move(breaker, CLOSED, None)
            return
        if state == OPEN:
            return  # a last resort sent to a domain open on its TTFT: judged by its probes
        why = breaker.record(failed, ttft)
        if why is not None:
            self._open(breaker, why, slow=why.startswith("ttft"))

    def release(self, ticket: Ticket) -> None:
        """Give back the probe slot `started` took, once (the outcome comes later, or never).
        A slot of an earlier period is gone already: the state change freed them all."""
        if ticket.holding:
            ticket.holding = False
            if ticket.period == ticket.breaker.period:
                ticket.breaker.probes -= 1

    # -- state changes ----------------------------------------------------------------------
    def _open(self, breaker: Breaker, reason: str, *, slow: bool = False) -> None:
        now = self._clock()
        breaker.slow = slow
        breaker.opened_at = now
        breaker.reopen_at = now + breaker.open_s
        self._move(breaker, OPEN, reason)

    def _move(self, breaker: Breaker, state: int, reason: str | None) -> None:
        before = breaker.state
        if before == state:
            return
        breaker.state = state
        self._not_closed += (state != CLOSED) - (before != CLOSED)
        breaker.reason = reason
        breaker.new_period()
        level = logging.INFO if state == CLOSED else logging.WARNING
        log.log(level, "breaker %s/%s/%s %s -> %s (%s)", breaker.model, breaker.tier,
                breaker.hardware, STATE_NAMES[before], STATE_NAMES[state], reason)  # fmt: skip
        if self._state is not None and self._transitions is not None:
            self._state.labels(*breaker.key).set(state)
            self._transitions.labels(*breaker.key, STATE_NAMES[state]).inc()

    def refused(self, tier: str, untried: Sequence[Backend] = ()) -> float:
        """Count a request no domain could take; return the seconds until one of the domains
        of `untried` (the request's own backends not yet tried; all of the tier's when none
        are given) may probe: another model's domain reopening sooner serves it nothing."""
        if self._refused is not None:
            self._refused.labels(tier).inc()
        now = self._clock()
        own = {domain_of(b) for b in untried}
        waits = [
            b.reopen_at - now
            for b in self._domains.values()
            if b.state == OPEN and b.tier == tier and (not own or (b.model, b.hardware) in own)
        ]
        return max(1.0, min(waits, default=1.0))

    # -- KV usage ---------------------------------------------------------------------------
    def update_kv(self) -> None:
        """Read each domain's KV usage from its backends' last `/v1/loads` (those of its model
        and hardware group that serve its tier); open the full ones."""
        usage: dict[tuple[str, str, str], list[float]] = {}
        for backend in self.backends:
            load = backend.load
            if load is not None and backend.healthy and not backend.draining:
                model, hardware = domain_of(backend)
                for tier in TIERS:
                    if serves(backend, tier):
                        usage.setdefault((model, tier, hardware), []).append(
                            float(load.token_usage)
                        )
        self._forget_gone()
        for tier in TIERS:
            for backend in self.backends:
                self._breaker(backend, tier)  # domains exist before their first request
        self._restricted = any("tiers" in b.labels for b in self.backends)
        self._known = len(self.backends)
        for breaker in self._domains.values():
            found = usage.get(breaker.key)
            breaker.kv_usage = sum(found) / len(found) if found else None
            if (
                breaker.state != OPEN
                and breaker.kv_usage is not None
                and breaker.kv_usage > self.config.kv_open
            ):
                self._open(breaker, f"kv usage {breaker.kv_usage:.2f}")

    def relabel(self) -> None:
        """Forget which breaker each backend maps to (its labels changed), and the domains no
        backend is in any more (`_forget_gone`)."""
        for table in self._tables.values():
            table.clear()
        self._known = -1
        self._forget_gone()

    def _forget_gone(self) -> None:
        """Drop from the per-tier tables the backends that left the list (a reload, discovery)
        and those whose labels moved them to another domain (the catalog learns a model before
        it calls `relabel`), then the domains no backend is in any more, whatever their state,
        gauge series included: nothing could ever probe or close an open one, whose series
        would read "open" for good. The attempts still in flight in a dropped domain end
        uncounted: a breaker nobody keeps could open, and stay open, unseen."""
        alive = set(self.backends)
        for table in self._tables.values():
            stale = [
                backend
                for backend, breaker in table.items()
                if backend not in alive
                or (breaker is not None and (breaker.model, breaker.hardware) != domain_of(backend))
            ]
            for backend in stale:
                del table[backend]
        for backend in [b for b in self._ask_after if b not in alive]:
            del self._ask_after[backend]
        live = {domain_of(b) for b in alive}
        for key, breaker in list(self._domains.items()):
            if (breaker.model, breaker.hardware) in live:
                continue
            if breaker.state != CLOSED:
                self._not_closed -= 1
                log.info("breaker %s/%s/%s %s -> dropped (no backend is in its domain any more)",
                         *key, STATE_NAMES[breaker.state])  # fmt: skip
            breaker.new_period()
            del self._domains[key]
            if self._state is not None:
                with contextlib.suppress(KeyError):
                    self._state.remove(*key)

    async def reconfigure(self, config: BreakerConfig) -> None:
        """A reloaded `[breakers]`, for every domain's next decision (`Breaker.reconfigure`).
        Turned off, every domain closes with its windows emptied and the KV poll stops; turned
        on, the poll starts and the domains begin from closed."""
        config.validate()
        was = self.config.enabled
        self.config = config
        for breaker in self._domains.values():
            breaker.reconfigure(config)
            if not config.enabled:
                breaker.reset_windows()
                if breaker.state == CLOSED:
                    # off counts nothing, not even the attempts in flight now (`_move` starts a
                    # new period for the others): they could open a domain while it is off
                    breaker.new_period()
                self._move(breaker, CLOSED, "breakers turned off")
        if was and not config.enabled:
            await self.aclose()
        elif config.enabled and not was:
            self.start()

    def start(self) -> None:
        if self.config.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._kv_loop())

    async def learn_models(self) -> None:
        """Label each backend that has no `model=` label with the model it reports."""
        if self._model_info is None or not self.config.learn_model:
            return
        now = self._clock()
        changed = False
        for backend in list(self.backends):
            if "model" in backend.labels or self._ask_after.get(backend, 0.0) > now:
                continue
            try:
                async with asyncio.timeout(self.config.kv_interval * 4):
                    label = model_label(await self._model_info(backend))
            except Exception as exc:  # not up yet, or not SGLang: ask again later
                log.debug("model info of %s: %r", backend.name, exc)
                self._ask_after[backend] = now + LEARN_RETRY_S
                continue
            self._ask_after[backend] = math.inf  # asked and answered: never again
            if label is not None:
                backend.set_model(*split_model_label(label))  # the pools see it too
                changed = True
        if changed:
            self.relabel()

    async def _kv_loop(self) -> None:
        """Every `kv_interval`: read the KV usage, and start learning models unless the last
        round still asks. Asking runs beside the poll: backends slow to answer (up to
        4 × `kv_interval` each, one after another) must not hold up the KV signal."""
        learning: asyncio.Task[None] | None = None
        try:
            while True:
                idle = learning is None or learning.done()
                if idle and self.config.learn_model and self._model_info is not None:
                    learning = asyncio.get_running_loop().create_task(self._learn())
                try:
                    self.update_kv()
                except Exception:  # a bug here must not stop the loop; it is logged
                    log.exception("breaker update failed")
                await asyncio.sleep(self.config.kv_interval)
        finally:
            if learning is not None:
                learning.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await learning

    async def _learn(self) -> None:
        try:
            await self.learn_models()
        except Exception:  # a bug here must not stop the poll; it is logged
            log.exception("breaker model learning failed")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- admin ------------------------------------------------------------------------------
    def state_of(self, model: str, tier: str, hardware: str) -> str | None:
        breaker = self._domains.get((model, tier, hardware))
        return None if breaker is None else STATE_NAMES[breaker.state]

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-able state of every domain, for the admin `/backends` route."""
        now = self._clock()
        return [self._domains[k].snapshot(now) for k in sorted(self._domains)]


__all__ = [
    "CLOSED",
    "DEFAULT_TIER",
    "HALF_OPEN",
    "OPEN",
    "STATE_NAMES",
    "TIERS",
    "Breaker",
    "BreakerConfig",
    "Breakers",
    "Ticket",
    "domain_of",
    "serves",
]
