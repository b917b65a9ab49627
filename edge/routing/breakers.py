"""Circuit breakers per isolation domain: (model version, tenant tier, hardware group).

A backend's domain comes from its labels (`Backend.labels`: `model`, `hardware`, `tiers`; see
`backends.registry.parse_labels`); a request's tier from its tenant (`ex.tier`, gold until the
admission stage sets one). Each (model, tier, hardware) has one breaker:

- **closed**: traffic flows; the breaker watches the domain's error rate (last `window`
  outcomes), its TTFT p99 (last `ttft_window` first tokens, each less the prefill allowance
  `ttft_per_prompt_token` × uncached prompt tokens) and its KV usage (mean `token_usage` of the
  domain's backends from `/v1/loads`). Any of them past its open threshold opens it.
- **open**: the domain's backends are not candidates for that tier; other tiers and other
  hardware groups on the same backends keep flowing. After `open_for` s it goes half-open
  (staying open while the KV usage is still past its threshold).
- **half-open**: at most `half_open_probes` trial requests at once; `half_open_probes`
  successes in a row close it (its windows start empty); one failure opens it again for twice
  as long (up to `open_max`).

Per request the cost is one dict lookup per candidate; while every breaker is closed and no
backend restricts its tiers, `allowed` hands the candidate list back untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from backends.registry import Backend

log = logging.getLogger(__name__)

CLOSED, HALF_OPEN, OPEN = 0, 1, 2
STATE_NAMES = ("closed", "half_open", "open")
TIERS = ("gold", "silver", "bronze")
DEFAULT_TIER = "gold"
"""The tier of a request no tenant placed (until the admission stage sets `Exchange.tier`)."""
DEFAULT_HARDWARE = "default"
DEFAULT_MODEL = "default"

FAILING_KINDS = frozenset({"connect", "timeout", "protocol", "upstream", "5xx", "backend_error"})
"""Outcome kinds that count as a domain's error (a 4xx is the client's; a disconnect nobody's)."""


@dataclass(slots=True)
class BreakerConfig:
    """`[breakers]`: circuit breakers per (model version, tenant tier, hardware group)."""

    enabled: bool = True
    """Run the breakers. Off: every domain is always closed and costs nothing per request."""
    window: int = 50
    """Outcomes kept per domain for its error rate."""
    min_requests: int = 10
    """Outcomes in the window before the error rate may open a breaker."""
    error_rate: float = 0.5
    """Share of failed outcomes (connect, timeout, broken, 5xx) that opens a breaker, 0..1."""
    ttft_window: int = 100
    """First-token times kept per domain for its TTFT p99."""
    ttft_min_samples: int = 20
    """First-token times in the window before the p99 may open a breaker."""
    ttft_warn_p99: float = 0.1
    """TTFT p99 above which a domain is in warning (reported, still served), s. Default 100 ms."""
    ttft_open_p99: float = 0.2
    """TTFT p99 above which a domain's breaker opens, s. Default 200 ms."""
    ttft_per_prompt_token: float = 33e-6
    """Prefill allowance taken off each TTFT before it is judged, s per uncached prompt token
    (default 33 µs, the prefill slope of the stand-in's h100 profile and of Llama-3-8B on an
    H100), so a long prompt's honest prefill does not read as a slow domain."""
    kv_warn: float = 0.60
    """KV usage (0..1, mean `token_usage` of the domain's backends) above which it is in
    warning."""
    kv_open: float = 0.85
    """KV usage above which the domain sheds new work (its breaker opens)."""
    open_for: float = 5.0
    """How long a breaker stays open before its first half-open probe, s."""
    open_max: float = 60.0
    """Longest open period, s: each failed probe doubles the last one up to this."""
    half_open_probes: int = 3
    """Trial requests let through at once while half-open; as many successes in a row close it."""
    kv_interval: float = 0.5
    """How often the domains' KV usage is read from the backends' last `/v1/loads`, s."""
    learn_model: bool = False
    """Ask each backend without a `model=` label for its model (`/get_model_info`:
    `model_path`, with `@weight_version` unless that is "default") and use that. Off by default:
    without labels every backend is in one model domain, and no request is sent that the
    operator did not ask for."""

    def validate(self) -> BreakerConfig:
        for name in ("window", "min_requests", "ttft_window", "ttft_min_samples",
                     "half_open_probes"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"breakers.{name}: must be >= 1, got {getattr(self, name)!r}")
        if self.min_requests > self.window:
            raise ValueError("breakers.min_requests: must be <= breakers.window")
        if self.ttft_min_samples > self.ttft_window:
            raise ValueError("breakers.ttft_min_samples: must be <= breakers.ttft_window")
        if not 0 < self.error_rate <= 1:
            raise ValueError(f"breakers.error_rate: must be in (0, 1], got {self.error_rate!r}")
        for name in ("ttft_warn_p99", "ttft_open_p99", "open_for", "open_max", "kv_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"breakers.{name}: must be > 0, got {getattr(self, name)!r}")
        if self.ttft_per_prompt_token < 0:
            raise ValueError("breakers.ttft_per_prompt_token: must be >= 0")
        if self.ttft_warn_p99 > self.ttft_open_p99:
            raise ValueError("breakers.ttft_warn_p99: must be <= breakers.ttft_open_p99")
        if not 0 < self.kv_warn <= self.kv_open <= 1:
            raise ValueError("breakers.kv_warn, kv_open: need 0 < kv_warn <= kv_open <= 1")
        if self.open_max < self.open_for:
            raise ValueError("breakers.open_max: must be >= breakers.open_for")
        return self

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> BreakerConfig:
        """From a `[breakers]` table, refusing unknown keys (not validated: call `validate()`)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"breakers: unknown setting(s) {', '.join(unknown)}")
        return cls(**values)


def domain_of(backend: Backend) -> tuple[str, str]:
    """The (model version, hardware group) a backend's labels put it in."""
    labels = backend.labels
    return labels.get("model", DEFAULT_MODEL), labels.get("hardware", DEFAULT_HARDWARE)


def serves(backend: Backend, tier: str) -> bool:
    """Whether the backend's `tiers` label (every tier when absent) includes `tier`."""
    tiers = backend.labels.get("tiers")
    return tiers is None or tier in tiers.split("+")


_UNSEEN: Any = object()
"""A backend the per-tier table has no entry for yet."""


class Breaker:
    """The breaker of one domain: its state and the windows that decide it."""

    __slots__ = (
        "_errors",
        "_failures",
        "_samples_since",
        "_ttfts",
        "config",
        "hardware",
        "kv_usage",
        "model",
        "open_s",
        "opened_at",
        "probes",
        "probe_successes",
        "reason",
        "reopen_at",
        "state",
        "tier",
        "ttft_p99",
    )

    def __init__(self, model: str, tier: str, hardware: str, config: BreakerConfig) -> None:
        self.model, self.tier, self.hardware = model, tier, hardware
        self.config = config
        self.state = CLOSED
        self.reason: str | None = None
        self.opened_at = 0.0
        self.reopen_at = 0.0
        self.open_s = config.open_for
        self.probes = 0
        """Trial requests in flight while half-open."""
        self.probe_successes = 0
        self.kv_usage: float | None = None
        self.ttft_p99: float | None = None
        self._errors: deque[int] = deque(maxlen=config.window)
        self._failures = 0
        self._ttfts: deque[float] = deque(maxlen=config.ttft_window)
        self._samples_since = 0

    @property
    def key(self) -> tuple[str, str, str]:
        return self.model, self.tier, self.hardware

    def error_rate(self) -> float | None:
        return self._failures / len(self._errors) if self._errors else None

    def health(self) -> str:
        """healthy / warning (a signal past its warning threshold) / open (the state)."""
        if self.state == OPEN:
            return "open"
        c = self.config
        if (self.ttft_p99 is not None and self.ttft_p99 > c.ttft_warn_p99) or (
            self.kv_usage is not None and self.kv_usage > c.kv_warn
        ):
            return "warning"
        return "healthy"

    def record(self, failed: bool, ttft: float | None) -> str | None:
        """Add one outcome to the windows; return why the breaker should open, or None."""
        if len(self._errors) == self._errors.maxlen and self._errors[0]:
            self._failures -= 1
        self._errors.append(1 if failed else 0)
        if failed:
            self._failures += 1
        c = self.config
        if len(self._errors) >= c.min_requests and self._failures >= c.error_rate * len(
            self._errors
        ):
            return f"error rate {self._failures}/{len(self._errors)}"
        if ttft is not None:
            self._ttfts.append(ttft)
            self._samples_since += 1
            # Sorting the window on every sample would cost a list per request: every 8th is
            # enough for a p99 over 100 samples.
            if len(self._ttfts) >= c.ttft_min_samples and self._samples_since >= min(
                8, c.ttft_min_samples
            ):
                self._samples_since = 0
                ordered = sorted(self._ttfts)
                self.ttft_p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
                if self.ttft_p99 > c.ttft_open_p99:
                    return f"ttft p99 {self.ttft_p99 * 1000:.0f}ms"
        return None

    def reset_windows(self) -> None:
        self._errors.clear()
        self._failures = 0
        self._ttfts.clear()
        self._samples_since = 0
        self.ttft_p99 = None

    def snapshot(self, now: float) -> dict[str, Any]:
        rate = self.error_rate()
        return {
            "model": self.model,
            "tier": self.tier,
            "hardware": self.hardware,
            "state": STATE_NAMES[self.state],
            "health": self.health(),
            "reason": self.reason,
            "open_for_s": round(max(0.0, self.reopen_at - now), 3) if self.state == OPEN else 0.0,
            "error_rate": None if rate is None else round(rate, 4),
            "outcomes": len(self._errors),
            "ttft_p99_ms": None if self.ttft_p99 is None else round(self.ttft_p99 * 1000, 2),
            "kv_usage": None if self.kv_usage is None else round(self.kv_usage, 4),
            "probes_in_flight": self.probes,
        }


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
    if isinstance(version, str) and version and version != "default":
        return f"{path}@{version}"
    return path


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
        return candidates if out is None else out

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

    def started(self, backend: Backend, tier: str) -> Breaker | None:
        """The chosen backend's breaker, holding a probe slot while it is half-open; hand it
        back to `ended` with the outcome."""
        if not self.config.enabled:
            return None
        breaker = self._breaker(backend, tier)
        if breaker is not None and breaker.state == HALF_OPEN:
            breaker.probes += 1
        return breaker

    def ended(
        self,
        breaker: Breaker,
        error: str | None,
        ttft: float | None,
        uncached_tokens: int = 0,
        *,
        held: bool = True,
    ) -> None:
        """One attempt's outcome in `breaker`'s domain (from `started`; `held`: this call also
        gives back the probe slot, which `release` did already otherwise)."""
        if held:
            self.release(breaker)
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
                self._open(breaker, reason)
                return
            breaker.probe_successes += 1
            if breaker.probe_successes >= self.config.half_open_probes:
                breaker.reset_windows()
                breaker.open_s = self.config.open_for
                self._move(breaker, CLOSED, None)
            return
        if state == OPEN:
            return  # an attempt that began before it opened
        why = breaker.record(failed, ttft)
        if why is not None:
            self._open(breaker, why)

    def release(self, breaker: Breaker) -> None:
        """Give back the probe slot `started` took (the outcome comes later, or never)."""
        if breaker.state == HALF_OPEN and breaker.probes > 0:
            breaker.probes -= 1

    # -- state changes ----------------------------------------------------------------------
    def _open(self, breaker: Breaker, reason: str) -> None:
        now = self._clock()
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
        breaker.probes = 0
        breaker.probe_successes = 0
        level = logging.INFO if state == CLOSED else logging.WARNING
        log.log(level, "breaker %s/%s/%s %s -> %s (%s)", breaker.model, breaker.tier,
                breaker.hardware, STATE_NAMES[before], STATE_NAMES[state], reason)  # fmt: skip
        if self._state is not None and self._transitions is not None:
            self._state.labels(*breaker.key).set(state)
            self._transitions.labels(*breaker.key, STATE_NAMES[state]).inc()

    def refused(self, tier: str) -> float:
        """Count a request no domain could take; return the seconds until one may probe."""
        if self._refused is not None:
            self._refused.labels(tier).inc()
        now = self._clock()
        waits = [
            b.reopen_at - now for b in self._domains.values() if b.state == OPEN and b.tier == tier
        ]
        return max(1.0, min(waits, default=1.0))

    # -- KV usage ---------------------------------------------------------------------------
    def update_kv(self) -> None:
        """Read each domain's KV usage from its backends' last `/v1/loads`; open the full ones."""
        usage: dict[tuple[str, str], list[float]] = {}
        for backend in self.backends:
            load = backend.load
            if load is not None and backend.healthy and not backend.draining:
                usage.setdefault(domain_of(backend), []).append(float(load.token_usage))
        for tier in TIERS:
            for backend in self.backends:
                self._breaker(backend, tier)  # domains exist before their first request
        self._restricted = any("tiers" in b.labels for b in self.backends)
        self._known = len(self.backends)
        for breaker in self._domains.values():
            found = usage.get((breaker.model, breaker.hardware))
            breaker.kv_usage = sum(found) / len(found) if found else None
            if (
                breaker.state != OPEN
                and breaker.kv_usage is not None
                and breaker.kv_usage > self.config.kv_open
            ):
                self._open(breaker, f"kv usage {breaker.kv_usage:.2f}")

    def relabel(self) -> None:
        """Forget which breaker each backend maps to (its labels changed), and the closed
        domains no backend is in any more."""
        for table in self._tables.values():
            table.clear()
        self._known = -1
        live = {domain_of(b) for b in self.backends}
        for key, breaker in list(self._domains.items()):
            if breaker.state == CLOSED and (breaker.model, breaker.hardware) not in live:
                del self._domains[key]
                if self._state is not None:
                    with contextlib.suppress(KeyError):
                        self._state.remove(*key)

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
                backend.labels["model"] = label
                changed = True
        if changed:
            self.relabel()

    async def _kv_loop(self) -> None:
        while True:
            try:
                await self.learn_models()
                self.update_kv()
            except Exception:  # a bug here must not stop the loop; it is logged
                log.exception("breaker update failed")
            await asyncio.sleep(self.config.kv_interval)

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
    "domain_of",
    "serves",
]
