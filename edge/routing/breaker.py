"""One isolation domain's circuit breaker: its settings, and the states it moves through.

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

Each state change starts a new *period*. An attempt carries the period it began in (its
`Ticket`), and its outcome counts only in that period: a request sent before the breaker
opened, or a probe of an earlier half-open period, neither frees a probe slot it never took nor
decides a verdict it was not admitted for.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from backends.backend import Backend

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
    slow_last_resort: bool = True
    """When every domain that could serve a request is open, send it to those open on their
    TTFT alone rather than refuse it: a slow answer beats a 503 when there is nowhere faster.
    Domains open on errors or KV usage never serve this way."""
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
        "period",
        "probes",
        "probe_successes",
        "reason",
        "reopen_at",
        "slow",
        "state",
        "ticket",
        "tier",
        "ttft_p99",
    )

    def __init__(self, model: str, tier: str, hardware: str, config: BreakerConfig) -> None:
        self.model, self.tier, self.hardware = model, tier, hardware
        self.config = config
        self.state = CLOSED
        self.reason: str | None = None
        self.slow = False
        """Open on its TTFT alone (not errors, not KV usage): `slow_last_resort` may use it."""
        self.opened_at = 0.0
        self.reopen_at = 0.0
        self.open_s = config.open_for
        self.period = 0
        """Which period of this breaker is running: each state change starts the next one."""
        self.ticket = Ticket(self, 0, holding=False)
        """What every attempt that takes no probe slot gets in this period: one object per
        period, not per request."""
        self.probes = 0
        """Trial requests in flight while half-open (this period's)."""
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

    def reconfigure(self, config: BreakerConfig) -> None:
        """A reloaded `[breakers]`: the thresholds apply from the next outcome; the windows keep
        their newest entries up to the new sizes; an open breaker keeps its schedule."""
        self.config = config
        if self._errors.maxlen != config.window:
            self._errors = deque(self._errors, maxlen=config.window)
            self._failures = sum(self._errors)
        if self._ttfts.maxlen != config.ttft_window:
            self._ttfts = deque(self._ttfts, maxlen=config.ttft_window)
        if self.state == CLOSED:
            self.open_s = config.open_for
        else:
            self.open_s = min(max(self.open_s, config.open_for), config.open_max)

    def new_period(self) -> None:
        """Start the next period: the attempts in flight now belong to the last one, so their
        outcomes are not counted, and the probe slots start free."""
        self.period += 1
        self.ticket = Ticket(self, self.period, holding=False)
        self.probes = 0
        self.probe_successes = 0

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
            "slow_only": self.slow if self.state == OPEN else False,
            "open_for_s": round(max(0.0, self.reopen_at - now), 3) if self.state == OPEN else 0.0,
            "error_rate": None if rate is None else round(rate, 4),
            "outcomes": len(self._errors),
            "ttft_p99_ms": None if self.ttft_p99 is None else round(self.ttft_p99 * 1000, 2),
            "kv_usage": None if self.kv_usage is None else round(self.kv_usage, 4),
            "probes_in_flight": self.probes,
        }


class Ticket:
    """One attempt's hold on its domain's breaker, from `Breakers.started` to `Breakers.ended`:
    the breaker, the period the attempt began in, and whether it still holds a probe slot."""

    __slots__ = ("breaker", "holding", "period")

    def __init__(self, breaker: Breaker, period: int, *, holding: bool) -> None:
        self.breaker = breaker
        self.period = period
        self.holding = holding

    @property
    def key(self) -> tuple[str, str, str]:
        return self.breaker.key

    @property
    def state(self) -> int:
        """The breaker's state now (not necessarily when the attempt began)."""
        return self.breaker.state
