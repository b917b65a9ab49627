"""`ProxyConfig`: every setting of the proxy core, typed, with units and documented defaults.

Loaded by `edge.wiring.config_from` from the TOML `[proxy]` table and the command line (the command
line wins). Field names are the TOML keys; `validate()` gives a clear error for each bad value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from edge.admission.settings import AdmissionSettings

SECONDS = 1.0
KiB = 1024
MiB = 1024 * KiB


@dataclass(slots=True)
class ProxyConfig:
    """Proxy-core settings. Times are in seconds, sizes in bytes."""

    backends: list[str] = field(default_factory=list)
    """Base URLs of the SGLang servers, e.g. `http://10.0.0.5:30000`."""
    policy: str = "ttft"
    """Routing policy by name (`edge.routing.POLICY_NAMES`)."""

    connect_timeout: float = 2 * SECONDS
    """TCP connect to a backend; past it the attempt is retried on another backend."""
    first_byte_timeout: float = 120 * SECONDS
    """Request sent → response headers. Generous: a long prompt queued behind others is slow."""
    chunk_timeout: float = 60 * SECONDS
    """Longest silence between two body chunks of a streaming answer before it is cut (504)."""
    max_body_bytes: int = 8 * MiB
    """Largest request body accepted (413 above it); counted as it streams in, never held past."""
    max_retries: int = 2
    """Extra attempts on other backends, only while nothing has reached the client."""

    health_interval: float = 2 * SECONDS
    """Period of the active `/health` checks and `/v1/loads` polls."""
    health_timeout: float = 1 * SECONDS
    """Deadline of one active check."""
    health_failure_threshold: int = 3
    """Consecutive failed checks that mark a backend unhealthy."""
    health_success_threshold: int = 2
    """Consecutive passed checks that mark it healthy again."""
    loads_interval: float | None = 1 * SECONDS
    """Period of `/v1/loads` polling (queue and KV usage feed routing); None turns it off."""
    eject_after_failures: int = 5
    """Consecutive connect failures / 5xx on real traffic that eject a backend (passive check)."""
    eject_base: float = 1 * SECONDS
    """First ejection's length; it doubles on each repeat, up to `eject_max`."""
    eject_max: float = 30 * SECONDS
    """Longest ejection."""

    pool_max_connections: int = 128
    """Upstream keep-alive connections per backend (requests wait for a slot at the cap)."""
    pool_warm_connections: int = 8
    """Idle connections opened per backend at start, so early requests pay no TCP connect."""
    pool_idle_timeout: float = 60 * SECONDS
    """An idle upstream connection is closed after this long (SGLang's uvicorn keeps 5 s; the pool
    notices a closed one and reconnects)."""
    max_concurrency_per_backend: int | None = None
    """Requests the edge keeps in flight on one backend; None means no cap."""

    degraded_ttft_p99: float | None = None
    """p99 TTFT above which a backend is degraded (gets work only when no other can); None: off."""
    degraded_token_usage: float | None = 0.95
    """KV-cache usage (`token_usage`, 0..1) above which a backend is degraded."""
    degraded_queue: int | None = None
    """Waiting requests (`num_waiting_reqs`) above which a backend is degraded."""

    tracing: bool = False
    """Create OpenTelemetry spans. Also turned on by OTEL_TRACES_EXPORTER=console|otlp."""
    models_ttl: float = 5 * SECONDS
    """How long the merged `/v1/models` list is reused before it is fetched again."""
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    """Tenants, quotas and throttling: read from `[admission]` and `[[tenants]]`, not `[proxy]`."""

    def validate(self) -> ProxyConfig:
        """Raise ValueError naming the first bad setting; return self for chaining."""
        if not self.backends:
            raise ValueError("proxy: at least one backend is required (--backend URL)")
        for url in self.backends:
            if not url.startswith(("http://", "https://")) or "://" == url[-3:]:
                raise ValueError(f"proxy: backend URL must be http://HOST:PORT, got {url!r}")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError("proxy: a backend URL is listed twice")
        positive = (
            "connect_timeout",
            "first_byte_timeout",
            "chunk_timeout",
            "health_interval",
            "health_timeout",
            "eject_base",
            "eject_max",
            "pool_idle_timeout",
            "max_body_bytes",
            "pool_max_connections",
            "health_failure_threshold",
            "health_success_threshold",
            "eject_after_failures",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"proxy: {name} must be > 0, got {getattr(self, name)!r}")
        if self.max_retries < 0:
            raise ValueError(f"proxy: max_retries must be >= 0, got {self.max_retries}")
        if self.models_ttl < 0:
            raise ValueError(f"proxy: models_ttl must be >= 0, got {self.models_ttl}")
        if not 0 <= self.pool_warm_connections <= self.pool_max_connections:
            raise ValueError("proxy: pool_warm_connections must be in 0..pool_max_connections")
        if self.max_concurrency_per_backend is not None and self.max_concurrency_per_backend < 1:
            raise ValueError("proxy: max_concurrency_per_backend must be >= 1")
        if self.degraded_token_usage is not None and not 0 < self.degraded_token_usage <= 1:
            raise ValueError("proxy: degraded_token_usage must be in (0, 1]")
        for name in ("degraded_ttft_p99", "degraded_queue", "loads_interval"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"proxy: {name} must be > 0, got {value!r}")
        return self

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> ProxyConfig:
        """Build from TOML-style keys, rejecting unknown keys and wrong types by name."""
        known = {f.name: f for f in fields(cls) if f.name != "admission"}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"proxy: unknown setting(s) {', '.join(unknown)}")
        config = cls()
        for name, value in values.items():
            setattr(config, name, _coerce(name, getattr(config, name), value))
        return config


_OPTIONAL_NUMBERS = {
    "loads_interval": float,
    "max_concurrency_per_backend": int,
    "degraded_ttft_p99": float,
    "degraded_token_usage": float,
    "degraded_queue": int,
}


def _coerce(name: str, default: object, value: object) -> object:
    """Check one TOML value against the field's type (ints are accepted for floats)."""
    if name == "backends":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("proxy: backends must be a list of URLs")
        return list(value)
    if name in _OPTIONAL_NUMBERS:
        if value is None:
            return None
        kind = _OPTIONAL_NUMBERS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"proxy: {name} must be a number, got {value!r}")
        if kind is int and not isinstance(value, int):
            raise ValueError(f"proxy: {name} must be an integer, got {value!r}")
        return kind(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"proxy: {name} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"proxy: {name} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"proxy: {name} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ValueError(f"proxy: {name} must be a string, got {value!r}")
        return value
    return value


__all__ = ["KiB", "MiB", "SECONDS", "ProxyConfig"]
