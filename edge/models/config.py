"""`ModelsConfig`: the `[models]` section: which backend serves which model, version and hardware
group, public aliases, and each pool's gray release (canary split, shadow, drift, ramp).

```toml
[models]
default = "llama-3-8b"                 # /generate and model "default" go here

[[models.backends]]
url = "http://10.0.0.5:30000"
model = "llama-3-8b"                   # omit to discover it from the backend
version = "v1"
hardware_group = "h200"

[[models.aliases]]
name = "llama"
model = "llama-3-8b"

[[models.rollouts]]
model = "llama-3-8b"
stable = "v1"
canary = "v2"
steps = [1, 5, 25, 50, 100]
```
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson


@dataclass(slots=True)
class BackendModel:
    """What one backend serves (a `[[models.backends]]` entry)."""

    url: str = ""
    """The backend's base URL, as in `proxy.backends`."""
    model: str | None = None
    """Model name (its pool); none: discovered from `/v1/models`."""
    version: str | None = None
    """Model version; none: SGLang's `weight_version` from `/get_model_info`."""
    hardware_group: str = "default"
    """Hardware group (`h100`, `a100` ...): the `ttft` policy learns one speed per group."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("models.backends: each entry needs a url")
        if not self.hardware_group:
            raise ValueError("models.backends.hardware_group: must not be empty")


@dataclass(slots=True)
class Alias:
    """A public name for a pool (a `[[models.aliases]]` entry)."""

    name: str = ""
    """The name clients send as `model`."""
    model: str = ""
    """The pool (model name) it stands for."""

    def __post_init__(self) -> None:
        if not self.name or not self.model:
            raise ValueError("models.aliases: each entry needs a name and a model")


@dataclass(slots=True)
class DriftConfig:
    """Output-drift checks between the stable and the canary version (`edge.models.drift`)."""

    window: int = 200
    """Samples per version in one window; a test runs each time both windows are full."""
    alpha: float = 0.001
    """False-alarm rate of one window's family of tests (Bonferroni-split over its metrics)."""
    confidence_shift: float = 0.08
    """A significant shift of the mean top-1 probability larger than this pauses the ramp."""
    entropy_change: float = 0.15
    """A significant relative change of the mean token entropy larger than this holds the ramp."""
    length_change: float = 0.25
    """A significant relative change of the mean answer length larger than this holds it."""

    def __post_init__(self) -> None:
        if self.window < 30:  # the finish share's z-test reads the normal distribution
            raise ValueError("models.rollouts.drift.window: must be >= 30")
        if not 0 < self.alpha < 1:
            raise ValueError("models.rollouts.drift.alpha: must be in (0, 1)")
        for name in ("confidence_shift", "entropy_change", "length_change"):
            if getattr(self, name) <= 0:
                raise ValueError(f"models.rollouts.drift.{name}: must be > 0")


CANARY_HEADER = "x-canary"
"""The request header that chooses a version (`edge.exchange` reads it with the others)."""


@dataclass(slots=True)
class RolloutConfig:
    """A pool's stable and canary version and how traffic moves between them."""

    model: str = ""
    """The pool (model name)."""
    stable: str = ""
    """The stable version."""
    canary: str = ""
    """The canary version."""
    steps: list[float] = field(default_factory=lambda: [1.0, 5.0, 25.0, 50.0, 100.0])
    """Canary share of traffic at each step, percent, rising; the ramp starts at the first."""
    step_requests: int = 200
    """Canary requests a step must serve before it may advance."""
    step_seconds: float = 60.0
    """Least time a step is held before it may advance, s (both this and `step_requests`)."""
    auto: bool = True
    """Advance through the steps by itself; false: only the admin API advances it (pauses,
    holds and rollbacks happen either way)."""
    header: str | None = "x-canary"
    """`x-canary`: a request with that header set to `1` goes to the canary, `0` to stable;
    `"none"` (or empty): no client chooses its version. No other name is read."""
    tenants: list[str] = field(default_factory=list)
    """Tenants (admitted by API key, `[[tenants]]` names) always sent to the canary."""
    shadow_fraction: float = 0.0
    """Share of stable requests mirrored to the canary for diff-testing, 0..1 (0: off)."""
    shadow_concurrency: int = 4
    """Shadow requests in flight at once; a mirror past it is dropped."""
    shadow_rate: float = 20.0
    """Shadow requests started per second at most (token bucket)."""
    shadow_timeout: float = 30.0
    """Longest a shadow request may take, s."""
    max_error_rate: float = 0.05
    """Canary error rate (over the last `drift.window` requests) above which it is rolled back;
    its client errors (4xx) count only beyond stable's (`edge.models.ramp`)."""
    max_ttft_p99: float | None = None
    """Canary TTFT p99 above which the ramp pauses, s; none: not checked."""
    drift: DriftConfig = field(default_factory=DriftConfig)
    """Drift checks (`[models.rollouts.drift]`)."""

    def __post_init__(self) -> None:
        if not self.model or not self.stable or not self.canary:
            raise ValueError("models.rollouts: each entry needs model, stable and canary")
        if self.stable == self.canary:
            raise ValueError("models.rollouts: stable and canary must differ")
        if self.header is not None:  # TOML has no null: "none" or "" turns the rule off
            name = self.header.strip().lower()
            if name in ("", "none"):
                self.header = None
            elif name != CANARY_HEADER:
                raise ValueError(
                    f'models.rollouts.header: the edge reads `{CANARY_HEADER}` only (or "none":'
                    f" no header rule), not {self.header!r}"
                )
            else:
                self.header = CANARY_HEADER
        if not self.steps or any(not 0 < s <= 100 for s in self.steps):
            raise ValueError("models.rollouts.steps: percentages in (0, 100]")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise ValueError("models.rollouts.steps: must rise")
        if self.step_requests < 1 or self.step_seconds < 0:
            raise ValueError("models.rollouts: step_requests >= 1 and step_seconds >= 0")
        if not 0 <= self.shadow_fraction <= 1:
            raise ValueError("models.rollouts.shadow_fraction: must be in 0..1")
        if self.shadow_concurrency < 1 or self.shadow_rate <= 0 or self.shadow_timeout <= 0:
            raise ValueError("models.rollouts: shadow limits must be > 0")
        if not 0 < self.max_error_rate <= 1:
            raise ValueError("models.rollouts.max_error_rate: must be in (0, 1]")


@dataclass(slots=True)
class ModelsConfig:
    """Model pools, aliases and gray releases (`[models]`). Empty: every backend serves one
    pool, named by what the backends report."""

    default: str | None = None
    """Pool for `/generate` and for model `default`; none: the only pool (with several, a
    request that names none gets 400 `model_required`)."""
    discover: bool = True
    """Ask each backend (`/v1/models`, `/get_model_info`) for what the config leaves open."""
    backends: list[BackendModel] = field(default_factory=list)
    """`[[models.backends]]`: model, version and hardware group per backend URL."""
    aliases: list[Alias] = field(default_factory=list)
    """`[[models.aliases]]`: public names for pools."""
    rollouts: list[RolloutConfig] = field(default_factory=list)
    """`[[models.rollouts]]`: stable and canary version per pool."""
    share_stops: bool = False
    """Share every rollback and pause with the other edges on the `[serve]` Redis (`--redis`),
    which take it too (`edge/models/rollout_sync.py`); off: each edge keeps its own ramp."""
    share_advances: bool = False
    """Share every advance and promotion the same way: an edge whose ramp is behind goes to the
    step another reached, so the edges ramp as one; off: each advances on its own requests."""
    share_key: str = "quicedge:rollouts"
    """The pub/sub channel of what is shared; edge fleets with different rollouts use different
    keys."""

    def validate(self) -> None:
        if self.default is not None and not self.default.strip():
            raise ValueError("models.default: must name a model pool (or be left out)")
        urls = [b.url.rstrip("/") for b in self.backends]
        if len(set(urls)) != len(urls):
            raise ValueError("models.backends: a url is listed twice")
        names = [a.name for a in self.aliases]
        if len(set(names)) != len(names):
            raise ValueError("models.aliases: a name is listed twice")
        pools = [r.model for r in self.rollouts]
        if len(set(pools)) != len(pools):
            raise ValueError("models.rollouts: one rollout per model")

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> ModelsConfig:
        from edge import settings

        return settings.from_mapping(cls, values, "models")


def _canonical(value: Any) -> Any:
    """`value` with every number a float, so `steps = [1, 5]` and `[1.0, 5.0]` read the same."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def entry_digest(config: RolloutConfig) -> str:
    """A short digest of a `[[models.rollouts]]` entry as configured, every key (versions,
    steps, limits, drift): what gives a step index its meaning. Processes that run the same
    entry agree on it; a reload that changes any key of it (and so restarts the rollout)
    changes it."""
    data = orjson.dumps(_canonical(asdict(config)), option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


__all__ = ["Alias", "BackendModel", "DriftConfig", "ModelsConfig", "RolloutConfig", "entry_digest"]
