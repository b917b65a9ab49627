"""One backend as the edge sees it: its labels, health flags, load and in-flight accounting.

`BackendRegistry.track` is the one place where the in-flight counts change; `InFlight` is the
handle it gives each request.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from backends.labels import DEFAULT_GROUP, model_label_of, split_model_label


@dataclass(frozen=True, slots=True)
class LoadView:
    """The fields of `backends.sglang.LoadSnapshot` the registry reads."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_total_tokens: int
    token_usage: float
    max_total_tokens: int | None


@dataclass(eq=False)
class Backend:
    """One backend and the edge's view of it. Identity, not value, makes two backends equal."""

    name: str
    url: str
    healthy: bool = True
    degraded: bool = False
    ejected_until: float = 0.0
    in_flight: int = 0
    """Requests the edge has in flight on this backend (changed only by `track`)."""
    in_flight_prefill_tokens: int = 0
    """Predicted uncached prompt tokens of requests not yet past their first token."""
    in_prefill: int = 0
    """Requests not yet past their first token."""
    load: Any = None
    """The last `/v1/loads` answer (a LoadSnapshot), None until one arrived. Kept while
    later polls fail: an overloaded server's may hang, and forgetting its load would clear
    the very degradation that should keep traffic off it."""
    load_polls_failed: int = 0
    """`/v1/loads` polls that failed (errors, timeouts, answers that would not parse)."""
    load_polls_failing: int = 0
    """Of them, in a row since the last that answered."""
    max_concurrency: int | None = None
    degraded_reason: str | None = None
    requests: int = 0
    successes: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    consecutive_failures: int = 0
    ejections_in_a_row: int = 0
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    check_successes: int = 0
    check_failures: int = 0
    draining: bool = False
    """Removed from the fleet (`BackendRegistry.remove`): takes no new request, finishes its own."""
    held: bool = False
    """Drained by an operator (`POST /backends/{name}/drain`): takes no new request, finishes
    its own, and stays in the fleet (checks go on) until `/undrain`. Discovery leaves it so."""
    labels: dict[str, str] = field(default_factory=dict)
    """Isolation-domain labels (`model`, `hardware`, `tiers`) from the URL's `#…` part; the
    `model` and `hardware` labels always agree with `model`, `model_version` and `hw_group`."""
    warming_until: float = 0.0
    """Not ready for routing before this `clock()` time (its cache is being warmed), unless no
    ready backend can take the request; 0 when ready."""
    model: str | None = None
    """The model it serves (its pool), from its `model=` label, the `[models]` config or
    discovered; None: unknown."""
    model_version: str | None = None
    """The version of that model (SGLang's `weight_version`, or the label's / config's)."""
    hw_group: str = "default"
    """Hardware group (e.g. `h100`, `a100`): its `hardware=` label or the `[models]` config; the
    `ttft` policy learns one speed per group, the breakers keep one domain per group."""

    def __post_init__(self) -> None:
        # The URL's labels are the operator's word: they name the model and hardware group.
        if "model" in self.labels:
            self.model, self.model_version = split_model_label(self.labels["model"])
        if "hardware" in self.labels:
            self.hw_group = self.labels["hardware"]
        self._sync_labels()

    def set_model(self, model: str | None, version: str | None) -> None:
        """Set the model and version (the pool and its version) and the `model` label with them,
        so that the breakers' domains and the pools see the same model."""
        self.model, self.model_version = model, version
        self._sync_labels()

    def set_hw_group(self, group: str) -> None:
        """Set the hardware group and the `hardware` label with it."""
        self.hw_group = group
        self._sync_labels()

    def _sync_labels(self) -> None:
        if self.model is not None:
            self.labels["model"] = model_label_of(self.model, self.model_version)
        if self.hw_group != DEFAULT_GROUP or "hardware" in self.labels:
            self.labels["hardware"] = self.hw_group

    def ttft_p99(self) -> float | None:
        if not self.ttfts:
            return None
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]

    def __repr__(self) -> str:
        return (
            f"<Backend {self.name} healthy={self.healthy} degraded={self.degraded} "
            f"in_flight={self.in_flight} prefill_tokens={self.in_flight_prefill_tokens}>"
        )


class InFlight:
    """One request in flight on a backend, as handed out by `BackendRegistry.track`."""

    __slots__ = ("_in_prefill", "backend", "prefill_tokens")

    def __init__(self, backend: Backend, prefill_tokens: int) -> None:
        self.backend = backend
        self.prefill_tokens = prefill_tokens
        self._in_prefill = True

    def first_token(self) -> None:
        """The first token arrived: this request no longer queues prefill work. Idempotent."""
        if self._in_prefill:
            self._in_prefill = False
            self.backend.in_flight_prefill_tokens -= self.prefill_tokens
            self.backend.in_prefill -= 1
